"""The hang watchdog's two halves: a heartbeat on every rank, a judge on rank 0, one contract.

As ``torch.distributed.elastic.timer`` keeps the client (in each worker) apart
from the server that decides, :class:`Heartbeat` only says where its rank is
and obeys a verdict, and :class:`Judge` only reads every rank's heartbeat and
decides. They share nothing but these keys of the c10d store, under the
watchdog's prefix (:class:`~ddpkit.distributed.watchdog.HangWatchdog` runs
both in one thread and owns the exit):

``hb/<rank>``
    the rank's :class:`Beat` as JSON, rewritten every interval: where its loop
    is (step, phase, and which part of the loop at that step) and how many
    collectives it issued; ``{"stopped": true}`` once it stops watching (a
    finished rank is not hung).
``held``
    a counter the judge adds 1 to while some rank is in an untimed phase: the
    other ranks hold their own clocks when it moves.
``hang``
    the judge's verdict, written once; every heartbeat that reads it stops.
``ack/<rank>``
    the rank read the verdict and is exiting.

Every store call is made through a :class:`~ddpkit.distributed.deadline.BoundedCalls`
of the caller's, so a lost store costs a bounded wait, never a hang.

The verdict names the rank(s) the others wait for: first by the collectives
each issued (a rank that never entered the one the others wait in, as the hang
report's FIRST DISAGREEMENT says), then by the place in the loop; a rank whose
heartbeat stopped too is named as silent, its last report no more than a bound.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ddpkit.distributed.deadline import BoundedCalls
from ddpkit.distributed.stops import HANG_EXIT_CODE

__all__ = ["PHASES", "UNTIMED_PHASES", "Beat", "Heartbeat", "Judge", "where"]

_monotonic = time.monotonic

# What each phase means, in words. Within one step number k the loop passes two parts, in
# turn: the steps' (progress(k, "done") ends step k - 1; a step checkpoint; the data and the
# compute of step k + 1) and, at an epoch's end, the end's (the epoch's totals, validation,
# the report and callbacks, the epoch's checkpoint, the run's end), after which the next
# epoch's steps begin at the same k. So "compute" at step k is behind "save" at step k at an
# epoch's end, and ahead of it again in the next epoch: a place is (step, part, phase).
PHASES = {
    "start": "before its first progress report",
    "done": "between steps",
    "save": "saving a checkpoint",
    "start_data": "starting workers for training data",
    "data": "waiting for training data",
    "end_data": "stopping the workers of training data",
    "compute": "in compute",
    "epoch_end": "ending the epoch: its totals, report, callbacks",
    "start_val_data": "starting workers for validation data",
    "val_data": "waiting for validation data",
    "end_val_data": "stopping the workers of validation data",
    "validate": "in validation",
    "callbacks": "in the epoch's report or callbacks",
    "trackers": "reporting the end of the run (summary, curves, the trackers' last records)",
}
# The two parts in the loop's order. "save" is in both: a step checkpoint follows "done" (the
# steps' part), the epoch's follows its end, or the work of its last step (the end's part). A
# phase of the other part begins the next part; one of the caller's own stays in its part, last.
_STEPS_PART = ("start", "done", "save", "start_data", "data", "end_data", "compute")
_END_PART = (
    "epoch_end",
    "start_val_data",
    "val_data",
    "end_val_data",
    "validate",
    "callbacks",
    "save",
    "trackers",
)
_ORDERS = tuple({name: i for i, name in enumerate(part)} for part in (_STEPS_PART, _END_PART))
_PART_OF = {name: side for side, part in enumerate((_STEPS_PART, _END_PART)) for name in part}
del _PART_OF["save"]
# Never timed: a loader starting its workers (importing torch in each, a spawn or
# forkserver start, the user's worker_init_fn) or joining them (DataLoader bounds
# that) takes as long as it takes. While any rank is in one, the others (which soon
# wait for it in a collective) are not timed either. The trackers' last records are
# waited for with a deadline of their own (ddpkit.training.trackers).
UNTIMED_PHASES = frozenset(
    {"start", "start_data", "start_val_data", "end_data", "end_val_data", "trackers"}
)


def where(step: int, phase: str) -> str:
    """``"at step 5 (waiting for training data)"``: a place in the loop, in words.

    Before its first report a rank's step is not known: no step is named.
    """
    if phase == "start":
        return PHASES["start"]
    return f"at step {step} ({PHASES.get(phase, phase)})"


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat: where its loop last reported, and since when."""

    step: int
    phase: str
    stamp: float  # the rank's monotonic clock at that report
    armed: bool  # timed: the first step finished and the phase is not untimed
    idle: float  # seconds from the report to publishing it: never before the truth
    count: int = 0  # heartbeats the rank sent so far: a silent rank's stops changing
    part: int = 0  # of the loop at this step: 0 the steps, 1 the epoch's end, 2 the next epoch's...
    collectives: int | None = None  # issued on the default group when published; None: unknown

    def point(self) -> tuple[int, int, int]:
        """Its place in the loop's order: who is furthest behind has the lowest.

        A ``part`` that does not fit the phase (a beat made without one:
        ``"validate"`` with part 0) is read as the part after it.
        """
        side = _PART_OF.get(self.phase)
        part = self.part + 1 if side is not None and side != self.part % 2 else self.part
        order = _ORDERS[part % 2]
        return self.step, part, order.get(self.phase, len(order))


