"""ddpkit.training.epoch: train_epoch's steps and record, TrainConfig checks, stops, bad losses."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit import FaultConfig, Position, ReportConfig
from ddpkit.checkpoint import TrainingState
from ddpkit.checkpoint.serialization import CheckpointError
from ddpkit.distributed.stops import Preempted, Stop
from ddpkit.training.config import TrainConfig
from ddpkit.training.epoch import Run, TrainingError, train_epoch
from ddpkit.training.guard import StepGuard
from ddpkit.training.reporting import Reporter


class CountingSGD(torch.optim.SGD):
    """SGD that counts its steps."""

    steps = 0

    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        return super().step(closure)


def _batches(n: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 3, generator=g), torch.randint(0, 2, (size,), generator=g))
            for _ in range(n)]  # fmt: skip


def _run(lr: float = 0.0, criterion: Any = None, **config: Any) -> Run:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    state = TrainingState(model, CountingSGD(model.parameters(), lr=lr))
    settings = TrainConfig(normalize=None, **config)
    faults = FaultConfig(stop_signals=())  # no handlers to undo
    return Run(
        state=state,
        criterion=criterion or nn.CrossEntropyLoss(),
        config=settings,
        device=torch.device("cpu"),
        guard=StepGuard(state=state, config=settings, faults=faults).__enter__(),
        reporter=Reporter(ReportConfig(progress=False), is_main=True),
    )


def _steps(run: Run) -> int:
    optimizer = run.state.optimizer
    assert isinstance(optimizer, CountingSGD)
    return optimizer.steps


def test_the_record_is_the_exact_mean_loss_over_the_epochs_samples() -> None:
    run, batches = _run(lr=0.0), _batches(3)  # lr 0: the model stays as it is
    with torch.no_grad():
        expected = torch.cat(
            [
                nn.functional.cross_entropy(run.state.model(x).double(), y, reduction="none")
                for x, y in batches
            ]
        )
    record = train_epoch(run, batches, 4, 10, None)
    assert record["epoch"] == 5  # counted from 1
    assert record["train_samples"] == 12
    assert record["train_loss"] == pytest.approx(float(expected.mean()), rel=1e-6)
    assert record["lr"] == 0.0
    assert run.guard.step == 3
    assert _steps(run) == 3
    assert run.state.model.training


def test_the_running_totals_of_a_resumed_epoch_are_carried_on() -> None:
    run = _run()
    run.state.advance(Position(epoch=0, batches=1, samples=4, step=1))  # where a resume stood
    carried = {"loss_sum": 8.0, "samples": 4, "seconds": 1.0, "data_seconds": 0.0}
    record = train_epoch(run, _batches(3), 0, 1, carried)
    assert record["train_samples"] == 4 + 8  # the carried 4, then batches 2 and 3


def test_an_iterable_without_a_length_ends_with_a_counted_step() -> None:
    def stream() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from _batches(5)

    run = _run(lr=0.1, grad_accum=2)
    train_epoch(run, stream(), 0, 1, None)
    assert run.guard.step == _steps(run) == 3  # after batches 2 and 4, and batch 5's own step
    assert run.state.position == Position(0, 5, 20, 3, 1)
    assert all(p.grad is None for p in run.state.model.parameters())


def test_a_sized_loader_counts_its_short_last_step() -> None:
    run = _run(lr=0.1, grad_accum=2)
    train_epoch(run, _batches(5), 0, 1, None)
    assert run.guard.step == _steps(run) == 3


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_loss_names_the_epoch_and_batch_from_1(bad: float) -> None:
    calls = {"n": 0}

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        value = nn.functional.cross_entropy(logits, targets)
        return value * bad if calls["n"] == 2 else value

    with pytest.raises(TrainingError, match="in epoch 3, batch 2 of the epoch, on rank 0"):
        train_epoch(_run(criterion=loss), _batches(3), 2, 5, None)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"grad_accum": True}, "grad_accum must be >= 1"),
        ({"clip_grad_norm": math.nan}, "clip_grad_norm must be > 0"),
        ({"batch_transform": "mixup"}, "batch_transform must be callable"),
        ({"amp": "BF16"}, "amp must be 'bf16', 'fp16' or None"),
    ],
)
def test_train_config_refuses_values_of_the_wrong_kind(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig(**fields)


def test_a_stop_for_an_error_or_a_signal_without_checkpoints() -> None:
    run = _run()
    run.state.advance(Position(step=7))
    with pytest.raises(CheckpointError, match=r"a checkpoint write failed \(rank 1: disk full\)"):
        run.guard._stop(Stop("error", "rank 1: disk full"), mid_epoch=True)
    with pytest.raises(Preempted) as info:
        run.guard._stop(Stop("signal", "SIGTERM"), mid_epoch=True)
    assert (info.value.signal_name, info.value.step, info.value.checkpoint) == ("SIGTERM", 7, None)


# -- an epoch that ends in the middle of gradient accumulation ---------------------------


class _Unsized:
    """A re-iterable stream of batches without a length (a sharded stream's shape)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from self.batches


# (grad_accum, clip_grad_norm, amp): every leftover step must scale, clip, all-reduce and count.
LEFTOVER_CASES = [(2, None, None), (3, 1.0, None), (2, 1e-6, None), (3, None, "fp16")]


def _leftover_runs(rank: int, world_size: int, batches: int) -> list[dict[str, Any]]:
    """For each case, fit on an unsized stream and on the same batches as a list (sized)."""
    from ddpkit import fit

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of the stream
    data = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
            for _ in range(batches)]  # fmt: skip
    out = []
    for accum, clip, amp in LEFTOVER_CASES:
        weights = {}
        for kind, loader in (("unsized", _Unsized(data)), ("sized", data)):
            torch.manual_seed(0)
            model = ddpkit_wrap(nn.Linear(6, 3))
            optimizer = CountingSGD(model.parameters(), lr=0.5)
            config = TrainConfig(grad_accum=accum, clip_grad_norm=clip, amp=amp, normalize=None)
            start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
            fit(model, loader, optimizer, criterion=nn.CrossEntropyLoss(), epochs=2,
                config=config, report=ReportConfig(progress=False, verbose=False))  # fmt: skip
            end = torch.cat([p.detach().flatten() for p in model.parameters()])
            weights[kind] = (end, float((end - start).norm()), optimizer.steps)
        out.append(weights)
    return out


