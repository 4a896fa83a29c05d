"""The hand-written loop keeps every guarantee: a SIGKILL resumes bit-exact, SIGTERM saves, 75.

Each run is the real ``examples/own_loop.py`` on 2 CPU processes, with timm's
tiny ``test_resnet`` on a small shapes LMDB, and every part of the one step
``fit`` takes too: bf16 autocast, 2 micro-batches per optimizer step, clipping
and the model's average, with a step checkpoint every 2 optimizer steps. 48
training images, a global batch of 4: 12 micro-batches and 6 optimizer steps
an epoch, 12 steps in all.
The runs that get the faults start their ranks with ``--nproc-per-node 2``
(``ddpkit.spawn``, fresh interpreters as in a user's job); the reference and
the resumed runs under torchrun, whose workers start from the suite's server
(``warm.torchrun_warm_env``): where a run resumes from is not about how its
ranks started.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from launched import LIMIT_S, kill_tree, launch, shown, when_step_saved  # type: ignore[import-not-found]
from nested import assert_nested_equal  # type: ignore[import-not-found]
from warm import WarmProcess, torchrun_command, torchrun_warm_env  # type: ignore[import-not-found]

import ddpkit
from ddpkit import PREEMPTED_EXIT_CODE, load_checkpoint
from ddpkit.examples import own_loop

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "own_loop.py"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _shapes(root: Path, train_per_class: int) -> Path:
    dirs = ddpkit.make_shapes_dataset(
        root / "src", classes=3, train_per_class=train_per_class, val_per_class=2, size=32
    )
    for split, source in zip(("train", "val"), dirs, strict=True):
        ddpkit.build_lmdb(source, root / f"{split}.lmdb", progress=False)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _shapes(tmp_path_factory.mktemp("shapes"), 16)


# The step's every part, as fit's: mixed precision, accumulation, clipping, the average;
# and PowerSGD from step 2 on, whose per-rank state the resumes must give back.
STEP_FLAGS = ("--amp", "bf16", "--grad-accum-steps", "2", "--clip-grad", "1.0",
              "--model-ema", "--model-ema-decay", "0.999",
              "--comm-hook", "powersgd", "--powersgd-warmup", "2")  # fmt: skip


def _flags(data: Path, checkpoints: Path, *extra: str) -> list[str]:
    return [str(SCRIPT), "--data", str(data), "--arch", "test_resnet", "--image-size", "32",
            "-b", "4", "--epochs", "2", "--lr", "0.05", "--milestones", "1",
            "--checkpoints", str(checkpoints), "--save-every-steps", "2", *STEP_FLAGS,
            *extra]  # fmt: skip


def _command(data: Path, checkpoints: Path, *extra: str) -> list[str]:
    """The script on 2 ranks of ``ddpkit.spawn``."""
    return [sys.executable, *_flags(data, checkpoints, "--nproc-per-node", "2", *extra)]


def _torchrun(data: Path, checkpoints: Path, *extra: str) -> tuple[int, str]:
    """The script on 2 workers of torchrun, started warm: its status and output."""
    command = torchrun_command(2, *_flags(data, checkpoints, *extra))
    return launch(command, torchrun_warm_env(_env()), ROOT)


def _run(data: Path, checkpoints: Path, *extra: str) -> str:
    code, out = _torchrun(data, checkpoints, *extra)
    assert code == 0, shown(out)
    return out


def _weights(checkpoints: Path) -> dict[str, Any]:
    """What must be equal: the model, its average and the optimizer (momentum included)."""
    saved = load_checkpoint(checkpoints / "latest.pth")
    return {"model": saved["model"], "ema": saved["ema"], "optimizer": saved["optimizer"]}


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    checkpoints = tmp_path_factory.mktemp("reference")
    out = _run(data, checkpoints)
    assert "epoch 2/2: step 12, val acc1" in out, shown(out)
    assert re.search(r"epoch 2/2: .*, all-reduce [\d.e-]+ MB/step", out), shown(out)
    return _weights(checkpoints)


@pytest.mark.timeout(3 * LIMIT_S)
def test_a_sigkill_mid_epoch_resumes_bit_exact(
    data: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    checkpoints = tmp_path / "killed"

    def kill(proc: WarmProcess) -> None:
        when_step_saved(checkpoints, 8)  # in epoch 2 (steps 7-12)
        # At once: the ranks are in step 9's window, its first micro-batch done or on the
        # way, its gradients accumulated under no_sync and never stepped.
        kill_tree(proc.pid)  # the parent and both ranks, as a lost node would

    code, out = launch(_command(data, checkpoints), _env(), ROOT, kill)
    assert code == -signal.SIGKILL, shown(out)
    assert "epoch 2/2" not in out
    out = _run(data, checkpoints, "--resume")
    resumed = re.search(r"resuming from step-0*(\d+)\.pth \(step: in epoch 2", out)
    assert resumed is not None, shown(out)  # mid-epoch, not from the epoch's start
    assert 8 <= int(resumed.group(1)) < 12
    assert "epoch 1/2" not in out
    assert "epoch 2/2: step 12" in out, shown(out)
    assert_nested_equal(_weights(checkpoints), reference)


@pytest.mark.timeout(3 * LIMIT_S)
def test_sigterm_saves_and_exits_75_and_a_changed_data_set_is_refused(
    data: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    checkpoints = tmp_path / "stopped"

    def term(proc: WarmProcess) -> None:
        # In epoch 1 (steps 1-6): the ranks may be a few steps past the saved one when the
        # signal lands (3 past it on a loaded machine), so the first step file sends it.
        when_step_saved(checkpoints, 2)
        proc.send_signal(signal.SIGTERM)

    code, out = launch(_command(data, checkpoints), _env(), ROOT, term)
    assert code == PREEMPTED_EXIT_CODE, shown(out)
    assert (checkpoints / "interrupted.pth").exists()
    stopped = load_checkpoint(checkpoints / "interrupted.pth")["position"]
    assert stopped["epoch"] == 0
    assert 2 <= stopped["step"] < 6  # mid-epoch
    assert stopped["batches"] == 2 * stopped["step"]  # after a window's last micro-batch
    # Other data (more images): the rest of the epoch would be another order. Refused.
    other = _shapes(tmp_path / "other", 20)
    code, out = _torchrun(other, checkpoints, "--resume")
    assert code != 0
    assert re.search(r"the training set had 48 samples then and has 60 now", out), shown(out)
    assert "Resume with the data it was saved with" in out
    # The data it was saved with: it goes on, to the uninterrupted run's weights.
    out = _run(data, checkpoints, "--resume")
    assert_nested_equal(_weights(checkpoints), reference)


def test_the_flags_take_a_config_file_and_check_the_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "recipe.toml").write_text('data = "d"\nepochs = 3\nmodel-ema = true\n')
    args = own_loop.parse_args(["--config", str(tmp_path / "recipe.toml"), "--epochs", "5"])
    assert (args.data, args.epochs, args.model_ema) == ("d", 5, True)
    assert args.sources == {"config": "command line", "data": "config", "epochs": "command line",
                            "model_ema": "config"}  # fmt: skip
    for argv, said in (
        ([], "--data DIR is required"),
        (["--data", "d", "-b", "5", "--nproc-per-node", "2"], "-b 5 is not divisible by"),
        (["--data", "d", "--model-ema-decay", "1"], "--model-ema-decay: must be < 1"),
        (["--data", "d", "--powersgd-rank", "2"], "--powersgd-* set PowerSGD's options"),
    ):
        with pytest.raises(SystemExit) as exited:
            own_loop.parse_args(argv)
        assert exited.value.code == 2
        assert said in capsys.readouterr().err


def test_checkpoints_on_a_store_resume_on_another_machine(data: Path, tmp_path: Path) -> None:
    """--checkpoints s3://... (moto's S3 server on 127.0.0.1): one epoch, then the second
    resumed where no local file of the run is (the example's test refuses a missing bucket)."""
    from s3_fixtures import S3Server  # type: ignore[import-not-found]

    server = S3Server()
    try:
        url = f"s3://{server.bucket()}/own"

        def run(machine: str, *extra: str) -> tuple[int, str]:
            env = {**_env(), **server.env(), "XDG_CACHE_HOME": str(tmp_path / machine)}
            command = [sys.executable, *_flags(data, Path("unused"), "--checkpoints", url, *extra)]
            return launch(command, env, ROOT)

        code, out = run("first", "--epochs", "1")
        assert code == 0, shown(out)
        code, out = run("second", "--epochs", "2", "--resume")
        assert code == 0, shown(out)
        assert re.search(r"resuming from latest\.pth \(epoch: end of epoch 1", out), shown(out)
        assert "epoch 2/2" in out, shown(out)
    finally:
        server.stop()
