"""The watchdog's halves on a real store, one process, a clock the test moves."""

from __future__ import annotations

import functools
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
        beat.publish(store, calls, *beat.last)


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
    assert "rank(s) 1 went silent (no heartbeat for " in finding
    assert (
        "somewhere between its start and where the others wait for them: rank(s) 0 at " in finding
    )
    assert "step 0" not in finding  # a rank that never reported has no known step


# fit's reports over its first epoch of 8 steps, as each rank makes them: the data and compute
# of each step, then "done" with the count of steps finished. After the last batch the loader
# is asked once more and the epoch's totals are summed ("compute"); then the epoch's end.
_EPOCH = [
    *(
        (at, phase)
        for k in range(8)
        for at, phase in ((k, "data"), (k, "compute"), (k + 1, "done"))
    ),
    (8, "data"),
    (8, "compute"),
]
_END = [*_EPOCH, (8, "epoch_end")]
_VALIDATED = [*_END, (8, "start_val_data"), (8, "val_data"), (8, "validate")]
_VALIDATED += [(8, "val_data"), (8, "validate")]
_NEXT_EPOCH = [(8, "start_data"), (8, "compute"), (8, "data"), (8, "compute")]


def _stall(
    clock: _Clock,
    calls: BoundedCalls,
    paths: list[list[tuple[int, str]]],
    issued: list[int] | None = None,
) -> str:
    """Each rank reports its path of (step, phase), then every rank stops: the judge's verdict.

    ``issued``: each rank's count of collectives, as its heartbeat reads it.
    """
    store, timeout = dist.HashStore(), 5.0
    if issued is None:
        ranks = [Heartbeat(r) for r in range(len(paths))]
    else:
        ranks = [Heartbeat(r, collectives=functools.partial(int, n)) for r, n in enumerate(issued)]
    judge = Judge(len(paths), timeout)
    for beat, path in zip(ranks, paths, strict=True):
        for step, phase in path:
            beat.progress(step, phase)
    _beat_all(store, calls, ranks)
    assert judge.judge(store, calls) is None
    clock.now += timeout + 0.5
    _beat_all(store, calls, ranks)
    finding = judge.judge(store, calls)
    assert finding is not None
    return finding


@pytest.mark.parametrize("stuck", [_EPOCH, _END], ids=["no-epoch_end-report", "epoch_end"])
def test_a_rank_hanging_in_a_callback_is_named_not_the_ones_saving_the_epoch(
    clock: _Clock, calls: BoundedCalls, stuck: list[tuple[int, str]]
) -> None:
    # No validation: rank 1 hangs in a callback, the others wait in the save's collective.
    saving = [*stuck, (8, "save")]
    finding = _stall(clock, calls, [saving, stuck, saving])
    assert "; rank(s) 1 stopped at step 8 (" in finding
    assert "the others wait for them: rank(s) 0, 2 at step 8 (saving a checkpoint)" in finding


@pytest.mark.parametrize(
    ("stuck", "where"),
    [
        (_END, "ending the epoch: its totals, report, callbacks"),
        (_VALIDATED, "in validation"),
        ([*_END, (8, "callbacks")], "in the epoch's report or callbacks"),
    ],
    ids=["epoch_end", "validate", "callbacks"],
)
def test_a_rank_at_the_epochs_end_is_behind_ranks_in_the_next_epoch_at_the_same_step(
    clock: _Clock, calls: BoundedCalls, stuck: list[tuple[int, str]], where: str
) -> None:
    # A loop of the user's own with nothing collective at the epoch's end: the others go on.
    finding = _stall(clock, calls, [[*stuck, (8, "save"), *_NEXT_EPOCH], stuck])
    assert f"rank(s) 1 stopped at step 8 ({where}); the others wait for them: " in finding
    assert "rank(s) 0 at step 8 (in compute)" in finding


@pytest.mark.parametrize("stuck", [_EPOCH, _END], ids=["no-epoch_end-report", "epoch_end"])
def test_a_rank_stuck_before_validation_is_behind_the_ranks_validating(
    clock: _Clock, calls: BoundedCalls, stuck: list[tuple[int, str]]
) -> None:
    # Rank 1 never reaches its first validation batch; rank 0 waits in validation's all-reduce.
    finding = _stall(clock, calls, [_VALIDATED, stuck])
    assert "; rank(s) 1 stopped at step 8 (" in finding
    assert "the others wait for them: rank(s) 0 at step 8 (in validation)" in finding


