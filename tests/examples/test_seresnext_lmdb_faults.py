"""The example survives faults: torchrun and spawn restarts, SIGTERM to the launcher, new world.

Each run is the real ``examples/seresnext_lmdb.py`` on 2 CPU processes (Gloo)
with timm's tiny ``test_resnet`` on a small shapes LMDB, step checkpoints every
2 steps, and PowerSGD gradient compression from step 2 on (``--comm-hook
powersgd``), whose per-rank state each resume must give back. torchrun's runs
that get a kill or SIGTERM have data workers from a forkserver
(``--worker-start``); the other runs read without workers (``-j 0``): a
sample's augmentation depends on (seed, epoch, index) alone, so they see the
same batches, and the weights and optimizer momenta every interrupted and
resumed run ends with must be the uninterrupted run's, ``torch.equal``. The
launchers start from the suite's preloaded server (``tests/helpers/warm.py``).
The ranks ``spawn`` starts are fresh interpreters, as in a user's job;
torchrun's workers start from the server too (``torchrun_warm_env``), so the
runs that need no ``spawn`` (the reference, the resumed runs, torchrun's
faults) use torchrun.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from launched import LIMIT_S as _LIMIT_S  # type: ignore[import-not-found]
from launched import launch
from launched import shown as _shown
from launched import when_step_saved as _when_step_saved
from launched import workers as _workers
from warm import WarmProcess, torchrun_command, torchrun_warm_env  # type: ignore[import-not-found]

from ddpkit import PREEMPTED_EXIT_CODE, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "seresnext_lmdb.py"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
# 96 images, a global batch of 12 on 2 ranks: 8 steps an epoch, 16 in all; step
# checkpoints every 2 steps (8 and 16 end an epoch). A signal sent once a step's
# checkpoint appears (written in the background, so the ranks may be a step or two
# further) still lands well inside the epoch: never while a validation's data
# workers start, which a launcher's signal to the whole process group would kill.
EPOCHS = 2


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import ddpkit
    from ddpkit.data.shapes import make_shapes_dataset

    root = tmp_path_factory.mktemp("shapes")
    sizes = {"train_per_class": 32, "val_per_class": 4, "size": 32}
    dirs = make_shapes_dataset(root / "src", classes=3, **sizes)
    for split, source in zip(("train", "val"), dirs, strict=True):
        ddpkit.build_lmdb(source, root / f"{split}.lmdb", progress=False)
    return root


def _args(data: Path, checkpoints: Path, *extra: str, workers: int = 2) -> list[str]:
    return [str(SCRIPT), "--data", str(data), "--arch", "test_resnet", "--image-size", "32",
            "--epochs", str(EPOCHS), "-b", "12", "-j", str(workers), "--requires-grad",
            "--lr", "0.05", "--checkpoints", str(checkpoints), "--save-every-steps", "2",
            "--network", "tiny", "--dist-backend", "gloo", "--worker-start", "forkserver",
            "--comm-hook", "powersgd", "--powersgd-warmup", "2", *extra]  # fmt: skip


def _torchrun(*extra: str, nprocs: int = 2) -> list[str]:
    return torchrun_command(nprocs, *extra)


def _resume(data: Path, checkpoints: Path, nprocs: int) -> list[str]:
    """A run under torchrun on ``nprocs`` that resumes ``checkpoints`` to the end."""
    return [*_torchrun(nprocs=nprocs), *_args(data, checkpoints, "--resume", workers=0)]


def _spawn(data: Path, checkpoints: Path, *extra: str) -> list[str]:
    return [sys.executable, *_args(data, checkpoints, "--multiprocessing-distributed",
                                   "--nprocs", "2", *extra, workers=0)]  # fmt: skip


def _launch(
    command: list[str], when: Callable[[WarmProcess], None] | None = None
) -> tuple[int, str]:
    torchrun = command[1:3] == ["-m", "torch.distributed.run"]
    return launch(command, torchrun_warm_env(_env()) if torchrun else _env(), ROOT, when)


def _run(command: list[str], when: Callable[[WarmProcess], None] | None = None) -> str:
    """The output of ``command``, which must succeed."""
    code, out = _launch(command, when)
    assert code == 0, _shown(out)
    return out


def _kill_a_worker(checkpoints: Path, step: int) -> Callable[[WarmProcess], None]:
    def kill(proc: WarmProcess) -> None:
        _when_step_saved(checkpoints, step)
        workers = _workers(proc.pid)
        assert workers, "no worker process found"
        os.kill(max(workers), signal.SIGKILL)

    return kill


def _terminate_launcher(checkpoints: Path, step: int) -> Callable[[WarmProcess], None]:
    def term(proc: WarmProcess) -> None:
        _when_step_saved(checkpoints, step)
        proc.send_signal(signal.SIGTERM)

    return term


def _final(checkpoints: Path) -> dict[str, torch.Tensor]:
    """The last weights and the optimizer's momenta."""
    state = load_checkpoint(checkpoints / "latest.pth")
    momenta = {
        f"momentum {i}": s["momentum_buffer"] for i, s in state["optimizer"]["state"].items()
    }
    assert momenta
    assert len(state["comm_hook"]) == 2  # each rank's PowerSGD state
    return state["model"] | momenta


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    checkpoints = tmp_path_factory.mktemp("reference")
    out = _run([*_torchrun(), *_args(data, checkpoints, workers=0)])
    assert f"epoch {EPOCHS}/{EPOCHS}: train_loss" in out, _shown(out)
    return _final(checkpoints)


