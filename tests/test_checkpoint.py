"""ddpkit.checkpoint: atomic weights_only-safe files, rank-0 helpers, RNG, CheckpointManager."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.checkpoint import (
    CheckpointError,
    CheckpointManager,
    RankZeroError,
    capture_rng_state,
    load_checkpoint,
    rank0_only,
    rank_zero_first,
    restore_rng_state,
    save_checkpoint,
)
from ddpkit.comm import barrier, get_rank
from ddpkit.testing import run_distributed


class _Custom:
    """A class that only a full unpickle can rebuild."""


def _trained() -> tuple[nn.Linear, torch.optim.SGD, torch.optim.lr_scheduler.StepLR]:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_round_trip_converts_numpy_scalars_in_a_copy(tmp_path: Path) -> None:
    model, optimizer, scheduler = _trained()
    metrics = {"acc1": np.float32(71.5), "count": np.int64(7), "ok": np.bool_(True)}
    obj = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "metrics": metrics,
        "meta": (torch.Size([2, 3]), torch.float16, torch.device("cpu"), None, "x", 2**70),
    }
    path = tmp_path / "ckpt.pth"
    save_checkpoint(obj, path)

    back = load_checkpoint(path)
    assert _leftovers(tmp_path) == ["ckpt.pth"]
    for key, value in model.state_dict().items():
        assert torch.equal(back["model"][key], value)
    momentum = back["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert back["scheduler"] == scheduler.state_dict()
    assert back["metrics"] == {"acc1": 71.5, "count": 7, "ok": True}
    assert [type(v) for v in back["metrics"].values()] == [float, int, bool]
    assert back["meta"] == obj["meta"]
    assert type(metrics["acc1"]) is np.float32  # the caller's object is untouched
    assert torch.load(path, weights_only=True)["meta"][0] == torch.Size([2, 3])


@pytest.mark.parametrize(
    ("bad", "where", "hint"),
    [
        ({"metrics": {"acc1": lambda: 1.0}}, "metrics.acc1", "function"),
        ({"extra": [1, _Custom()]}, "extra.1", "_Custom"),
        (
            {"optimizer": {"state": {3: {"momentum_buffer": np.zeros(2)}}}},
            "optimizer.state.3.momentum_buffer",
            "torch.from_numpy",
        ),
        ({"counts": collections.defaultdict(int)}, "counts", "defaultdict"),
        ({"k": {_Custom(): 1}}, "(the key)", "_Custom"),
    ],
)
def test_refuses_what_weights_only_cannot_load(
    tmp_path: Path, bad: dict[str, Any], where: str, hint: str
) -> None:
    path = tmp_path / "ckpt.pth"
    save_checkpoint({"step": 1}, path)
    with pytest.raises(TypeError, match=rf"{where}.*{hint}|{hint}.*{where}"):
        save_checkpoint(bad, path)
    assert _leftovers(tmp_path) == ["ckpt.pth"]
    assert load_checkpoint(path) == {"step": 1}


def test_failure_while_writing_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.pth"
    save_checkpoint({"step": 1}, path)

    def disk_full(obj: object, f: Any) -> None:
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert _leftovers(tmp_path) == ["ckpt.pth"]
    assert load_checkpoint(path) == {"step": 1}


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        save_checkpoint({"a": 1}, tmp_path / "nowhere" / "ckpt.pth")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="file"):
        save_checkpoint({"a": 1}, tmp_path / "file" / "ckpt.pth")


_CRASH_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from ddpkit.checkpoint import save_checkpoint
    save_checkpoint({"step": 1, "w": torch.ones(4)}, sys.argv[1])
    big = torch.ones(50_000_000)  # 200 MB: the write takes long enough to be killed
    print("first saved", flush=True)
    save_checkpoint({"step": 2, "big": big}, sys.argv[1])
    print("second saved", flush=True)
    """
)


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASH_SCRIPT, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "first saved"
        deadline, last_size = time.monotonic() + 60, 0
        while True:
            assert time.monotonic() < deadline, "the second save never started writing"
            assert proc.poll() is None, "the second save finished before it could be killed"
            temps = list(tmp_path.glob(".ckpt.pth.tmp-*"))
            size = temps[0].stat().st_size if temps else 0
            if 0 < last_size < size:  # the temp file is there and growing
                break
            last_size = size
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    back = load_checkpoint(path)
    assert back["step"] == 1
    assert torch.equal(back["w"], torch.ones(4))


