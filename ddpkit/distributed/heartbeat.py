"""The hang watchdog's two halves: a heartbeat on every rank, a judge on rank 0, one contract.

As ``torch.distributed.elastic.timer`` keeps the client (in each worker) apart
from the server that decides, :class:`Heartbeat` only says where its rank is
and obeys a verdict, and :class:`Judge` only reads every rank's heartbeat and
decides. They share nothing but these keys of the c10d store, under the
watchdog's prefix (:class:`~ddpkit.distributed.watchdog.HangWatchdog` runs
both in one thread and owns the exit):

``hb/<rank>``
    the rank's :class:`Beat` as JSON, rewritten every interval;
    ``{"stopped": true}`` once it stops watching (a finished rank is not hung).
``held``
    a counter the judge adds 1 to while some rank is in an untimed phase: the
    other ranks hold their own clocks when it moves.
``hang``
    the judge's verdict, written once; every heartbeat that reads it stops.
``ack/<rank>``
    the rank read the verdict and is exiting.

Every store call is made through a :class:`~ddpkit.distributed.deadline.BoundedCalls`
of the caller's, so a lost store costs a bounded wait, never a hang.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from ddpkit.distributed.deadline import BoundedCalls
from ddpkit.distributed.stops import HANG_EXIT_CODE

__all__ = ["PHASES", "UNTIMED_PHASES", "Beat", "Heartbeat", "Judge", "where"]

_monotonic = time.monotonic

# The phases in the order the loop passes them within one step number:
# progress(k, "done") ends step k - 1, so it comes before the data for step k.
PHASES = {
    "start": "before its first progress report",
    "done": "between steps",
    "start_val_data": "starting workers for validation data",
    "val_data": "waiting for validation data",
    "end_val_data": "stopping the workers of validation data",
    "validate": "in validation",
    "save": "saving a checkpoint",
    "trackers": "reporting the end of the run (summary, curves, the trackers' last records)",
    "start_data": "starting workers for training data",
    "data": "waiting for training data",
    "end_data": "stopping the workers of training data",
    "compute": "in compute",
}
_ORDER = {name: i for i, name in enumerate(PHASES)}
# Never timed: a loader starting its workers (importing torch in each, a spawn or
# forkserver start, the user's worker_init_fn) or joining them (DataLoader bounds
# that) takes as long as it takes. While any rank is in one, the others (which soon
# wait for it in a collective) are not timed either. The trackers' last records are
# waited for with a deadline of their own (ddpkit.training.trackers).
UNTIMED_PHASES = frozenset(
    {"start", "start_data", "start_val_data", "end_data", "end_val_data", "trackers"}
)


def where(step: int, phase: str) -> str:
    """``"at step 5 (waiting for training data)"``: a place in the loop, in words."""
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

    def point(self) -> tuple[int, int]:
        """Its place in the loop's order: who is furthest behind has the lowest."""
        return self.step, _ORDER.get(self.phase, len(_ORDER))


class Heartbeat:
    """Every rank's half: what its loop last reported, published; rank 0's verdict, obeyed.

    :meth:`progress` is called by the loop (cheap: one tuple); the rest by the
    watchdog's thread, one round per interval.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.last: tuple[int, str, float] = (0, "start", _monotonic())
        self.armed = False  # from the first "done": a slow first step is never timed
        # When some rank was last seen in an untimed phase, on this rank's clock.
        self.held_at = -math.inf
        self._holds = 0
        self._count = 0

    def progress(self, step: int, phase: str) -> None:
        """Record that this rank reached ``phase`` of ``step``."""
        self.last = (step, phase, _monotonic())
        if phase == "done":
            self.armed = True

    def timed(self, phase: str) -> bool:
        """Whether this rank's clock runs in ``phase``."""
        return self.armed and phase not in UNTIMED_PHASES

    def publish(self, store: Any, calls: BoundedCalls, step: int, phase: str, stamp: float) -> None:
        """Write this rank's :class:`Beat` to ``hb/<rank>``."""
        self._count += 1
        beat = Beat(step, phase, stamp, self.timed(phase), _monotonic() - stamp, self._count)
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
    rank published with it.
    """

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size, self.timeout = world_size, timeout
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
        return verdict(beats, self.world_size, stale, self.timeout)

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


def verdict(beats: dict[int, Beat], world: int, idle: float, timeout: float) -> str:
    """The finding in words: who stopped where, and where the others wait for them."""
    missing = [r for r in range(world) if r not in beats]
    lowest = min(b.point() for b in beats.values())
    behind = [r for r, b in beats.items() if not missing and b.point() == lowest]
    places: dict[tuple[int, int], list[int]] = {}
    for r in sorted(set(beats) - set(behind)):
        places.setdefault(beats[r].point(), []).append(r)

    def at(r: int) -> str:
        return where(beats[r].step, beats[r].phase)

    if missing:
        what = f"rank(s) {_ranks(missing)} never sent a heartbeat (watchdog not started)"
    elif places:
        what = f"rank(s) {_ranks(behind)} stopped {at(behind[0])}"
    else:
        what = f"all ranks stopped {at(behind[0])}, none behind another: they all wait in one "
        what += "operation (a collective or a lock) that never completes"
    if places:
        what += "; the others wait for them: "
        what += "; ".join(f"rank(s) {_ranks(rs)} {at(rs[0])}" for rs in places.values())
    return (
        f"hang watchdog: no progress for {idle:.1f} s (timeout {timeout:g} s); {what}. Each "
        f"rank writes its Python stacks to its log; exiting with status {HANG_EXIT_CODE} so "
        "that a launcher (torchrun --max-restarts) can restart the job."
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown if len(ranks) <= 16 else f"{shown}, ... ({len(ranks)} in all)"
