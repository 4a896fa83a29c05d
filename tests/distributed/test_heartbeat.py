"""The watchdog's halves on a real store, one process, a clock the test moves."""

from __future__ import annotations

import json
import math

import pytest
import torch.distributed as dist

import ddpkit.distributed.heartbeat as hb
from ddpkit.distributed.deadline import BoundedCalls
from ddpkit.distributed.heartbeat import Beat, Heartbeat, Judge


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(hb, "_monotonic", clock)
    return clock


@pytest.fixture
def calls():
    calls = BoundedCalls(math.inf, "test-heartbeat")
    calls.deadline = math.inf
    yield calls
    calls.close()


def _beat_all(store: dist.Store, calls: BoundedCalls, beats: list[Heartbeat]) -> None:
    for beat in beats:
        step, phase, stamp = beat.last
        beat.publish(store, calls, step, phase, stamp)


def test_the_rank_furthest_behind_is_named_after_the_timeout(clock: _Clock, calls) -> None:
    store = dist.HashStore()
    ranks = [Heartbeat(r) for r in range(3)]
    judge = Judge(3, timeout=10.0)
    for r, beat in enumerate(ranks):
        beat.progress(4, "done")
        beat.progress(4, "data" if r == 1 else "compute")
    _beat_all(store, calls, ranks)
    assert judge.judge(store, calls) is None
    clock.now += 10.5
    _beat_all(store, calls, ranks)
    finding = judge.judge(store, calls)
    assert finding is not None
    assert "rank(s) 1 stopped at step 4 (waiting for training data)" in finding
    assert "the others wait for them: rank(s) 0, 2 at step 4 (in compute)" in finding
    assert judge.heard == [1, 2]
    judge.post(store, calls, finding)
    assert all(beat.verdict(store, calls) == finding for beat in ranks)


def test_progress_on_every_rank_keeps_the_judge_quiet(clock: _Clock, calls) -> None:
    store = dist.HashStore()
    ranks, judge = [Heartbeat(r) for r in range(2)], Judge(2, timeout=5.0)
    for step in range(1, 20):
        clock.now += 4.0
        for beat in ranks:
            beat.progress(step, "done")
        _beat_all(store, calls, ranks)
        assert judge.judge(store, calls) is None


def test_an_untimed_phase_holds_every_clock(clock: _Clock, calls) -> None:
    store = dist.HashStore()
    ranks, judge = [Heartbeat(r) for r in range(2)], Judge(2, timeout=5.0)
    for beat in ranks:
        beat.progress(1, "done")
    ranks[0].progress(1, "compute")  # rank 0 waits for rank 1 in its collective
    ranks[1].progress(1, "start_data")  # rank 1 starts its loader's workers
    for _ in range(10):  # 30 s: rank 0 waits in a collective all that time
        clock.now += 3.0
        _beat_all(store, calls, ranks)
        assert judge.judge(store, calls) is None
        ranks[1].follow_holds(store, calls)
    assert ranks[1].held_at == clock.now
    assert not ranks[1].timed("start_data")
    assert ranks[1].timed("data")
    ranks[1].progress(1, "data")
    clock.now += 3.0
    _beat_all(store, calls, ranks)
    assert judge.judge(store, calls) is None  # the clocks start again from the hold
    clock.now += 6.0
    _beat_all(store, calls, ranks)
    assert "rank(s) 1 stopped at step 1 (waiting for training data)" in judge.judge(store, calls)


def test_a_rank_that_never_beat_is_named_and_one_that_signed_off_is_not_hung(
    clock: _Clock, calls
) -> None:
    store = dist.HashStore()
    ranks, judge = [Heartbeat(r) for r in range(3)], Judge(3, timeout=1.0)
    for beat in ranks:
        beat.progress(2, "done")
    _beat_all(store, calls, ranks[:2])
    ranks[1].sign_off(store, calls)
    clock.now += 2.0
    ranks[0].publish(store, calls, *ranks[0].last)
    finding = judge.judge(store, calls)
    assert "rank(s) 1, 2 never sent a heartbeat" in finding
    assert judge.heard == []


def test_ranks_all_stuck_at_one_place_are_reported_together(clock: _Clock, calls) -> None:
    store = dist.HashStore()
    ranks, judge = [Heartbeat(r) for r in range(2)], Judge(2, timeout=1.0)
    for beat in ranks:
        beat.progress(7, "done")
        beat.progress(7, "compute")
    _beat_all(store, calls, ranks)
    judge.judge(store, calls)
    clock.now += 1.5
    finding = judge.judge(store, calls)
    assert "all ranks stopped at step 7 (in compute), none behind another" in finding


def test_the_beat_on_the_store_is_the_contract(clock: _Clock, calls) -> None:
    store = dist.HashStore()
    beat = Heartbeat(5)
    beat.progress(3, "done")
    clock.now += 0.25
    beat.publish(store, calls, *beat.last)
    fields = json.loads(store.get("hb/5"))
    assert Beat(**fields) == Beat(3, "done", 1000.0, True, 0.25, count=1)
    beat.acknowledge(store, calls)
    assert store.get("ack/5") == b"1"
    assert Heartbeat(0).timed("compute") is False  # not armed before the first "done"


def test_a_rank_silent_in_an_untimed_phase_holds_the_clocks_only_for_a_timeout(
    clock: _Clock, calls
) -> None:
    store = dist.HashStore()
    ranks, judge = [Heartbeat(r) for r in range(2)], Judge(2, timeout=5.0)
    ranks[0].progress(1, "done")
    ranks[0].progress(1, "compute")  # waits for rank 1 in its collective
    _beat_all(store, calls, ranks)  # rank 1: "start", then stopped (SIGSTOP) for good
    findings = []
    for _ in range(8):
        clock.now += 2.0
        ranks[0].publish(store, calls, *ranks[0].last)  # only rank 0 still beats
        findings.append(judge.judge(store, calls))
    assert findings[:2] == [None, None]  # held while rank 1 might still be starting
    finding = next(f for f in findings if f is not None)
    assert "rank(s) 1 stopped at step 0 (before its first progress report)" in finding
