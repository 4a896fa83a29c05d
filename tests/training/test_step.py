"""One step for every loop: ``StepGuard.forward`` / ``backward`` are the step ``fit`` takes.

The optimizer step has one call site in the package; a loop of your own that
calls the guard's step trains the very weights ``fit`` trains (mixed precision,
accumulation under ``no_sync``, clipping, the average, a per-step schedule);
the run's progress lives in the ``TrainingState`` only; the manager has one
save verb; and the end of a guard's block leaves every checkpoint on disk.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from nested import assert_nested_equal  # type: ignore[import-not-found]
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ddpkit
from ddpkit import (
    CheckpointManager,
    FaultConfig,
    Position,
    ReportConfig,
    StepGuard,
    TrainConfig,
    TrainingState,
    load_checkpoint,
)
from ddpkit._graveyard import DdpkitDeprecationWarning
from ddpkit.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
NO_SIGNALS = FaultConfig(stop_signals=())


class _Labelled(Dataset[tuple[torch.Tensor, int]]):
    """20 samples of 6 features with ``targets``: a training set with an identity."""

    def __init__(self, count: int = 20) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(count, 6, generator=g)
        self.targets = [i % 3 for i in range(count)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.x[index], self.targets[index]


def _loader(rank: int, world: int, count: int = 20) -> DataLoader[Any]:
    data = _Labelled(count)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    return DataLoader(data, batch_size=2, sampler=sampler)


def _parts(world: int) -> tuple[nn.Module, Any, Any, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model = ddpkit.wrap_ddp(net, sync_bn=False) if world > 1 else net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler, ddpkit.model_ema(model, decay=0.9)


# fit's every part of a step: bf16, a window of 2 (5 micro-batches an epoch: the last
# window is short), clipping, the average, a schedule stepped after each optimizer step.
CONFIG = TrainConfig(
    amp="bf16", grad_accum=2, clip_grad_norm=0.05, normalize=None, scheduler_per_step=True
)


def _state_of(model: nn.Module, optimizer: Any, ema: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in ddpkit.unwrap_model(model).state_dict().items()},
        "ema": {k: v.clone() for k, v in ema.state_dict().items()},
        "optimizer": optimizer.state_dict(),
    }


def _counting(model: Any, calls: dict[str, int]) -> None:
    """Count DDP's gradient all-reduces (the default all-reduce, through a hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counted(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        calls["reduces"] += 1
        return allreduce_hook(process_group, bucket)

    model.register_comm_hook(None, counted)


def _fit_and_own_loop(rank: int, world: int) -> dict[str, Any]:
    criterion = nn.CrossEntropyLoss()
    model, optimizer, scheduler, ema = _parts(world)
    _counting(model, {"reduces": 0})  # the same all-reduce as the loop's below
    ddpkit.fit(model, _loader(rank, world), optimizer, criterion=criterion, epochs=2,
               scheduler=scheduler, ema=ema, config=CONFIG, faults=NO_SIGNALS,
               report=ReportConfig(progress=False))  # fmt: skip
    by_fit = _state_of(model, optimizer, ema)

    model, optimizer, scheduler, ema = _parts(world)
    calls = {"reduces": 0}
    _counting(model, calls)  # one all-reduce per window, not per micro-batch
    state = TrainingState(model, optimizer, scheduler, ema=ema)
    loader = _loader(rank, world)
    steps = []
    with StepGuard(state=state, config=CONFIG, faults=NO_SIGNALS) as guard:
        for epoch in range(2):
            model.train()
            part = guard.batches(loader, epoch)
            for images, targets in part:
                with guard.forward(part):
                    loss = criterion(model(images), targets)
                if guard.backward(loss, part):
                    steps.append(guard.step)
            guard.end_epoch(epoch)
    return {
        "fit": by_fit,
        "own": _state_of(model, optimizer, ema),
        "steps": steps,
        "reduces": calls["reduces"],
        "position": state.position,
        "lr": optimizer.param_groups[0]["lr"],
    }