def ddpkit_wrap(model: nn.Module) -> nn.Module:
    from ddpkit import wrap_ddp

    return wrap_ddp(model, sync_bn=False)


@pytest.mark.parametrize("world", [2, 3])
def test_an_unsized_epoch_ending_mid_accumulation_steps_like_any_other(world: int) -> None:
    from ddpkit.testing import run_distributed

    results = run_distributed(_leftover_runs, world, args=(5,), timeout=240)
    for case, (accum, clip, amp) in enumerate(LEFTOVER_CASES):
        runs = [r[case] for r in results]
        steps = 2 * -(-5 // accum)  # two epochs of ceil(5 / accum) steps, the leftover counted
        for rank, run in enumerate(runs):
            unsized, sized = run["unsized"], run["sized"]
            assert unsized[2] == sized[2] == steps, (case, rank)
            # The leftover step all-reduced: every replica is the same.
            assert torch.equal(unsized[0], runs[0]["unsized"][0]), (case, rank)
            # ... and it is the step the sized path takes: scaled to the mean, clipped, unscaled.
            # (fp16 rounds the two ways of scaling apart by about 1e-4; unscaled, a leftover
            # step moved the weights by 65536 times its gradient)
            close = 1e-3 if amp else 1e-6
            difference = float((unsized[0] - sized[0]).abs().max())
            assert difference <= close, (case, rank, difference)
            if clip == 1e-6:  # at most lr x clip a step
                assert unsized[1] <= steps * 0.5 * 1e-6 * 1.01, (case, unsized[1])


def test_fit_hands_every_optimizer_step_to_the_step_callbacks() -> None:
    from ddpkit import fit

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    seen: list[dict[str, Any]] = []
    fit(model, _batches(5), torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(), epochs=2, step_callbacks=[seen.append],
        config=TrainConfig(normalize=None, grad_accum=2),
        report=ReportConfig(progress=False, verbose=False))  # fmt: skip
    # 5 batches, 2 a step: steps after batches 2, 4 and the epoch's last, 5; two epochs.
    assert [(s["epoch"], s["step"], s["batch"]) for s in seen] == [
        (1, 1, 2), (1, 2, 4), (1, 3, 5), (2, 4, 2), (2, 5, 4), (2, 6, 5)
    ]  # fmt: skip
    assert seen[2]["position"] == Position(0, 5, 20, 3, 1)
    assert isinstance(seen[0]["loss"], torch.Tensor)
    assert seen[0]["lr"] == 0.1
