"""Signals and failed writes become one stop step that every rank agrees on."""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpkit import PREEMPTED_EXIT_CODE, Preempted
from ddpkit.checkpoint.cadence import SaveCadence, SaveClock
from ddpkit.distributed.stops import StepControl, Stop
from ddpkit.testing import run_distributed


def _interrupt_and_wait() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1.0)  # the handler runs at the next bytecode; this never completes


def test_a_signal_stops_a_single_process_after_the_current_step() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with StepControl(signals=["SIGUSR1", "term"]) as control:
        assert control.after_step(1).stop is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert control.requested == Stop("signal", "SIGUSR1")
        assert control.after_step(2).stop == Stop("signal", "SIGUSR1")
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.fixture
def sigint() -> Iterator[Callable[[Any], None]]:
    """Set this process's SIGINT disposition for the test (it may have inherited any)."""
    before = signal.getsignal(signal.SIGINT)
    yield lambda handler: signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGINT, before)


def test_a_second_ctrl_c_after_a_second_stops_at_once(sigint: Callable[[Any], None]) -> None:
    sigint(signal.default_int_handler)  # as in a terminal, not as in a `cmd &` from a script
    with StepControl(signals=["SIGINT"]) as control:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the same press seen twice (a launcher forwarding)
        assert control.after_step(1).stop == Stop("signal", "SIGINT")
        time.sleep(1.1)  # the window is wall-clock time: nothing to wait on but the clock
        with pytest.raises(KeyboardInterrupt):
            _interrupt_and_wait()


def test_an_ignored_sigint_stays_ignored(sigint: Callable[[Any], None]) -> None:
    sigint(signal.SIG_IGN)  # inherited so by a job started with `&` from a script, or nohup
    with StepControl(signals=["SIGINT", "SIGUSR1"]) as control:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        assert control.after_step(1).stop is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert control.after_step(2).stop == Stop("signal", "SIGUSR1")
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_bad_signal_names_are_refused() -> None:
    with pytest.raises(ValueError, match="'SIGBOGUS' is not a signal"):
        StepControl(signals=["SIGBOGUS"])


def _clock(every_steps: int | None = None, every_minutes: float | None = None) -> SaveClock:
    return SaveClock(SaveCadence(every_steps=every_steps, every_minutes=every_minutes))


def _ask(control: StepControl, clock: SaveClock, step: int, rank: int = 0) -> Any:
    counted, timed = clock.due(step, timed=rank == 0)
    return control.after_step(step, counted=counted, timed=timed)


def test_timed_saves_on_one_process() -> None:
    assert _ask(StepControl(), _clock(every_minutes=10), 1).save is False
    assert _ask(StepControl(), _clock(every_minutes=1e-9), 1).save is True


def test_step_control_only_agrees_and_imports_nothing_of_the_checkpoint_package() -> None:
    import ddpkit.distributed.stops as stops

    assert "cadence" not in inspect.signature(StepControl).parameters
    assert not hasattr(stops, "Cadence")
    source = inspect.getsource(stops)
    assert "ddpkit.checkpoint" not in source.replace("(``ddpkit.checkpoint.cadence``", "")
    # What it is told is what it answers: it decides nothing of its own.
    assert StepControl().after_step(3, counted=True).save is True
    assert StepControl().after_step(3).save is False


def test_the_clock_is_the_managers_and_restarts_at_its_saves(tmp_path: Any) -> None:
    from torch import nn

    from ddpkit.checkpoint import CheckpointManager, TrainingState

    manager = CheckpointManager(
        tmp_path, every_minutes=1 / 60, state=TrainingState(nn.Linear(1, 1))
    )
    control = StepControl()
    assert _ask(control, manager.clock, 1).save is False
    manager.clock._last -= 2.0  # two seconds on: due
    assert _ask(control, manager.clock, 2).save is True
    manager.checkpoint("step")  # any save restarts the clock, the caller does nothing
    assert _ask(control, manager.clock, 3).save is False
    manager.clock._last -= 2.0
    manager.checkpoint("epoch")  # an epoch's save too
    assert _ask(control, manager.clock, 4).save is False


