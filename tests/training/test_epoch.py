"""ddpkit.training.epoch: train_epoch's steps and record, TrainConfig checks, stops, bad losses."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit import Position, ReportConfig
from ddpkit.checkpoint.serialization import CheckpointError
from ddpkit.distributed.stops import Preempted, StepControl, Stop
from ddpkit.training.epoch import Run, TrainConfig, TrainingError, stop_now, train_epoch
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
    return Run(model, CountingSGD(model.parameters(), lr=lr), criterion or nn.CrossEntropyLoss(),
               TrainConfig(normalize=None, **config), torch.device("cpu"), None, None, None,
               StepControl(), Reporter(ReportConfig(progress=False), is_main=True))  # fmt: skip


def _steps(run: Run) -> int:
    optimizer = run.optimizer
    assert isinstance(optimizer, CountingSGD)
    return optimizer.steps


def test_the_record_is_the_exact_mean_loss_over_the_epochs_samples() -> None:
    run, batches = _run(lr=0.0), _batches(3)  # lr 0: the model stays as it is
    with torch.no_grad():
        expected = torch.cat(
            [
                nn.functional.cross_entropy(run.model(x).double(), y, reduction="none")
                for x, y in batches
            ]
        )
    record = train_epoch(run, batches, 4, 10, None, None)
    assert record["epoch"] == 5  # counted from 1
    assert record["train_samples"] == 12
    assert record["train_loss"] == pytest.approx(float(expected.mean()), rel=1e-6)
    assert record["lr"] == 0.0
    assert run.step == 3
    assert _steps(run) == 3
    assert run.model.training


def test_the_running_totals_of_a_resumed_epoch_are_carried_on() -> None:
    run = _run()
    start = Position(epoch=0, batches=1, samples=4, step=1)
    carried = {"loss_sum": 8.0, "samples": 4, "seconds": 1.0, "data_seconds": 0.0}
    record = train_epoch(run, _batches(3), 0, 1, start, carried)
    assert record["train_samples"] == 4 + 8  # the carried 4, then batches 2 and 3


def test_an_iterable_without_a_length_applies_a_last_partial_accumulation() -> None:
    def stream() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from _batches(5)

    run = _run(lr=0.1, grad_accum=2)
    train_epoch(run, stream(), 0, 1, None, None)
    assert run.step == 2  # the counted steps: after batches 2 and 4
    assert _steps(run) == 3  # and batch 5's gradient
    assert all(p.grad is None for p in run.model.parameters())


def test_a_sized_loader_counts_its_short_last_step() -> None:
    run = _run(lr=0.1, grad_accum=2)
    train_epoch(run, _batches(5), 0, 1, None, None)
    assert run.step == _steps(run) == 3


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_loss_names_the_epoch_and_batch_from_1(bad: float) -> None:
    calls = {"n": 0}

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        value = nn.functional.cross_entropy(logits, targets)
        return value * bad if calls["n"] == 2 else value

    with pytest.raises(TrainingError, match="in epoch 3, batch 2 of the epoch, on rank 0"):
        train_epoch(_run(criterion=loss), _batches(3), 2, 5, None, None)


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
    run.step = 7
    with pytest.raises(CheckpointError, match=r"a checkpoint write failed \(rank 1: disk full\)"):
        stop_now(run, Stop("error", "rank 1: disk full"), Position(step=7), {})
    with pytest.raises(Preempted) as info:
        stop_now(run, Stop("signal", "SIGTERM"), Position(step=7), {})
    assert (info.value.signal_name, info.value.step, info.value.checkpoint) == ("SIGTERM", 7, None)