def test_load_reports_damaged_missing_and_unsafe_files(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    save_checkpoint({"w": torch.arange(1000.0)}, path)
    data = path.read_bytes()
    for size in (0, 10, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=r"ckpt\.pth is damaged.*older checkpoint"):
            load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match=r"absent\.pth"):
        load_checkpoint(tmp_path / "absent.pth")
    unsafe = tmp_path / "unsafe.pth"
    torch.save({"obj": _Custom()}, unsafe)
    with pytest.raises(CheckpointError, match=r"unsafe\.pth.*_Custom.*weights_only-safe"):
        load_checkpoint(unsafe)
    torch.save(torch.ones(2), unsafe)
    with pytest.raises(CheckpointError, match="not a dict"):
        load_checkpoint(unsafe)


def test_rng_state_round_trips_through_a_file(tmp_path: Path) -> None:
    state = capture_rng_state()
    expected = (torch.rand(3), random.random(), np.random.rand(2), np.random.randn())
    save_checkpoint({"rng": state}, tmp_path / "rng.pth")
    # Move every generator on, as the rest of a training epoch would.
    torch.rand(5)
    random.random()
    np.random.rand(7)
    restore_rng_state(load_checkpoint(tmp_path / "rng.pth")["rng"])
    again = (torch.rand(3), random.random(), np.random.rand(2), np.random.randn())
    assert torch.equal(again[0], expected[0])
    assert again[1] == expected[1]
    assert np.array_equal(again[2], expected[2])
    assert again[3] == expected[3]
    with pytest.raises(ValueError, match="numpy"):
        restore_rng_state({"python": state["python"], "torch": state["torch"]})


@rank0_only
def _plain() -> str:
    return f"ran on {get_rank()}"


@rank0_only(sync=True)
def _write_into(path: str) -> str:
    save_checkpoint({"a": 1}, path)
    return "written"


