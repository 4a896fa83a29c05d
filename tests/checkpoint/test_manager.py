"""CheckpointManager: the files of a run, best and pruning, resume and its failures."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit import CheckpointError, CheckpointManager, load_checkpoint
from ddpkit.checkpoint import TrainingState
from ddpkit.position import Position
from ddpkit.testing import run_distributed


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


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
    state = TrainingState(ddp, optimizer, scheduler, scaler)
    manager = CheckpointManager(directory, prefix="net", keep_last=2, state=state)
    returned = []
    for epoch, acc1 in enumerate(ACCURACIES, start=1):
        ddp(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        metrics = {"acc1": acc1, "loss": 1.0 / epoch}
        returned.append(manager.save(epoch, metrics=metrics))
    saved = {
        "returned": [str(p) if p else None for p in returned],
        "best": manager.best_acc1,
        "state": _snapshot(model, optimizer, scheduler, scaler),
        "draws": _draws(),  # what this rank draws next
    }
    # A restart: new objects, another seed, a new manager on the same directory.
    model, optimizer, scheduler, scaler = _setup(9)
    state = TrainingState(DistributedDataParallel(model), optimizer, scheduler, scaler)
    manager = CheckpointManager(directory, prefix="net", keep_last=2, state=state)
    start = manager.resume()
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
        "net-epoch5-acc40.00.pth",
        "net-epoch6-acc35.00.pth",
        "previous.pth",
    ]
    for path in directory.iterdir():
        torch.load(path, weights_only=True)
    best, epoch4 = directory / "best.pth", directory / "net-epoch5-acc40.00.pth"  # epoch index 4
    assert best.stat().st_ino == epoch4.stat().st_ino  # a hard link, not a copy

    latest = load_checkpoint(directory / "latest.pth")
    assert latest["format"] == "ddpkit-checkpoint"
    assert latest["version"] == 2
    assert (latest["epoch"], latest["acc1"], latest["loss"]) == (5, 35.0, 0.2)
    assert latest["lr"] == pytest.approx(0.1 * 0.5**2)
    assert latest["world_size"] == 2
    assert latest["best_acc1"] == 40.0
    assert set(latest["model"]) == {"weight", "bias"}  # no DDP "module." prefix
    assert len(latest["rng"]) == 2
    assert not torch.equal(latest["rng"][0]["torch"], latest["rng"][1]["torch"])
    assert load_checkpoint(directory / "previous.pth")["epoch"] == 4
    weights = load_checkpoint(directory / "net-epoch6-acc35.00.pth")
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
    state = TrainingState(model, optimizer, scheduler, scaler)
    manager = CheckpointManager(directory, prefix="net", state=state)
    with pytest.raises(CheckpointError, match=r"RNG states for 2 ranks.*has 1.*strict_rng=False"):
        manager.resume()
    assert _snapshot(model, optimizer, scheduler, scaler) != saved["state"]  # untouched
    rng_before = torch.get_rng_state()
    with pytest.warns(RuntimeWarning, match="without restoring RNG"):
        assert manager.resume(strict_rng=False) == 6
    assert _snapshot(model, optimizer, scheduler, scaler) == saved["state"]
    assert torch.equal(torch.get_rng_state(), rng_before)


def _save_one_process(directory: Path, accuracies: list[float], keep_last: int) -> list[Any]:
    model, optimizer, scheduler, scaler = _setup(1)
    state = TrainingState(model, optimizer, scheduler, scaler)
    manager = CheckpointManager(directory, keep_last=keep_last, state=state)
    weights = []
    for epoch, acc1 in enumerate(accuracies):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights.append(model.weight.detach().clone())
        manager.save(epoch, metrics={"acc1": acc1})
    return weights


def test_damaged_latest_falls_back_to_previous(tmp_path: Path) -> None:
    weights = _save_one_process(tmp_path, [10.0, 40.0, 20.0, 30.0], keep_last=1)
    # The best epoch (index 1, the 2nd) stays next to the newest; the others are pruned.
    assert _leftovers(tmp_path) == [
        "best.pth",
        "latest.pth",
        "model-epoch2-acc40.00.pth",
        "model-epoch4-acc30.00.pth",
        "previous.pth",
    ]
    latest = tmp_path / "latest.pth"
    latest.write_bytes(latest.read_bytes()[:500])  # a truncated write

    model, optimizer, scheduler, scaler = _setup(2)
    state = TrainingState(model, optimizer, scheduler, scaler)
    manager = CheckpointManager(tmp_path, keep_last=1, state=state)
    with pytest.warns(RuntimeWarning, match=r"latest\.pth is damaged"):
        assert manager.resume() == 3  # from epoch 2
    assert torch.equal(model.weight, weights[2])
    assert manager.best_acc1 == 40.0
    # The next save replaces the damaged file instead of keeping it as the fallback.
    manager.save(3, metrics={"acc1": 25.0})
    assert load_checkpoint(tmp_path / "previous.pth")["epoch"] == 2
    assert load_checkpoint(latest)["epoch"] == 3
    assert _leftovers(tmp_path)[2:4] == ["model-epoch2-acc40.00.pth", "model-epoch4-acc25.00.pth"]


def test_every_file_damaged_is_an_error(tmp_path: Path) -> None:
    _save_one_process(tmp_path, [1.0, 2.0], keep_last=1)
    for name in ("latest.pth", "previous.pth"):
        (tmp_path / name).write_bytes(b"")
    model, *_ = _setup(0)
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match="is loadable"):
        CheckpointManager(tmp_path, state=TrainingState(model)).resume()


def test_resume_without_checkpoint_starts_at_zero(tmp_path: Path) -> None:
    model, optimizer, *_ = _setup(0)
    manager = CheckpointManager(tmp_path / "new", state=TrainingState(model, optimizer))
    assert manager.resume() == 0
    assert not (tmp_path / "new").exists()


def test_manager_refuses_bad_extra_before_writing(tmp_path: Path) -> None:
    model, optimizer, *_ = _setup(0)
    manager = CheckpointManager(tmp_path / "run", state=TrainingState(model, optimizer))
    with pytest.raises(TypeError, match=r"extra\.hook"):
        manager.save(0, metrics={"acc1": 1.0}, extra={"hook": print})
    assert not (tmp_path / "run").exists()
    assert manager.best_acc1 is None
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_nan_accuracy_is_named_but_never_best(tmp_path: Path) -> None:
    _save_one_process(tmp_path, [float("nan"), 5.0], keep_last=3)
    assert (tmp_path / "model-epoch1-accnan.pth").exists()
    best = (tmp_path / "best.pth").stat().st_ino
    assert best == (tmp_path / "model-epoch2-acc5.00.pth").stat().st_ino


def _resume_on_own_disk(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    # Only rank 0's directory holds a checkpoint, as on nodes without a shared file system.
    model = nn.Linear(4, 2)
    manager = CheckpointManager(Path(directory, f"node{rank}"), state=TrainingState(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = manager.resume(strict_rng=False)
    told = [str(w.message) for w in caught if "RNG states for 1 ranks" in str(w.message)]
    assert len(told) == (1 if rank == 0 else 0), told  # said once, by rank 0
    return {"start": start, "weights": model.state_dict(), "read": manager.resumed_from}


def test_resume_sends_the_checkpoint_to_ranks_without_it(tmp_path: Path) -> None:
    _save_one_process(tmp_path / "node0", [1.0, 2.0], keep_last=1)
    saved = load_checkpoint(tmp_path / "node0" / "latest.pth")["model"]
    r0, r1 = run_distributed(_resume_on_own_disk, 2, args=(str(tmp_path),), timeout=90)
    assert r0["start"] == r1["start"] == 2
    assert r0["read"] == tmp_path / "node0" / "latest.pth"
    assert r1["read"] is None  # it has no file: the state came over the process group
    for result in (r0, r1):
        for key, value in saved.items():
            assert torch.equal(result["weights"][key], value)


def _epoch_state(epoch: int) -> dict[str, Any]:
    from ddpkit.checkpoint.files import FORMAT, VERSION

    position = {"epoch": epoch + 1, "batches": 0, "samples": 0, "step": epoch, "world_size": 2}
    return {
        "format": FORMAT, "version": VERSION, "kind": "epoch", "generation": 1, "epoch": epoch,
        "snapshot": f"g1-s{epoch}-e{epoch}-epoch", "position": position, "acc1": None,
        "loss": None, "lr": 0.1, "model": {"w": torch.full((1000,), float(epoch))},
        "optimizer": {}, "scheduler": None, "scaler": None, "world_size": 2, "rng": [],
        "loop": [], "metrics": {}, "extra": {}, "best_acc1": None, "best_epoch": None,
    }  # fmt: skip


def _write_epochs(directory: str, barrier: Any, epochs: int) -> None:
    from ddpkit.checkpoint.files import write_files

    for epoch in range(epochs):
        barrier.wait(timeout=30)  # both writers save the same epoch at the same moment
        write_files(Path(directory), _epoch_state(epoch), prefix="m", keep_last=2, keep_steps=2,
                    best=False, rotate=True)  # fmt: skip


@pytest.mark.timeout(120)
def test_two_writers_sharing_a_directory_keep_latest_and_previous_apart(tmp_path: Path) -> None:
    # on_each_node=True with a directory that both nodes mount (NFS): the same files, twice.
    import multiprocessing

    context = multiprocessing.get_context("fork")
    barrier, epochs = context.Barrier(2), 25
    writers = [context.Process(target=_write_epochs, args=(str(tmp_path), barrier, epochs))
               for _ in range(2)]  # fmt: skip
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=100)
    assert [w.exitcode for w in writers] == [0, 0]
    assert load_checkpoint(tmp_path / "latest.pth")["epoch"] == epochs - 1
    assert load_checkpoint(tmp_path / "previous.pth")["epoch"] == epochs - 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.pth", f"m-epoch{epochs - 1}.pth", f"m-epoch{epochs}.pth",
        "previous.pth",
    ]  # fmt: skip


def test_a_checkpoint_describes_its_epoch_counted_from_1(tmp_path: Path) -> None:
    from ddpkit.checkpoint.files import read_header

    _save_one_process(tmp_path / "one", [10.0], keep_last=2)
    first = read_header(tmp_path / "one" / "latest.pth").describe()
    assert first == "latest.pth (epoch: end of epoch 1, step 0)"
    _save_one_process(tmp_path / "two", [10.0, 40.0], keep_last=2)
    second = read_header(tmp_path / "two" / "latest.pth").describe()
    assert second == "latest.pth (epoch: end of epoch 2, step 0)"


def _run_files(directory: Path, kind: str) -> None:
    """Leave in ``directory`` what a run of ``kind`` leaves there."""
    model, optimizer, _, _ = _setup(1)
    manager = CheckpointManager(directory, prefix="old", state=TrainingState(model, optimizer))
    if kind in ("finished", "interrupted", "best only"):
        for epoch, acc1 in enumerate((30.0, 20.0)):
            manager.save(epoch, metrics={"acc1": acc1})
    if kind == "interrupted":
        manager.save_step(Position(2, 1, 4, 3, 1), kind="interrupted")
    if kind == "steps only":
        manager.save_step(Position(0, 1, 4, 1, 1))
    if kind == "best only":
        for path in directory.iterdir():
            if path.name != "best.pth":
                path.unlink()
    if kind == "unrelated":
        directory.mkdir()
        (directory / "notes.txt").write_text("mine")
        (directory / "metrics.jsonl").write_text("{}\n")
    if kind == "empty":
        directory.mkdir()


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("finished", "latest.pth (epoch: end of epoch 2, step 0), best acc1 30.00% at epoch 1"),
        ("interrupted", "interrupted.pth (interrupted: in epoch 3, step 3)"),
        ("steps only", "step-000000001.pth (step: in epoch 1, step 1)"),
        ("best only", "no full checkpoint (weights only); files: best.pth."),
    ],
)
def test_a_fresh_run_refuses_another_runs_directory(tmp_path: Path, kind: str, said: str) -> None:
    directory = tmp_path / "run"
    _run_files(directory, kind)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    model, optimizer, _, _ = _setup(2)
    fresh = CheckpointManager(directory, prefix="new", state=TrainingState(model, optimizer))
    with pytest.raises(CheckpointError) as caught:
        fresh.save(0, metrics={"acc1": 5.0})
    message = str(caught.value)
    assert said in message
    for choice in ("--resume", "another directory", "overwrite=True", "--overwrite"):
        assert choice in message
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # nothing touched
    # With overwrite the old run's files go first: best.pth is the new run's, none is left over.
    state = TrainingState(model, optimizer)
    manager = CheckpointManager(directory, prefix="new", overwrite=True, state=state)
    manager.save(0, metrics={"acc1": 5.0})
    assert _leftovers(directory) == ["best.pth", "latest.pth", "new-epoch1-acc5.00.pth"]
    assert (directory / "best.pth").read_bytes() == (
        directory / "new-epoch1-acc5.00.pth"
    ).read_bytes()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_restarted_worker_of_the_same_torchrun_job_continues_instead_of_claiming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool
) -> None:
    # torchrun starts its workers again after a server joins with TORCHELASTIC_RESTART_COUNT=0:
    # the checkpoints its job wrote (its --rdzv-id recorded) are resumed, never refused or
    # deleted; another job's are refused as ever.
    from ddpkit.checkpoint.files import read_header

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    directory = tmp_path / "run"
    _run_files(directory, "interrupted")
    assert read_header(directory / "interrupted.pth").job == "job-7"
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    model, optimizer, _, _ = _setup(2)
    again = CheckpointManager(directory, overwrite=overwrite, state=TrainingState(model, optimizer))
    assert again.claim() is True
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert again.resume() == 2  # interrupted.pth: in epoch 3
    # A save that never resumed would train afresh over the job's progress: refused.
    lazy = CheckpointManager(directory, state=TrainingState(model, optimizer))
    with pytest.raises(CheckpointError, match=r"holds this torchrun job's checkpoints \(--rdzv"):
        lazy.save(0, metrics={"acc1": 5.0})
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    other = CheckpointManager(directory, state=TrainingState(model, optimizer))
    with pytest.raises(CheckpointError, match="holds another run's checkpoints"):
        other.claim()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default names no job
    with pytest.raises(CheckpointError, match="holds another run's checkpoints"):
        CheckpointManager(directory, state=TrainingState(model, optimizer)).claim()


@pytest.mark.parametrize("kind", ["empty", "unrelated", "missing"])
def test_a_fresh_run_takes_a_directory_without_a_run(tmp_path: Path, kind: str) -> None:
    directory = tmp_path / "run"
    _run_files(directory, kind)
    model, optimizer, _, _ = _setup(2)
    manager = CheckpointManager(directory, prefix="new", state=TrainingState(model, optimizer))
    manager.save(0, metrics={"acc1": 5.0})
    others = ["metrics.jsonl", "notes.txt"] if kind == "unrelated" else []
    assert _leftovers(directory) == sorted(
        ["best.pth", "latest.pth", "new-epoch1-acc5.00.pth", *others]
    )


def test_fit_refuses_another_run_before_training(tmp_path: Path) -> None:
    from ddpkit import ReportConfig, fit

    _run_files(tmp_path, "finished")
    model, optimizer, _, _ = _setup(2)
    weights = [p.detach().clone() for p in model.parameters()]
    data = [(torch.randn(4, 4), torch.randint(0, 2, (4,)))]
    for resume in (False, True):
        if resume:  # resuming what is there is the way to continue it
            (tmp_path / "latest.pth").unlink()
            (tmp_path / "previous.pth").unlink()  # left: weight files and best.pth only
        with pytest.raises(CheckpointError, match="holds another run's checkpoints"):
            fit(
                model,
                data,
                optimizer,
                criterion=nn.CrossEntropyLoss(),
                epochs=1,
                checkpoints=CheckpointManager(tmp_path),
                resume=resume,
                report=ReportConfig(progress=False),
            )
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