def _assert_equal(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(weights[key], value), key


def _kill_then_terminate(checkpoints: Path) -> Callable[[WarmProcess], None]:
    """Kill a worker once step 2 is saved; SIGTERM the launcher once the restarted run saved 10."""

    def faults(proc: WarmProcess) -> None:
        _kill_a_worker(checkpoints, 2)(proc)
        _terminate_launcher(checkpoints, 10)(proc)

    return faults


# The spawn launcher gets both faults in one job: a worker killed after step 2 (the
# launcher restarts them all, which resume from that step), then SIGTERM to the launcher
# after step 10 (the workers save and stop). A run resumes it to the end, and its weights
# must be the reference's: they are only if both resumes were exact. The tests of a
# launcher share its job and the resumed run, and each asserts on its part of them.
# torchrun gets each fault in a job of its own (SIGTERM to torchrun after a restart
# sometimes lost a rank: docs/testing.md).
Job = tuple[int, str, Path]  # a run's status, output and checkpoints


def _faulty_job(command: list[str], checkpoints: Path) -> Job:
    code, out = _launch(command, _kill_then_terminate(checkpoints))
    return code, out, checkpoints


def _resumed(job: Job, data: Path, tmp_path_factory: pytest.TempPathFactory, nprocs: int) -> Job:
    """A run on ``nprocs`` that resumes a copy of ``job``'s checkpoints to the end."""
    copy = tmp_path_factory.mktemp("resumed") / "checkpoints"
    shutil.copytree(job[2], copy)
    code, out = _launch(_resume(data, copy, nprocs))
    return code, out, copy


@pytest.fixture(scope="module")
def spawn_job(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Job:
    checkpoints = tmp_path_factory.mktemp("spawn")
    return _faulty_job(_spawn(data, checkpoints, "--max-restarts", "2"), checkpoints)


@pytest.fixture(scope="module")
def spawn_resumed(data: Path, spawn_job: Job, tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _resumed(spawn_job, data, tmp_path_factory, 2)


def _assert_resumed_bit_exact(resumed: Job, reference: dict[str, torch.Tensor]) -> None:
    code, out, checkpoints = resumed
    assert code == 0, _shown(out)
    assert "resuming at epoch" in out, _shown(out)
    _assert_equal(_final(checkpoints), reference)


def _assert_stop_checkpoint(out: str) -> None:
    """The stop names the checkpoint it wrote, which exists: interrupted.pth, or latest.pth
    when the step the ranks agreed to stop after was the last of an epoch."""
    said = re.search(r"stopped by SIGTERM after step \d+, checkpoint (\S+);", out)
    assert said is not None, _shown(out)
    path = Path(said.group(1))
    assert path.name in ("interrupted.pth", "latest.pth"), said.group(0)
    assert path.is_file(), said.group(0)


@pytest.mark.timeout(2 * _LIMIT_S)
def test_torchrun_restarts_a_killed_worker_and_ends_bit_exact(
    data: Path, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    # Killed in epoch 2 (steps 8 to 15), with PowerSGD compressing since step 2.
    command = [*_torchrun("--max-restarts", "3"), *_args(data, tmp_path, "--resume")]
    out = _run(command, _kill_a_worker(tmp_path, 10))
    resumed = re.search(r"resuming at epoch 2 step (\d+) \(\d+ batches of the epoch done\)", out)
    assert resumed, _shown(out)
    assert int(resumed.group(1)) >= 10  # from a step checkpoint, not from the start
    assert "start afresh" not in out, _shown(out)
    _assert_equal(_final(tmp_path), reference)


@pytest.mark.timeout(3 * _LIMIT_S)
def test_spawn_max_restarts_restarts_a_killed_process_and_ends_bit_exact(
    spawn_job: Job, spawn_resumed: Job, reference: dict[str, torch.Tensor]
) -> None:
    out = spawn_job[1]
    assert "restarting all 2 processes (restart 1 of 2)" in out, _shown(out)
    assert "resuming at epoch" in out, _shown(out)
    _assert_resumed_bit_exact(spawn_resumed, reference)


@pytest.mark.timeout(3 * _LIMIT_S)
def test_sigterm_to_the_launcher_exits_75_and_the_resumed_run_is_bit_exact(
    spawn_job: Job, spawn_resumed: Job, reference: dict[str, torch.Tensor]
) -> None:
    code, out, _ = spawn_job
    assert code == PREEMPTED_EXIT_CODE, _shown(out)
    _assert_stop_checkpoint(out)
    _assert_resumed_bit_exact(spawn_resumed, reference)


@pytest.mark.timeout(3 * _LIMIT_S)
def test_a_2_rank_run_continues_on_3_with_a_warning(
    data: Path, spawn_job: Job, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert spawn_job[0] == PREEMPTED_EXIT_CODE, _shown(spawn_job[1])
    code, out, checkpoints = _resumed(spawn_job, data, tmp_path_factory, 3)
    assert code == 0, _shown(out)
    assert "not bit-exact" in out, _shown(out)
    assert "PowerSGD's error feedback and P/Q memories start afresh" in out, _shown(out)
    assert "saved by 2 ranks and this job has 3" in out, _shown(out)
    assert f"epoch {EPOCHS}/{EPOCHS}: train_loss" in out, _shown(out)
    assert load_checkpoint(checkpoints / "latest.pth")["world_size"] == 3


@pytest.mark.timeout(2 * _LIMIT_S)
def test_sigterm_to_torchrun_reaches_the_workers_which_save_and_resume_bit_exact(
    data: Path, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    command = [*_torchrun("--max-restarts", "3"), *_args(data, tmp_path, "--resume")]
    code, out = _launch(command, _terminate_launcher(tmp_path, 2))
    assert code != 0, _shown(out)  # torchrun's own status after a signal; never a restart
    assert "stopped by SIGTERM after step" in out, _shown(out)
    _assert_stop_checkpoint(out)
    out = _run(_resume(data, tmp_path, 2))
    assert "resuming at epoch" in out, _shown(out)
    _assert_equal(_final(tmp_path), reference)


@pytest.mark.timeout(2 * _LIMIT_S)
def test_ctrl_c_to_torchrun_stops_the_ranks_with_a_checkpoint(data: Path, tmp_path: Path) -> None:
    # What docs/quickstart.md says a person sees: the ranks' stop line and checkpoint, then
    # torchrun's own SignalException traceback and its exit status 1.
    def interrupt(proc: WarmProcess) -> None:
        _when_step_saved(tmp_path, 2)
        proc.send_signal(signal.SIGINT)

    code, out = _launch([*_torchrun(), *_args(data, tmp_path, workers=0)], interrupt)
    assert code == 1, _shown(out)
    said = re.search(r"stopped by SIGINT after step \d+, checkpoint (\S+);", out)
    assert said is not None, _shown(out)
    assert Path(said.group(1)).is_file()
    assert "SignalException" in out[said.end() :]  # torchrun's traceback comes after it