def test_a_rank_stopped_at_the_epochs_end_is_named_silent_not_at_its_last_reports_step(
    clock: _Clock, calls: BoundedCalls
) -> None:
    # Rank 1 sent one heartbeat, at its first batch; its 8 steps took less than an interval,
    # and a SIGSTOP in a callback stopped it (heartbeat and all) while the others saved.
    store, timeout = dist.HashStore(), 5.0
    ranks = [Heartbeat(r) for r in range(3)]
    judge = Judge(3, timeout, silence=2.5 * timeout / 4)  # the watchdog's, default interval
    ranks[1].progress(0, "data")
    _beat_all(store, calls, ranks[1:2])
    for r in (0, 2):
        for step, phase in [*_END, (8, "save")]:
            ranks[r].progress(step, phase)
    findings = []
    for _ in range(8):
        clock.now += 1.0
        _beat_all(store, calls, [ranks[0], ranks[2]])
        findings.append(judge.judge(store, calls))
    finding = next(f for f in findings if f is not None)
    assert "rank(s) 1 went silent (no heartbeat for " in finding
    assert "stopped at step 0" not in finding  # its last report is a bound, not its place
    assert (
        "somewhere between its last report, at step 0 (waiting for training data), and where "
        "the others wait for them: rank(s) 0, 2 at step 8 (saving a checkpoint)"
    ) in finding


def test_a_rank_stuck_saving_is_told_from_one_waiting_in_the_saves_collective(
    clock: _Clock, calls: BoundedCalls
) -> None:
    # Both report "save"; rank 0 never entered collective #24, in which rank 1 waits.
    saving = [*_END, (8, "save")]
    finding = _stall(clock, calls, [saving, saving], issued=[23, 24])
    assert (
        "rank(s) 0 stopped at step 8 (saving a checkpoint); the others wait for them: rank(s) 1 "
        "at step 8 (saving a checkpoint); rank(s) 0 never entered collective #24, the others did"
    ) in finding


def test_a_rank_in_a_callback_is_told_from_ones_waiting_in_the_epochs_last_collective(
    clock: _Clock, calls: BoundedCalls
) -> None:
    # No checkpoints: after the callbacks every rank all-reduces whether to stop; rank 1 hangs
    # in a callback, at the same place as ranks 0 and 2, but one collective short of theirs.
    finding = _stall(clock, calls, [_VALIDATED] * 3, issued=[22, 21, 22])
    assert "rank(s) 1 stopped at step 8 (in validation); the others wait for them: " in finding
    assert "; rank(s) 1 never entered collective #22, the others did" in finding


def test_a_desync_names_the_rank_that_ran_another_collective_and_says_desync(
    clock: _Clock, calls: BoundedCalls
) -> None:
    # Rank 1's callback broadcasts, which rank 0's does not: rank 0 went on to the save's
    # collective; both issued 22 and wait in different ones.
    finding = _stall(clock, calls, [[*_END, (8, "save")], _END], issued=[22, 22])
    ending = "ending the epoch: its totals, report, callbacks"
    assert f"; rank(s) 1 stopped at step 8 ({ending}); the others wait for them: " in finding
    assert "rank(s) 0 at step 8 (saving a checkpoint)" in finding
    assert "every rank issued 22 collectives: if each waits in its last, those differ" in finding
    assert "FIRST DISAGREEMENT" in finding


def test_a_step_checkpoint_between_steps_stays_before_the_next_steps_data(
    clock: _Clock, calls: BoundedCalls
) -> None:
    # Mid-epoch, rank 0 alone saves after step 4 (a loop of the user's own) and hangs there.
    steps = [(3, "data"), (3, "compute"), (4, "done")]
    saving, next_step = [*steps, (4, "save")], [(4, "data"), (4, "compute")]
    finding = _stall(clock, calls, [saving, [*steps, *next_step]])
    assert "rank(s) 0 stopped at step 4 (saving a checkpoint); the others wait " in finding
    # Once it saved and went on, a rank stuck in the next step's data is the one behind.
    finding = _stall(clock, calls, [[*saving, *next_step], [*steps, (4, "data")]])
    assert "rank(s) 1 stopped at step 4 (waiting for training data); the others wait " in finding