def test_counted_saves_are_decided_by_each_rank_alone() -> None:
    clock = _clock(every_steps=3)
    assert [s for s in range(1, 10) if _ask(StepControl(), clock, s, rank=1).save] == [3, 6, 9]
    assert StepControl().after_step(3).save is False


def test_no_step_checkpoint_follows_an_epochs_last_batch() -> None:
    assert SaveClock.step_checkpoint(True, last=False)
    assert not SaveClock.step_checkpoint(True, last=True)
    assert not SaveClock.step_checkpoint(False, last=False)


def test_preempted_is_a_system_exit_with_status_75() -> None:
    error = Preempted("SIGTERM", "/ckpt/interrupted.pth", 12)
    assert isinstance(error, SystemExit)
    assert error.code == PREEMPTED_EXIT_CODE == 75
    assert str(error) == "stopped by SIGTERM after step 12; saved /ckpt/interrupted.pth"


def _lockstep(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, Any]:
    """Steps kept in lockstep by an all-reduce, as DDP's gradient all-reduce does."""
    store = dist.PrefixStore("test/", dist.distributed_c10d._get_default_store())
    clock = _clock(every_minutes=plan.get("minutes"), every_steps=plan.get("steps"))
    control = StepControl(
        signals=["SIGTERM", "SIGUSR1"], store=store, rank=rank, world_size=world_size
    )
    saves, stop_step, stop = [], None, None
    with control:
        for step in range(1, 200):
            dist.all_reduce(torch.ones(1))
            if plan.get("signal", {}).get(rank) == step:
                os.kill(os.getpid(), signal.SIGTERM)
            if plan.get("error", {}).get(rank) == step:
                thread = threading.Thread(target=control.request_stop, args=("disk full",))
                thread.start()
                thread.join()
            if rank == 0 and plan.get("slow"):
                time.sleep(0.002)  # rank 0 lags: the others read the store first
            actions = _ask(control, clock, step, rank)
            if actions.save:
                saves.append(step)
                clock.restart()
            if actions.stop is not None:
                stop_step, stop = step, actions.stop
                break
    return {"step": stop_step, "stop": stop, "saves": saves}


@pytest.mark.parametrize(
    "plan",
    [
        {"signal": {1: 7}},
        {"signal": {0: 5, 2: 6}, "slow": True},
        {"signal": {2: 3}, "init": "file"},
        {"error": {2: 11}},
    ],
    ids=["one-rank", "two-ranks", "file-store", "write-error"],
)
def test_every_rank_stops_after_the_same_step(plan: dict[str, Any]) -> None:
    init = plan.get("init", "tcp")
    results = run_distributed(_lockstep, 3, args=(plan,), init=init, timeout=120)
    steps = {r["step"] for r in results}
    assert len(steps) == 1, results
    (step,) = steps
    first = min((plan.get("signal") or plan.get("error")).values())
    assert step == first + 1
    kinds = {r["stop"] for r in results}
    expected = Stop("error", "disk full") if "error" in plan else Stop("signal", "SIGTERM")
    assert kinds == {expected}


def test_timed_saves_happen_at_the_same_step_on_every_rank() -> None:
    plan = {"minutes": 0.5 / 60_000, "steps": 7, "signal": {0: 60}}  # 0.5 ms: most steps
    results = run_distributed(_lockstep, 3, args=(plan,), init="file", timeout=120)
    assert results[0]["saves"], results
    assert {7, 14, 21, 28, 35, 42, 49, 56} <= set(results[0]["saves"])  # the counted ones too
    assert all(r["saves"] == results[0]["saves"] for r in results)
    assert len({r["step"] for r in results}) == 1


def _epoch_end(rank: int, world_size: int) -> Stop | None:
    store = dist.PrefixStore("test/", dist.distributed_c10d._get_default_store())
    with StepControl(signals=["SIGUSR1"], store=store, rank=rank, world_size=world_size) as c:
        assert c.stop_at_epoch_end() is None
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return c.stop_at_epoch_end()


def test_a_signal_before_an_epoch_end_stops_every_rank_there() -> None:
    results = run_distributed(_epoch_end, 3, init="tcp", timeout=90)
    assert results == [Stop("signal", "SIGUSR1")] * 3