@pytest.mark.serial
@pytest.mark.timeout(180)
def test_a_loop_of_your_own_takes_fits_very_steps_on_two_ranks() -> None:
    results = run_distributed(_fit_and_own_loop, 2, timeout=150)
    for rank, result in enumerate(results):
        assert_nested_equal(result["own"], result["fit"], f"rank {rank}")
        # 5 micro-batches an epoch in windows of 2: steps after batches 2, 4 and the 5th.
        assert result["steps"] == [1, 2, 3, 4, 5, 6]
        assert result["position"] == Position(2, 0, 0, 6, 2, 20, result["position"].data_digest, 1)
        assert result["lr"] == pytest.approx(0.3 * 0.5**3)  # stepped after every step
        # no_sync inside a window: one all-reduce per optimizer step (one bucket), not per
        # micro-batch (10 of them).
        assert result["reduces"] == 6
    assert_nested_equal(results[1]["own"]["model"], results[0]["own"]["model"])


def test_one_optimizer_step_call_site_in_the_package() -> None:
    calls = []
    for path in sorted((ROOT / "ddpkit").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\b\w*(optim|scaler)\w*\.step\(", code):
                calls.append(f"{path.relative_to(ROOT)}:{number}")
    assert len(calls) == 1, calls
    assert calls[0].startswith("ddpkit/training/guard.py:")


def test_fit_and_both_examples_reach_the_guards_step(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = []
    original = StepGuard._optimizer_step

    def counted(self: StepGuard, scaler: Any) -> None:
        taken.append(self.step)
        original(self, scaler)

    monkeypatch.setattr(StepGuard, "_optimizer_step", counted)
    model, optimizer, _, _ = _parts(1)
    ddpkit.fit(model, _loader(0, 1, 8), optimizer, criterion=nn.CrossEntropyLoss(), epochs=1,
               config=TrainConfig(normalize=None), faults=NO_SIGNALS,
               report=ReportConfig(progress=False))  # fmt: skip
    assert len(taken) == 4
    # The hand-written example's step is the guard's; the main example's is fit's.
    own = (ROOT / "ddpkit/examples/own_loop.py").read_text()
    for line in ("guard.backward(loss, part)", "with guard.forward(part):"):
        assert line in own
    assert not re.search(r"\.backward\(\)|optimizer\.step", own)
    main = (ROOT / "ddpkit/examples/seresnext_lmdb.py").read_text()
    for line in ("ddpkit.fit(", "grad_accum=args.grad_accum_steps"):
        assert line in main


def test_fp16_puts_a_grad_scaler_in_the_state_and_its_checkpoints(tmp_path: Path) -> None:
    model, optimizer, _, _ = _parts(1)
    state = TrainingState(model, optimizer)
    manager = CheckpointManager(tmp_path, state=state)
    loader = _loader(0, 1, 8)
    with StepGuard(manager, config=TrainConfig(amp="fp16"), faults=NO_SIGNALS) as guard:
        assert isinstance(state.scaler, torch.amp.GradScaler)
        part = guard.batches(loader, 0)
        for images, targets in part:
            with guard.forward(part):
                loss = nn.functional.cross_entropy(model(images), targets)
            guard.backward(loss, part)
        guard.end_epoch(0)
    saved = load_checkpoint(tmp_path / "latest.pth")
    assert saved["scaler"]["scale"] == state.scaler.get_scale()
    assert saved["position"]["step"] == 4


def test_a_step_without_an_optimizer_says_what_to_bind_before_any_backward() -> None:
    model = nn.Linear(6, 3)
    for state in (TrainingState(model), None):  # no optimizer; no state at all
        with StepGuard(state=state, faults=NO_SIGNALS) as guard:
            part = guard.batches(_loader(0, 1, 4), 0)
            for _ in part:
                with pytest.raises(TypeError, match=r"bind TrainingState\(model, optimizer"):
                    guard.forward(part).__enter__()
                break
        assert all(p.grad is None for p in model.parameters())


def test_a_state_given_with_a_manager_is_the_one_it_saves(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, state=TrainingState(nn.Linear(1, 1)))
    mine = TrainingState(nn.Linear(1, 1))
    assert StepGuard(manager, state=mine).state is mine
    assert manager.state is mine


def test_fp16_adds_a_scaler_to_a_state_bound_after_the_guard_was_entered(tmp_path: Path) -> None:
    model, optimizer, _, _ = _parts(1)
    manager = CheckpointManager(tmp_path)
    with StepGuard(manager, config=TrainConfig(amp="fp16"), faults=NO_SIGNALS) as guard:
        manager.bind(TrainingState(model, optimizer))
        assert guard.resume(_loader(0, 1, 4)) == 0
        assert isinstance(manager.state.scaler, torch.amp.GradScaler)


def test_a_second_loader_in_the_same_epoch_is_read_whole() -> None:
    model, optimizer, _, _ = _parts(1)
    state = TrainingState(model, optimizer)
    with StepGuard(state=state, faults=NO_SIGNALS) as guard:
        counts = []
        for loader in (_loader(0, 1, 8), _loader(0, 1, 8)):
            part = guard.batches(loader, 0)
            counts.append(sum(1 for _ in part))
            guard.after_step(part)  # the state stands mid-epoch 0 now
    assert counts == [4, 4]


def test_a_window_cut_by_a_resume_is_the_mean_of_the_batches_it_holds() -> None:
    # Resumed after 3 batches with windows of 2 (the accumulation changed on resume): the
    # first step holds batch 3 alone and is its gradient, not half of it.
    torch.manual_seed(0)
    model = nn.Linear(6, 3, bias=False)
    state = TrainingState(model, torch.optim.SGD(model.parameters(), lr=1.0))
    state.advance(Position(0, 3, 6, 1, 1))
    loader = [(torch.randn(2, 6), torch.tensor([0, 1])) for _ in range(6)]
    config = TrainConfig(grad_accum=2, normalize=None)
    with StepGuard(state=state, config=config, faults=NO_SIGNALS) as guard:
        part = guard.batches(loader, 0)
        images, targets = next(iter(part))
        before = model.weight.detach().clone()
        with guard.forward(part):
            loss = nn.functional.cross_entropy(model(images), targets)
        (grad,) = torch.autograd.grad(loss, model.weight, retain_graph=True)
        assert guard.backward(loss, part)  # batch 3 closes its window
        assert torch.allclose(before - model.weight.detach(), grad)


# -- progress in one place -----------------------------------------------------------------


def _loop(guard: StepGuard, model: nn.Module, loader: Any, epochs: range) -> None:
    for epoch in epochs:
        part = guard.batches(loader, epoch)
        for images, targets in part:
            with guard.forward(part):
                loss = nn.functional.cross_entropy(model(images), targets)
            guard.backward(loss, part)
        guard.end_epoch(epoch)


def test_progress_lives_in_the_state_and_the_guard_and_manager_read_it(tmp_path: Path) -> None:
    model, optimizer, _, _ = _parts(1)
    state = TrainingState(model, optimizer)
    manager = CheckpointManager(tmp_path, state=state, every_steps=3)
    loader = _loader(0, 1, 12)
    with StepGuard(manager, faults=NO_SIGNALS) as guard:
        _loop(guard, model, loader, range(guard.resume(loader), 1))
        assert guard.step == state.position.step == 6
        for holder in (guard, manager):  # no copy of the position, totals or place
            kept = [k for k, v in vars(holder).items() if isinstance(v, Position)]
            assert not kept, (type(holder).__name__, kept)
            assert not {"_step", "_loader_state", "loop", "start"} & set(vars(holder))
    # A resume writes the progress into the state, and the guard reads it there.
    model, optimizer, _, _ = _parts(1)
    state = TrainingState(model, optimizer)
    manager = CheckpointManager(tmp_path, state=state, every_steps=3)
    with StepGuard(manager, faults=NO_SIGNALS) as guard:
        assert guard.resume(loader) == 1
        assert guard.step == state.position.step == 6
        assert manager.position == state.position  # the resumed checkpoint's


def test_every_epoch_end_position_keeps_the_data_identity(tmp_path: Path) -> None:
    model, optimizer, _, _ = _parts(1)
    state = TrainingState(model, optimizer)
    manager = CheckpointManager(tmp_path, state=state)
    loader = _loader(0, 1, 12)
    size, digest = ddpkit.data_identity(loader.dataset)
    assert digest is not None
    with StepGuard(manager, faults=NO_SIGNALS) as guard:
        part = guard.batches(loader, 0)
        for _ in part:
            guard.after_step(part)  # a loop that takes its step itself: the count alone
        guard.end_epoch(0)
    manager.flush()  # nothing left to wait for: the block's end waited
    saved = load_checkpoint(tmp_path / "latest.pth")["position"]
    assert (saved["epoch"], saved["step"], saved["data_size"], saved["data_digest"]) == (
        1, 6, size, digest
    )  # fmt: skip
    # The deprecated epoch save builds the same position: one epoch-end position.
    with pytest.warns(DdpkitDeprecationWarning):
        manager.save(1)
    saved = load_checkpoint(tmp_path / "latest.pth")["position"]
    assert (saved["epoch"], saved["step"], saved["data_size"], saved["data_digest"]) == (
        2, 6, size, digest
    )  # fmt: skip


# -- one save verb -------------------------------------------------------------------------


def test_save_and_save_step_are_deprecated_with_one_warning_each(tmp_path: Path) -> None:
    state = TrainingState(nn.Linear(2, 2))
    manager = CheckpointManager(tmp_path, state=state, keep_steps=5)
    with pytest.warns(DeprecationWarning, match=r"save_step.*removed in ddpkit 0\.3") as seen:
        manager.save_step(Position(0, 1, 4, 1, 1), loop={"samples": 4})
    assert len(seen) == 1
    assert load_checkpoint(tmp_path / "step-000000001.pth")["loop"] == [{"samples": 4}]
    with pytest.warns(DeprecationWarning, match=r"CheckpointManager\.save\(epoch") as seen:
        manager.save(0, metrics={"acc1": 1.0})
    assert len(seen) == 1
    assert load_checkpoint(tmp_path / "latest.pth")["position"]["epoch"] == 1
    # The one verb warns of nothing.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.advance(Position(1, 1, 4, 2, 1))
        manager.checkpoint("step")
    assert (tmp_path / "step-000000002.pth").exists()


def test_the_former_objects_form_keeps_the_runs_step_and_refuses_bad_arguments(
    tmp_path: Path,
) -> None:
    model, optimizer, _, _ = _parts(1)
    manager = CheckpointManager(tmp_path)
    with pytest.warns(DeprecationWarning, match="save_step"):
        manager.save_step(Position(0, 5, 40, 5, 1), model, optimizer)
    with pytest.warns(DeprecationWarning, match="save"):
        manager.save(0, model, optimizer)  # binds a new bag: the run's step goes on in it
    assert load_checkpoint(tmp_path / "latest.pth")["position"]["step"] == 5
    assert manager.state is not None
    before = manager.state.position
    for call in (
        lambda: manager.save(1, metric={"acc1": 1.0}),  # a typo
        lambda: manager.save(1, model, optimizer, None, None, model),  # five objects
        lambda: manager.save(1, model, model=model),  # one twice
    ):
        with (
            pytest.warns(DeprecationWarning, match="save"),
            pytest.raises(TypeError, match="take the objects"),
        ):
            call()
        assert manager.state.position == before  # nothing moved


def test_the_cadence_is_one_module_and_distributed_imports_no_checkpoint() -> None:
    distributed = ROOT / "ddpkit" / "distributed"
    for path in distributed.rglob("*.py"):
        imports = [
            line
            for line in path.read_text().splitlines()
            if line.lstrip().startswith(("import ", "from ")) and "checkpoint" in line
        ]
        assert not imports, (path.name, imports)
    manager = CheckpointManager("unused", every_steps=2)
    for gone in ("step_due", "time_due", "every_steps", "every_minutes", "_last_save"):
        assert not hasattr(manager, gone), gone
    assert manager.clock.due(4, timed=False) == (True, False)


# -- the end of the block ------------------------------------------------------------------

_ENDS = """
import os, sys, torch
from torch import nn
import ddpkit

directory = sys.argv[1]
torch.manual_seed(0)
model = nn.Linear(1024, 1024)  # 4 MiB of weights: a write that takes a while
torch.save(model.state_dict(), os.path.join(directory, "expected.pt"))
for how in ("epoch", "step", "error"):  # each in a process of its own, ended after the block
    if os.fork():
        os.wait()
        continue
    state = ddpkit.TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    manager = ddpkit.CheckpointManager(os.path.join(directory, how), state=state, every_steps=1)
    try:
        with ddpkit.StepGuard(manager, faults=ddpkit.FaultConfig(stop_signals=())) as guard:
            if how == "step":  # a step checkpoint, in the background
                guard.after_step(ddpkit.Position(0, 1, 4, 1, 1))
            else:  # the epoch's checkpoint, in the background
                guard.end_epoch(0)
            if how == "error":
                raise RuntimeError("the loop failed")
    except RuntimeError:
        os._exit(3)  # no interpreter shutdown: nothing joins a thread after this
    os._exit(0)
"""


def test_the_end_of_the_block_leaves_every_checkpoint_on_disk(tmp_path: Path) -> None:
    script = tmp_path / "ends.py"
    script.write_text(textwrap.dedent(_ENDS))
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], timeout=120,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    for how, name in (("epoch", "latest.pth"), ("step", "step-000000001.pth"),
                      ("error", "latest.pth")):  # fmt: skip
        saved = load_checkpoint(tmp_path / how / name)
        assert torch.equal(saved["model"]["weight"], expected["weight"]), how
        assert not list((tmp_path / how).glob("*.tmp*")), how


def _one_rank_fails_in_the_block(rank: int, world: int, directory: str) -> float:
    import time

    state = TrainingState(nn.Linear(4, 4))
    manager = CheckpointManager(directory, state=state)
    try:
        with StepGuard(manager, faults=NO_SIGNALS) as guard:
            guard.end_epoch(0)
            if rank == 0:
                raise RuntimeError("rank 0's loop failed")
    except RuntimeError:
        time.sleep(8)  # rank 0 handles its error; rank 1 must not wait for it
        return -1.0
    return time.monotonic()


@pytest.mark.serial
@pytest.mark.timeout(120)
def test_the_end_of_the_block_waits_for_no_other_rank(tmp_path: Path) -> None:
    import time

    began = time.monotonic()
    results = run_distributed(_one_rank_fails_in_the_block, 2, args=(str(tmp_path),), timeout=90)
    assert results[0] == -1.0
    assert results[1] - began < 7  # it left its block at once, not after rank 0's 8 s
    assert load_checkpoint(tmp_path / "latest.pth")["position"]["epoch"] == 1


def test_a_guard_entered_twice_is_refused_and_leaves_the_handlers_alone() -> None:
    import signal

    before = signal.getsignal(signal.SIGTERM)
    guard = StepGuard(faults=FaultConfig(stop_signals=("SIGTERM",)))
    with guard:
        installed = signal.getsignal(signal.SIGTERM)
        assert installed is not before
        with pytest.raises(RuntimeError, match="entered already"), guard:
            pass
        assert signal.getsignal(signal.SIGTERM) is installed  # still the guard's
    assert signal.getsignal(signal.SIGTERM) is before
    with guard:  # entered again after its block: a fresh start
        assert signal.getsignal(signal.SIGTERM) is not before


# -- what fit says ------------------------------------------------------------------------


def _fit(directory: Path, epochs: int, **options: Any) -> Any:
    model, optimizer, _, _ = _parts(1)
    manager = CheckpointManager(directory)
    return ddpkit.fit(model, _loader(0, 1, 8), optimizer, criterion=nn.CrossEntropyLoss(),
                      epochs=epochs, checkpoints=manager, faults=NO_SIGNALS,
                      config=TrainConfig(normalize=None), report=ReportConfig(progress=False),
                      **options)  # fmt: skip


def test_without_validation_weight_files_are_named_by_epoch_and_no_best_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fit(tmp_path, 2)
    names = sorted(p.name for p in tmp_path.glob("*.pth"))
    assert names == ["latest.pth", "model-epoch1.pth", "model-epoch2.pth", "previous.pth"]
    said = capsys.readouterr().out
    assert "no val_loader: weight files are named by epoch alone, and no best.pth" in said
    # The run's files are still its own: a fresh run there is refused, a resume finds them.
    with pytest.raises(ddpkit.CheckpointError, match="holds"):
        _fit(tmp_path, 2)


def test_a_resume_with_more_epochs_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fit(tmp_path, 1)
    capsys.readouterr()
    history = _fit(tmp_path, 2, resume=True)
    assert [r["epoch"] for r in history.records] == [2]
    said = capsys.readouterr().out
    assert "resuming at epoch 2 step 4 (0 batches of the epoch done), now of 2 epochs" in said
    assert "(started for 1)" in said


def test_a_mid_epoch_resume_with_another_seed_is_refused(tmp_path: Path) -> None:
    data = _Labelled(16)

    def loader(seed: int) -> Any:
        return ddpkit.build_loader(data, batch_size=2, train=True, seed=seed, workers=0)

    model, optimizer, _, _ = _parts(1)
    manager = CheckpointManager(tmp_path, state=TrainingState(model, optimizer), every_steps=1)
    with StepGuard(manager, faults=NO_SIGNALS) as guard:
        part = guard.batches(loader(0), 0)
        for _, _ in zip(part, range(3), strict=False):
            guard.after_step(part)
    assert load_checkpoint(tmp_path / "step-000000003.pth")["position"]["data_seed"] == 0
    for seed, fails in ((11, True), (0, False)):
        model, optimizer, _, _ = _parts(1)
        manager = CheckpointManager(tmp_path, state=TrainingState(model, optimizer))
        with StepGuard(manager, faults=NO_SIGNALS) as guard:
            if fails:
                with pytest.raises(ddpkit.CheckpointError, match="seed was 0 then and is 11 now"):
                    guard.resume(loader(seed))
            else:
                assert guard.resume(loader(seed)) == 0
    # Asked to, the next epoch starts on the new order instead.
    model, optimizer, _, _ = _parts(1)
    manager = CheckpointManager(tmp_path, state=TrainingState(model, optimizer))
    faults = FaultConfig(stop_signals=(), on_data_change="next_epoch")
    with StepGuard(manager, faults=faults) as guard, pytest.warns(RuntimeWarning, match="seed"):
        assert guard.resume(loader(11)) == 1


class _Stream(torch.utils.data.IterableDataset[tuple[torch.Tensor, int]]):
    """A stream of ``counts[rank]`` samples on each rank, without a length."""

    def __init__(self, counts: tuple[int, ...]) -> None:
        self.counts = counts

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        mine = self.counts[min(ddpkit.get_rank(), len(self.counts) - 1)]
        return iter([(torch.randn(6, generator=g), i % 3) for i in range(mine)])


def _empty_epochs(rank: int, world: int, counts: tuple[int, ...]) -> str:
    model, optimizer, _, _ = _parts(world)
    loader = DataLoader(_Stream(counts), batch_size=2)
    try:
        ddpkit.fit(model, loader, optimizer, criterion=nn.CrossEntropyLoss(), epochs=1,
                   config=TrainConfig(normalize=None), faults=NO_SIGNALS,
                   report=ReportConfig(progress=False))  # fmt: skip
    except ddpkit.TrainingError as exc:
        return str(exc)
    return "trained"


def test_an_epoch_with_no_step_on_any_rank_is_refused() -> None:
    said = _empty_epochs(0, 1, (0,))
    assert said.startswith("epoch 1 trained no step: the training loader yielded no batch on ")
    assert "every rank" in said


@pytest.mark.serial
@pytest.mark.timeout(120)
def test_a_rank_with_no_batch_is_named_on_every_rank() -> None:
    results = run_distributed(_empty_epochs, 2, args=((4, 0),), timeout=90)
    for said in results:
        assert "yielded no batch on rank(s) [1]" in said
