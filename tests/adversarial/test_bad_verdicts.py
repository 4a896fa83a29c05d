"""The hang watchdog's verdict from heartbeats it cannot fully trust, still naming the right rank.

Kinds: collective counts from only some ranks (a backend that keeps none, a rank without a
process group) or all equal; phases of the caller's own, and "save" in every place a loop may
report it; beats written without the loop's part (hand-made, or by a rank that kept none),
reports out of the loop's order; a rank silent before its first report.
"""

from __future__ import annotations

import pytest

from ddpkit.distributed.heartbeat import Beat, Heartbeat, verdict


def _beat(step: int, phase: str, part: int = 0, issued: int | None = None) -> Beat:
    return Beat(
        step, phase, stamp=0.0, armed=True, idle=0.0, count=1, part=part, collectives=issued
    )


def _at(path: list[tuple[int, str]], issued: int | None = None) -> Beat:
    """The beat a rank publishes after reporting ``path``, one report after another."""
    heartbeat = Heartbeat(0)
    for step, phase in path:
        heartbeat.progress(step, phase)
    step, phase, _, part = heartbeat.last
    return _beat(step, phase, part, issued)


@pytest.mark.parametrize(
    "issued", [(None, 24), (23, None)], ids=["rank-0-unknown", "rank-1-unknown"]
)
def test_counts_missing_on_some_ranks_are_left_out_and_places_decide(
    issued: tuple[int | None, int | None],
) -> None:
    beats = {0: _beat(8, "save", 1, issued[0]), 1: _beat(8, "epoch_end", 1, issued[1])}
    finding = verdict(beats, 2, 6.0, 5.0)
    assert (
        "rank(s) 1 stopped at step 8 (ending the epoch: its totals, report, callbacks)" in finding
    )
    assert "collective" not in finding  # nothing said of counts not every rank gave


def test_counts_that_never_move_say_nothing_a_place_does_not() -> None:
    # A backend whose count stays 0: equal everywhere, the places decide, no desync is claimed
    # where the ranks also stand at one place.
    beats = {r: _beat(8, "save", 1, 0) for r in range(3)}
    finding = verdict(beats, 3, 6.0, 5.0)
    assert "all ranks stopped at step 8 (saving a checkpoint), none behind another" in finding
    assert "desync" not in finding


def test_a_phase_of_the_callers_own_stays_in_its_part_and_is_shown_by_name() -> None:
    # "ema_update" after compute (the steps' part); "upload" after validation (the end's).
    steps = [(4, "done"), (4, "data"), (4, "compute")]
    beats = {0: _at([*steps, (4, "ema_update")]), 1: _at([*steps, (4, "epoch_end"), (4, "upload")])}
    finding = verdict(beats, 2, 6.0, 5.0)
    assert "rank(s) 0 stopped at step 4 (ema_update); the others wait for them: rank(s) 1 " in (
        finding
    )
    assert "rank(s) 1 at step 4 (upload)" in finding


@pytest.mark.parametrize(
    ("path", "part"),
    [
        ([(4, "done"), (4, "save")], 0),  # a step checkpoint, between steps
        ([(4, "done"), (4, "save"), (4, "save")], 0),  # reported again while it lasts
        ([(4, "done"), (4, "data"), (4, "compute"), (4, "save")], 1),  # after a step's work
        ([(4, "done"), (4, "epoch_end"), (4, "save")], 1),  # the epoch's
        ([(4, "done"), (4, "epoch_end"), (4, "save"), (4, "data")], 2),  # then the next epoch
        ([(4, "done"), (4, "epoch_end"), (4, "save"), (4, "trackers")], 1),  # the run's end
        ([(9, "save")], 0),  # a new step, nothing before it
    ],
)
def test_save_belongs_to_the_part_of_the_loop_it_is_reported_in(
    path: list[tuple[int, str]], part: int
) -> None:
    assert _at(path).part == part


def test_a_beat_without_its_part_is_read_from_its_phase() -> None:
    # Written by hand (or by a rank that kept no part): "validate" with part 0 is the epoch's
    # end, behind no rank of the next epoch and ahead of every step of its own.
    validating = _beat(8, "validate")
    assert validating.point() > _beat(8, "compute").point()
    assert validating.point() < _beat(8, "compute", part=2).point()
    assert validating.point() < _beat(9, "done").point()


def test_reports_out_of_order_never_move_a_rank_back_within_a_step() -> None:
    # Whatever the order of a step's reports, each new part is later than the last.
    heartbeat, parts = Heartbeat(0), []
    for phase in ["compute", "validate", "data", "save", "trackers", "compute", "epoch_end"]:
        heartbeat.progress(3, phase)
        parts.append(heartbeat.last[3])
    assert parts == sorted(parts)
    assert parts[-1] == 5


def test_a_rank_silent_before_its_first_report_has_no_step_named() -> None:
    beats = {0: _beat(8, "save", 1), 1: Beat(0, "start", 0.0, False, 0.0, 1)}
    finding = verdict(beats, 2, 6.0, 5.0, silent={1: 7.5})
    assert "rank(s) 1 went silent (no heartbeat for 7.5 s" in finding
    assert "somewhere between its start and where the others wait for them: rank(s) 0 at " in (
        finding
    )
    assert "step 0" not in finding