def _rank0_helpers(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {"plain": _plain()}
    out["synced"] = _write_into(os.path.join(directory, f"ok{rank}.pth"))
    with rank_zero_first():
        marker = Path(directory, "first")
        out["saw_marker"] = marker.exists()
        if rank == 0:
            marker.write_text("rank 0 was here")
    try:
        # The parent is a regular file: fails for everyone, root included.
        _write_into(os.path.join(directory, "first", "ckpt.pth"))
        out["error"] = None
    except RankZeroError as e:
        out["error"] = ("RankZeroError", e.exc_type, str(e), e.remote_traceback)
    except OSError as e:
        out["error"] = ("own", type(e).__name__, str(e), "")
    barrier()  # every rank got here: nobody hangs in the next collective
    # Only rank 0's directory holds a checkpoint, as on nodes without a shared file system.
    try:
        CheckpointManager(Path(directory, f"node{rank}")).resume(nn.Linear(4, 2))
        out["resume"] = None
    except CheckpointError as e:
        out["resume"] = str(e)
    return out


@pytest.fixture(scope="module")
def two_rank_helpers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    directory = tmp_path_factory.mktemp("helpers")
    _save_one_process(directory / "node0", [1.0, 2.0], keep_last=1)
    return directory, run_distributed(_rank0_helpers, 2, args=(str(directory),), timeout=90)


def test_rank0_only_inside_a_process_group(two_rank_helpers: tuple[Path, list[Any]]) -> None:
    tmp_path, (r0, r1) = two_rank_helpers
    assert (r0["plain"], r1["plain"]) == ("ran on 0", None)
    assert (r0["synced"], r1["synced"]) == ("written", None)
    assert (tmp_path / "ok0.pth").exists()
    assert not (tmp_path / "ok1.pth").exists()
    assert (r0["saw_marker"], r1["saw_marker"]) == (False, True)
    assert r0["error"][:2] == ("own", "NotADirectoryError")
    kind, exc_type, message, remote = r1["error"]
    assert (kind, exc_type) == ("RankZeroError", "NotADirectoryError")
    assert "rank 0 raised NotADirectoryError" in message
    assert "not a directory" in message
    assert "save_checkpoint" in remote


def test_resume_refuses_ranks_that_see_different_files(
    two_rank_helpers: tuple[Path, list[Any]],
) -> None:
    for result in two_rank_helpers[1]:
        assert "different checkpoints" in result["resume"]
        assert "rank 0: latest.pth of epoch 1, rank 1: nothing" in result["resume"]


def test_rank0_only_without_a_process_group(tmp_path: Path) -> None:
    assert _plain() == "ran on 0"
    assert _write_into(str(tmp_path / "a.pth")) == "written"
    with pytest.raises(FileNotFoundError):
        _write_into(str(tmp_path / "missing" / "a.pth"))


ACCURACIES = [10.0, 30.0, 20.0, 40.0, 35.0]


def _setup(seed: int) -> tuple[nn.Module, torch.optim.SGD, Any, torch.amp.GradScaler]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler, torch.amp.GradScaler("cpu", init_scale=2.0**seed)


def _snapshot(model: nn.Module, optimizer: Any, scheduler: Any, scaler: Any) -> dict[str, Any]:
    return {
        "weights": [p.detach().tolist() for p in model.parameters()],
        "momentum": [s["momentum_buffer"].tolist() for s in optimizer.state.values()],
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
    }


def _draws() -> list[Any]:
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _save_then_resume(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    model, optimizer, scheduler, scaler = _setup(5)
    ddp = DistributedDataParallel(model)
    torch.manual_seed(100 + rank)  # each rank draws different data and RNG states
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    manager = CheckpointManager(directory, network="net", keep_last=2)
    returned = []
    for epoch, acc1 in enumerate(ACCURACIES, start=1):
        ddp(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        metrics = {"acc1": acc1, "loss": 1.0 / epoch}
        returned.append(manager.save(epoch, ddp, optimizer, scheduler, scaler, metrics=metrics))
    saved = {
        "returned": [str(p) if p else None for p in returned],
        "best": manager.best_acc1,
        "state": _snapshot(model, optimizer, scheduler, scaler),
        "draws": _draws(),  # what this rank draws next
    }
    # A restart: new objects, another seed, a new manager on the same directory.
    model, optimizer, scheduler, scaler = _setup(9)
    manager = CheckpointManager(directory, network="net", keep_last=2)
    start = manager.resume(DistributedDataParallel(model), optimizer, scheduler, scaler)
    resumed = {
        "start": start,
        "best": manager.best_acc1,
        "state": _snapshot(model, optimizer, scheduler, scaler),
        "draws": _draws(),
    }
    return {"saved": saved, "resumed": resumed}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("run") / "checkpoints"
    results = run_distributed(_save_then_resume, 2, args=(str(directory),), timeout=120)
    return directory, results


def test_manager_writes_latest_epochs_and_best(
    two_rank_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = two_rank_run
    r0, r1 = (result["saved"] for result in results)
    assert r0["returned"] == [str(directory / "latest.pth")] * 5
    assert r1["returned"] == [None] * 5
    assert r0["best"] == r1["best"] == 40.0
    assert _leftovers(directory) == [
        "best.pth",
        "latest.pth",
        "net-epoch4-acc40.00.pth",
        "net-epoch5-acc35.00.pth",
        "previous.pth",
    ]
    for path in directory.iterdir():
        torch.load(path, weights_only=True)
    best, epoch4 = directory / "best.pth", directory / "net-epoch4-acc40.00.pth"
    assert best.stat().st_ino == epoch4.stat().st_ino  # a hard link, not a copy

    latest = load_checkpoint(directory / "latest.pth")
    assert latest["format"] == "ddpkit-checkpoint"
    assert latest["version"] == 1
    assert (latest["epoch"], latest["acc1"], latest["loss"]) == (5, 35.0, 0.2)
    assert latest["lr"] == pytest.approx(0.1 * 0.5**2)
    assert latest["world_size"] == 2
    assert latest["best_acc1"] == 40.0
    assert set(latest["model"]) == {"weight", "bias"}  # no DDP "module." prefix
    assert len(latest["rng"]) == 2
    assert not torch.equal(latest["rng"][0]["torch"], latest["rng"][1]["torch"])
    assert load_checkpoint(directory / "previous.pth")["epoch"] == 4
    weights = load_checkpoint(directory / "net-epoch5-acc35.00.pth")
    assert torch.equal(weights["weight"], torch.tensor(r0["state"]["weights"][0]))


def test_manager_resume_restores_state_and_rng(
    two_rank_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    for result in two_rank_run[1]:
        saved, resumed = result["saved"], result["resumed"]
        assert resumed["start"] == 6
        assert resumed["best"] == 40.0
        assert resumed["state"] == saved["state"]
        assert resumed["draws"] == saved["draws"]
    assert two_rank_run[1][0]["resumed"]["draws"] != two_rank_run[1][1]["resumed"]["draws"]


def test_resume_with_another_world_size(two_rank_run: tuple[Path, list[dict[str, Any]]]) -> None:
    directory, results = two_rank_run
    saved = results[0]["saved"]
    model, optimizer, scheduler, scaler = _setup(9)
    manager = CheckpointManager(directory, network="net")
    with pytest.raises(CheckpointError, match=r"RNG states for 2 ranks.*has 1.*strict_rng=False"):
        manager.resume(model, optimizer, scheduler, scaler)
    assert _snapshot(model, optimizer, scheduler, scaler) != saved["state"]  # untouched
    rng_before = torch.get_rng_state()
    with pytest.warns(RuntimeWarning, match="without restoring RNG"):
        assert manager.resume(model, optimizer, scheduler, scaler, strict_rng=False) == 6
    assert _snapshot(model, optimizer, scheduler, scaler) == saved["state"]
    assert torch.equal(torch.get_rng_state(), rng_before)


def _save_one_process(directory: Path, accuracies: list[float], keep_last: int) -> list[Any]:
    model, optimizer, scheduler, scaler = _setup(1)
    manager = CheckpointManager(directory, keep_last=keep_last)
    weights = []
    for epoch, acc1 in enumerate(accuracies):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights.append(model.weight.detach().clone())
        manager.save(epoch, model, optimizer, scheduler, scaler, metrics={"acc1": acc1})
    return weights


def test_damaged_latest_falls_back_to_previous(tmp_path: Path) -> None:
    weights = _save_one_process(tmp_path, [10.0, 40.0, 20.0, 30.0], keep_last=1)
    # The best epoch (1) stays next to the newest (3); the others are pruned.
    assert _leftovers(tmp_path) == [
        "best.pth",
        "latest.pth",
        "model-epoch1-acc40.00.pth",
        "model-epoch3-acc30.00.pth",
        "previous.pth",
    ]
    latest = tmp_path / "latest.pth"
    latest.write_bytes(latest.read_bytes()[:500])  # a truncated write

    model, optimizer, scheduler, scaler = _setup(2)
    manager = CheckpointManager(tmp_path, keep_last=1)
    with pytest.warns(RuntimeWarning, match=r"latest\.pth is damaged"):
        assert manager.resume(model, optimizer, scheduler, scaler) == 3  # from epoch 2
    assert torch.equal(model.weight, weights[2])
    assert manager.best_acc1 == 40.0
    # The next save replaces the damaged file instead of keeping it as the fallback.
    manager.save(3, model, optimizer, scheduler, scaler, metrics={"acc1": 25.0})
    assert load_checkpoint(tmp_path / "previous.pth")["epoch"] == 2
    assert load_checkpoint(latest)["epoch"] == 3
    assert _leftovers(tmp_path)[2:4] == ["model-epoch1-acc40.00.pth", "model-epoch3-acc25.00.pth"]


def test_every_file_damaged_is_an_error(tmp_path: Path) -> None:
    _save_one_process(tmp_path, [1.0, 2.0], keep_last=1)
    for name in ("latest.pth", "previous.pth"):
        (tmp_path / name).write_bytes(b"")
    model, *_ = _setup(0)
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match="is loadable"):
        CheckpointManager(tmp_path).resume(model)


def test_resume_without_checkpoint_starts_at_zero(tmp_path: Path) -> None:
    model, optimizer, *_ = _setup(0)
    assert CheckpointManager(tmp_path / "new").resume(model, optimizer) == 0
    assert not (tmp_path / "new").exists()


def test_manager_refuses_bad_extra_before_writing(tmp_path: Path) -> None:
    model, optimizer, *_ = _setup(0)
    manager = CheckpointManager(tmp_path / "run")
    with pytest.raises(TypeError, match=r"extra\.hook"):
        manager.save(0, model, optimizer, metrics={"acc1": 1.0}, extra={"hook": print})
    assert not (tmp_path / "run").exists()
    assert manager.best_acc1 is None
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_nan_accuracy_is_named_but_never_best(tmp_path: Path) -> None:
    _save_one_process(tmp_path, [float("nan"), 5.0], keep_last=3)
    assert (tmp_path / "model-epoch0-accnan.pth").exists()
    best = (tmp_path / "best.pth").stat().st_ino
    assert best == (tmp_path / "model-epoch1-acc5.00.pth").stat().st_ino
