"""ddpkit.StepGuard: every guarantee of fit around a loop written by hand, on real Gloo ranks.

The loop below is the shortest correct DDP loop (forward, backward, step) over
``build_loader``'s loader, with the guard's four calls; fit is built from the
same calls.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit import CheckpointManager, FaultConfig, Position, Preempted, StepGuard, TrainingState
from ddpkit.testing import run_distributed


def _data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 6, generator=g)
    x[:, 0] = torch.arange(n) / n  # which sample it is, readable from the batch
    data = TensorDataset(x, torch.randint(0, 3, (n,), generator=g))
    data.targets = data.tensors[1].tolist()  # type: ignore[attr-defined]
    return data


def _loop(rank: int, world: int, root: str, plan: dict[str, Any]) -> dict[str, Any]:
    """A hand-written loop under a guard; what it saw and did."""
    torch.manual_seed(0)
    model = ddpkit.wrap_ddp(nn.Linear(6, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ddpkit.build_loader(_data(plan.get("n", 48)), batch_size=4, train=True, workers=0)
    manager = CheckpointManager(
        root,
        state=TrainingState(model, optimizer),
        every_steps=plan.get("every_steps"),
        every_minutes=plan.get("every_minutes"),
    )
    seen: list[list[int]] = []
    saves: list[int] = []
    stopped = None
    faults = FaultConfig(stop_signals=("SIGTERM",), hang_timeout=plan.get("hang_timeout"))
    try:
        with StepGuard(manager, faults=faults) as guard:
            first = guard.resume(loader) if plan.get("resume") else 0
            for epoch in range(first, plan.get("epochs", 2)):
                part = guard.batches(loader, epoch)
                for x, y in part:
                    seen.append([round(float(v) * len(loader.dataset)) for v in x[:, 0]])
                    loss = nn.functional.cross_entropy(model(x), y)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    if plan.get("signal") == (rank, guard.step + 1):
                        os.kill(os.getpid(), signal.SIGTERM)
                    if guard.after_step(part).save:
                        saves.append(guard.step)
                    if guard.watchdog is not None:  # it heard of the step (and of a save)
                        assert guard.watchdog._heartbeat.last[0] == guard.step
                        assert guard.watchdog._heartbeat.last[1] in ("done", "save")
                guard.end_epoch(epoch, metrics={"acc1": 0.0})
    except Preempted as stop:
        stopped = (stop.signal_name, stop.step)
    manager.flush()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"seen": seen, "saves": saves, "stopped": stopped, "weights": weights}


@pytest.mark.timeout(240)
def test_timed_saves_and_a_signal_agree_on_every_rank_of_a_hand_written_loop(
    tmp_path: Path,
) -> None:
    # every_minutes on each rank's own clock would save at different steps and deadlock
    # the save's collective: the guard agrees on rank 0's. A SIGTERM to rank 1 alone stops
    # both after the same step, with interrupted.pth.
    plan = {"every_minutes": 1e-6, "signal": (1, 9), "hang_timeout": 120.0}
    results = run_distributed(_loop, 2, args=(str(tmp_path), plan), timeout=200)
    assert results[0]["saves"], results[0]
    assert results[0]["saves"] == results[1]["saves"]
    assert results[0]["stopped"] == results[1]["stopped"] == ("SIGTERM", 10)
    stopped = ddpkit.load_checkpoint(tmp_path / "interrupted.pth")["position"]
    assert (stopped["epoch"], stopped["batches"], stopped["step"]) == (1, 4, 10)
    assert stopped["samples"] == 4 * 4 * 2  # per rank batches, samples over both ranks


@pytest.mark.timeout(240)
def test_a_resume_continues_the_epoch_exactly_on_the_same_ranks_and_once_each_on_others(
    tmp_path: Path,
) -> None:
    straight = run_distributed(_loop, 2, args=(str(tmp_path / "a"), {}), timeout=200)
    # A signal after step 3 of epoch 1's 6: every rank stops after step 4.
    stop = {"signal": (0, 3)}
    run_distributed(_loop, 2, args=(str(tmp_path / "b"), stop), timeout=200)
    resumed = run_distributed(_loop, 2, args=(str(tmp_path / "b"), {"resume": True}), timeout=200)
    for r in range(2):
        assert straight[r]["seen"][4:] == resumed[r]["seen"]  # the very batches left
        assert torch.equal(straight[r]["weights"], resumed[r]["weights"])
    # On 3 ranks the rest of epoch 1 is the 16 samples not yet seen, each once (one
    # batch a rank), then epoch 2's 4 batches a rank.
    run_distributed(_loop, 2, args=(str(tmp_path / "c"), stop), timeout=200)
    three = run_distributed(_loop, 3, args=(str(tmp_path / "c"), {"resume": True}), timeout=200)
    assert [len(r["seen"]) for r in three] == [5, 5, 5]
    rest = sorted(i for r in three for i in r["seen"][0])
    done = {i for r in straight for b in r["seen"][:4] for i in b}
    assert len(done) == 32
    assert not done & set(rest)
    assert rest == sorted(set(range(48)) - done)


def test_after_step_takes_a_position_too_and_counts_steps_without_a_manager() -> None:
    with StepGuard(faults=FaultConfig(stop_signals=())) as guard:
        assert guard.resume([]) == 0
        assert not guard.after_step(Position(0, 1, 4, 1, 1)).save
        part = ddpkit.epoch_batches([(torch.zeros(2, 1), torch.zeros(2))], 0)
        for _ in part:
            guard.after_step(part)
        assert guard.step == 2


def test_the_guard_must_be_entered() -> None:
    with pytest.raises(RuntimeError, match="with StepGuard"):
        StepGuard().after_step(Position(step=1))