class Heartbeat:
    """Every rank's half: what its loop last reported, published; rank 0's verdict, obeyed.

    :meth:`progress` is called by the loop (cheap: one tuple); the rest by the
    watchdog's thread, one round per interval.
    """

    def __init__(self, rank: int, collectives: Callable[[], int | None] | None = None) -> None:
        self.rank = rank
        # (step, phase, stamp, part): one tuple, which the watchdog's thread reads whole.
        self.last: tuple[int, str, float, int] = (0, "start", _monotonic(), 0)
        self.collectives = collectives  # how many this rank issued so far; read at each beat
        self.armed = False  # from the first "done": a slow first step is never timed
        # When some rank was last seen in an untimed phase, on this rank's clock.
        self.held_at = -math.inf
        self._holds = 0
        self._count = 0

    def progress(self, step: int, phase: str) -> None:
        """Record that this rank reached ``phase`` of ``step``, and in which part of the loop.

        Every report must come here, in the loop's order: a part begins when a
        phase of the other part follows one of its own at the same step.
        """
        last, before, _, part = self.last
        side = _PART_OF.get(phase)  # None: "save" or the caller's own, in the part it came in
        if side is None and phase == "save" and _PART_OF.get(before) == 0:
            side = 0 if before in ("start", "done") else 1  # after a step's work: its end
        if step != last:
            part = side or 0
        elif side is not None and side != part % 2:
            part += 1
        self.last = (step, phase, _monotonic(), part)
        if phase == "done":
            self.armed = True

    def timed(self, phase: str) -> bool:
        """Whether this rank's clock runs in ``phase``."""
        return self.armed and phase not in UNTIMED_PHASES

    def publish(
        self,
        store: Any,
        calls: BoundedCalls,
        step: int,
        phase: str,
        stamp: float,
        part: int = 0,
    ) -> None:
        """Write this rank's :class:`Beat` to ``hb/<rank>``, with the collectives issued now."""
        self._count += 1
        issued = None if self.collectives is None else self.collectives()
        idle = _monotonic() - stamp
        beat = Beat(step, phase, stamp, self.timed(phase), idle, self._count, part, issued)
        calls(store.set, f"hb/{self.rank}", json.dumps(asdict(beat)))

    def verdict(self, store: Any, calls: BoundedCalls) -> str | None:
        """The judge's verdict, once there is one."""
        if not calls(store.check, ["hang"]):
            return None
        return str(calls(store.get, "hang").decode())

    def follow_holds(self, store: Any, calls: BoundedCalls) -> None:
        """Hold this rank's clock when the judge saw some rank in an untimed phase."""
        holds = int(calls(store.add, "held", 0))
        if holds != self._holds:
            self._holds, self.held_at = holds, _monotonic()

    def acknowledge(self, store: Any, calls: BoundedCalls) -> None:
        """Say this rank read the verdict and is exiting."""
        calls(store.set, f"ack/{self.rank}", "1")

    def sign_off(self, store: Any, calls: BoundedCalls) -> None:
        """Say this rank stopped watching, so the judge does not take it for hung."""
        calls(store.set, f"hb/{self.rank}", json.dumps({"stopped": True}))


class Judge:
    """Rank 0's half: reads every heartbeat and decides when a stall is a hang, and whose.

    Each rank's progress is timed on rank 0's clock (the ranks' clocks are not
    compared): from when rank 0 first read a new stamp, less the idle time the
    rank published with it. A rank whose heartbeat count rank 0 saw unchanged
    for more than ``silence`` seconds (default ``timeout``) is silent: stopped
    (SIGSTOP), frozen, or on a lost host, its last report older than its place.
    """

    def __init__(self, world_size: int, timeout: float, silence: float | None = None) -> None:
        self.world_size, self.timeout = world_size, timeout
        self.silence = timeout if silence is None else silence
        self.heard: list[int] = []  # the other ranks that sent heartbeats
        self.held_at = -math.inf  # when some rank was last seen in an untimed phase
        self._stamps: dict[int, float] = {}  # each rank's last progress stamp ...
        self._since: dict[int, float] = {}  # ... and when, on rank 0's clock, it was made
        self._counts: dict[int, int] = {}  # each rank's heartbeat count ...
        self._beating: dict[int, float] = {}  # ... and when rank 0 last saw it change

    def judge(self, store: Any, calls: BoundedCalls) -> str | None:
        """Read the heartbeats; the verdict once an armed rank made no progress for ``timeout``."""
        beats = self._read(store, calls)
        now = _monotonic()
        for r, beat in beats.items():
            since = now - beat.idle
            if beat.stamp != self._stamps.get(r):
                self._stamps[r], self._since[r] = beat.stamp, since
            self._since[r] = min(self._since[r], since)
            if beat.count != self._counts.get(r):
                self._counts[r], self._beating[r] = beat.count, now
        self.heard = [r for r in beats if r != 0]
        # A rank starting its workers holds every clock, while its heartbeat goes on:
        # one stopped (SIGSTOP) or frozen there must not hold them for ever.
        if any(
            b.phase in UNTIMED_PHASES and now - self._beating[r] <= self.timeout
            for r, b in beats.items()
        ):
            self.held_at = now
            calls(store.add, "held", 1)  # the other ranks hold their own clocks too
        stale = max(
            (now - max(self._since[r], self.held_at) for r, b in beats.items() if b.armed),
            default=0.0,
        )
        if stale <= self.timeout:
            return None
        silent = {r: now - self._beating[r] for r in beats if now - self._beating[r] > self.silence}
        return verdict(beats, self.world_size, stale, self.timeout, silent)

    def post(self, store: Any, calls: BoundedCalls, finding: str) -> None:
        """Publish the verdict for every heartbeat to read."""
        calls(store.set, "hang", finding)

    def _read(self, store: Any, calls: BoundedCalls) -> dict[int, Beat]:
        keys = [f"hb/{r}" for r in range(self.world_size)]
        if calls(store.check, keys):
            values = calls(store.multi_get, keys)
        else:  # a rank has not started yet, and multi_get would wait for its key
            values = [calls(store.get, k) if calls(store.check, [k]) else None for k in keys]
        beats = {}
        for r, value in enumerate(values):
            fields = None if value is None else json.loads(value)
            if fields is not None and not fields.get("stopped"):
                beats[r] = Beat(**fields)
        return beats


def verdict(
    beats: Mapping[int, Beat],
    world: int,
    idle: float,
    timeout: float,
    silent: Mapping[int, float] | None = None,
) -> str:
    """The finding in words: who stopped where, and where the others wait for them.

    The rank(s) named are those the others wait for: the fewest collectives
    issued (when every beat counts them), then the lowest :meth:`Beat.point`.
    ``silent`` maps each rank whose heartbeat stopped to its seconds of silence.
    """
    silent = silent or {}
    missing = [r for r in range(world) if r not in beats]
    counted = all(b.collectives is not None for b in beats.values())

    def key(r: int) -> tuple[int, int, int, int]:
        return ((beats[r].collectives or 0) if counted else 0, *beats[r].point())

    lowest = min(map(key, beats))
    behind = [r for r in sorted(beats) if not missing and key(r) == lowest]
    places: dict[tuple[tuple[int, int, int], bool], list[int]] = {}
    for r in sorted(set(beats) - set(behind)):
        places.setdefault((beats[r].point(), r in silent), []).append(r)

    def at(r: int) -> str:
        return where(beats[r].step, beats[r].phase)

    others = "; ".join(
        f"rank(s) {_ranks(rs)} {at(rs[0])}"
        + (f", silent for {max(silent[r] for r in rs):.1f} s" if quiet else "")
        for (_, quiet), rs in places.items()
    )
    first = behind[0] if behind else -1
    if missing:
        what = f"rank(s) {_ranks(missing)} never sent a heartbeat (watchdog not started)"
        what += f"; the others wait for them: {others}"
    elif not places:
        what = f"all ranks stopped {at(first)}, none behind another: they all wait in one "
        what += "operation (a collective or a lock) that never completes"
    elif all(r in silent for r in behind):
        # Its last report may be an interval old (many steps): only a bound on its place.
        last = "its start" if beats[first].phase == "start" else f"its last report, {at(first)},"
        what = (
            f"rank(s) {_ranks(behind)} went silent (no heartbeat for "
            f"{max(silent[r] for r in behind):.1f} s: stopped by a signal such as SIGSTOP, "
            f"frozen, or its host lost) somewhere between {last} and where the others wait "
            f"for them: {others}"
        )
    else:
        what = f"rank(s) {_ranks(behind)} stopped {at(first)}; the others wait for them: {others}"
        what += _collectives(beats, behind) if counted else ""
    return (
        f"hang watchdog: no progress for {idle:.1f} s (timeout {timeout:g} s); {what}. Each "
        f"rank writes its Python stacks to its log; exiting with status {HANG_EXIT_CODE} so "
        "that a launcher (torchrun --max-restarts) can restart the job."
    )


def _collectives(beats: Mapping[int, Beat], behind: list[int]) -> str:
    """What the collectives issued say of ``behind`` and the others, as the hang report would."""
    mine = beats[behind[0]].collectives or 0
    theirs = {b.collectives or 0 for r, b in beats.items() if r not in behind}
    if min(theirs) > mine:
        return f"; rank(s) {_ranks(behind)} never entered collective #{mine + 1}, the others did"
    if theirs == {mine}:  # had they all entered one and the same, it would have completed
        return (
            f"; every rank issued {mine} collectives: if each waits in its last, those differ "
            "(a desync: see the hang report's FIRST DISAGREEMENT)"
        )
    return ""


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown if len(ranks) <= 16 else f"{shown}, ... ({len(ranks)} in all)"
