"""Stopping a job together: signals and failed writes become one agreed stop step.

A preemption signal (SIGTERM, SIGUSR1 ...) reaches one rank, or all of them at
different moments; a background checkpoint write fails on one rank. Every rank
must then stop after the *same* optimizer step, or the others wait for ever in
the next collective. :class:`StepControl` agrees on that step through the c10d
store, one cheap store call per step, and :class:`Preempted` ends the process
with :data:`PREEMPTED_EXIT_CODE` once the checkpoint is written.
"""

from __future__ import annotations

import logging
import secrets
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.distributed.comm import all_gather_object, all_reduce_sum

__all__ = [
    "HANG_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "Actions",
    "HangStopped",
    "Preempted",
    "SignalStopped",
    "StepControl",
    "Stop",
]

logger = logging.getLogger("ddpkit")

# sysexits.h's EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
PREEMPTED_EXIT_CODE = 75
# As timeout(1) exits when its command ran too long.
HANG_EXIT_CODE = 124


class Preempted(SystemExit):
    """The job stopped on a signal after writing a checkpoint; resume to continue.

    A ``SystemExit`` with code :data:`PREEMPTED_EXIT_CODE` (75): uncaught, the
    process exits with that status and no traceback, which is what a batch
    script or a launcher tests for.

    Attributes:
        signal_name: the signal that asked for the stop, e.g. ``"SIGTERM"``.
        checkpoint: the checkpoint written on this rank, or None (ranks that
            do not write, or no ``CheckpointManager``).
        step: the optimizer step (counted over the whole run) after which it stopped.
    """

    def __init__(self, signal_name: str, checkpoint: str | None = None, step: int = 0) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal_name, self.checkpoint, self.step = signal_name, checkpoint, step

    def __str__(self) -> str:
        saved = f"; saved {self.checkpoint}" if self.checkpoint else ""
        return f"stopped by {self.signal_name} after step {self.step}{saved}"

    def __reduce__(self) -> tuple[type[Preempted], tuple[str, str | None, int]]:
        return Preempted, (self.signal_name, self.checkpoint, self.step)


class HangStopped(SystemExit):
    """The hang watchdog stopped the job's processes (``spawn``); restart it to continue.

    A ``SystemExit`` with code :data:`HANG_EXIT_CODE` (124): uncaught, the
    process exits with that status, as each rank did. ``spawn`` logs the
    finding before raising it.

    Attributes:
        finding: the watchdog's words: which rank stopped, at which step, where.
    """

    def __init__(self, finding: str) -> None:
        super().__init__(HANG_EXIT_CODE)
        self.finding = finding

    def __str__(self) -> str:
        return self.finding

    def __reduce__(self) -> tuple[type[HangStopped], tuple[str]]:
        return HangStopped, (self.finding,)


class SignalStopped(SystemExit):
    """The job ended on a signal before it saved anything: there is nothing to resume from.

    A ``SystemExit`` with code ``128 + signum`` (143 for SIGTERM), as a shell
    reports a command a signal ended, not :data:`PREEMPTED_EXIT_CODE`, which
    promises a checkpoint. ``spawn`` logs what happened before raising it.

    Attributes:
        signal_name: the signal, e.g. ``"SIGTERM"``.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name

    def __str__(self) -> str:
        return (
            f"stopped by {self.signal_name} before training began (or with no stop handler "
            f"installed): nothing was saved; exit status {self.code}"
        )

    def __reduce__(self) -> tuple[type[SignalStopped], tuple[int]]:
        return SignalStopped, (int(self.code) - 128,)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Stop:
    """Why the ranks stop: a signal, or an error one rank met (a failed checkpoint write)."""

    kind: str  # "signal" or "error"
    detail: str  # the signal's name, or the error's text


@dataclass(frozen=True)
class Actions:
    """What every rank does after the step just finished: save, stop, or neither."""

    save: bool = False
    stop: Stop | None = None


class StepControl:
    """Agree, between optimizer steps, on when every rank saves and stops.

    A rank that wants to stop (it got a signal, or its checkpoint writer
    failed) posts "stop after step s + k" in the store at a check point s, and
    so does rank 0 for a timed save. Every rank reads the posts at each check
    point: after every step (one ``store.add`` when nothing happens). As no rank
    can finish step s + 1 before the poster takes part in it, every rank reads
    the post before it passes the agreed step: all stop after the same one.
    With one rank, or no store, it acts at once.

    Use it as a context manager around training: it installs handlers for
    ``signals`` (in the main thread) and puts the previous ones back. A SIGINT
    this process inherited as ignored (a job started with ``&`` from a script,
    or under ``nohup``) stays ignored, as Python itself leaves it.

    Args:
        signals: names (``"SIGTERM"``) or numbers of the signals that ask to
            stop. A second SIGINT more than a second after the first raises
            ``KeyboardInterrupt`` at once.
        store: the c10d store every rank shares, under a prefix of this run.
        rank: this rank.
        world_size: ranks in the job.

    When to save is not decided here (``ddpkit.checkpoint.cadence`` decides):
    :meth:`after_step` is told what each rank's cadence says and agrees on it.
    """

    def __init__(
        self,
        *,
        signals: Sequence[str | int] = (),
        store: Any = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self._signals = [_signal_number(s) for s in signals]
        self._store: Any = store if world_size > 1 else None
        self._rank = rank
        self._asked: int | None = None  # the step of the timed save rank 0 posted, until taken
        self._previous: dict[int, Any] = {}
        self._signal: str | None = None
        self._signal_at = 0.0
        self._error: str | None = None
        self._posted = False
        self._seen = 0
        self._stop_at: int | None = None
        self._stop: Stop | None = None
        self._saves: set[int] = set()

    @staticmethod
    def shared_store(world_size: int, rank: int) -> Any:
        """The store every rank shares, under a prefix new to this run; None on one rank.

        One collective: all ranks must call it, or it deadlocks.
        """
        if world_size <= 1 or not dist.is_initialized():
            return None
        token = all_gather_object(secrets.token_hex(8) if rank == 0 else None)[0]
        return dist.PrefixStore(f"ddpkit/fit/{token}/", dist.distributed_c10d._get_default_store())

    def __enter__(self) -> StepControl:
        if threading.current_thread() is threading.main_thread():
            for number in self._signals:
                # An ignored SIGINT is the shell's way to keep a background job out of
                # the terminal's Ctrl-C (`cmd &`, nohup); Python leaves it so, and so do we.
                if number == signal.SIGINT and signal.getsignal(number) is signal.SIG_IGN:
                    continue
                self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    @property
    def requested(self) -> Stop | None:
        """This rank's own reason to stop, if it has one."""
        if self._error is not None:
            return Stop("error", self._error)
        if self._signal is not None:
            return Stop("signal", self._signal)
        return None

    def request_stop(self, error: str) -> None:
        """Ask every rank to stop because of ``error``; safe from any thread."""
        if self._error is None:
            self._error = error

    def after_step(self, step: int, *, counted: bool = False, timed: bool = False) -> Actions:
        """Call on every rank after optimizer step ``step`` (1, 2, ... over the run).

        ``counted``: this rank's cadence asks for a save after this step (a
        step count, the same on every rank). ``timed``: rank 0's clock asks for
        one (the other ranks' word is not read); it is agreed through the store
        and taken a step later. A stop a signal or a failed write asks for is
        agreed the same way. The answer is the same on every rank.
        """
        if self._store is None:
            return Actions(save=counted or timed, stop=self.requested)
        mine = self.requested
        if mine is not None and not self._posted:
            self._post(f"stop|{step + 1}|{mine.kind}|{mine.detail}")
            self._posted = True
        if self._rank == 0 and timed and (self._asked is None or step > self._asked):
            # Asked once: the cadence's clock restarts when the save is taken, a step later.
            self._asked = step + 1
            self._post(f"save|{step + 1}")
        self._read()
        return Actions(save=counted or step in self._saves, stop=self._stop_now(step))

    def stop_at_epoch_end(self) -> Stop | None:
        """Whether any rank wants to stop now, at an epoch's end. All ranks must call this.

        One all-reduce: stopping here, after the epoch's checkpoint, costs no extra step.
        """
        mine = self.requested
        if self._store is None:
            return mine
        if mine is not None and not self._posted:
            self._post(f"stop|{0}|{mine.kind}|{mine.detail}")  # the reason, for the others
            self._posted = True
        wanted = 1 if mine is not None or self._stop is not None else 0
        if int(all_reduce_sum(wanted)) == 0:
            return None
        self._read()
        return mine or self._stop or Stop("signal", "a stop request")

    def _stop_now(self, step: int) -> Stop | None:
        return self._stop if self._stop_at is not None and step >= self._stop_at else None

    def _post(self, action: str) -> None:
        index = int(self._store.add(_POSTED, 1))
        self._store.set(f"{_ACTION}{index}", action)
        self._store.add(_SEQ, 1)

    def _read(self) -> None:
        count = int(self._store.add(_SEQ, 0))
        if count <= self._seen:
            return
        keys = [f"{_ACTION}{i}" for i in range(self._seen + 1, count + 1)]
        # A poster sets its action between two adds; waiting here covers that moment.
        self._store.wait(keys, timedelta(seconds=60))
        for raw in self._store.multi_get(keys):
            kind, step, *rest = raw.decode().split("|", 3)
            if kind == "save":
                self._saves.add(int(step))
            elif self._stop_at is None or (int(step) and int(step) < self._stop_at):
                self._stop_at, self._stop = int(step) or None, Stop(rest[0], rest[1])
        self._seen = count

    def _on_signal(self, number: int, frame: object) -> None:
        now = time.monotonic()
        if self._signal is not None:
            if number == signal.SIGINT and now - self._signal_at > 1.0:
                raise KeyboardInterrupt  # Ctrl-C a second time: stop at once
            return  # the same request again (a launcher forwarding it, say)
        self._signal, self._signal_at = signal.Signals(number).name, now
        logger.warning(
            "%s received: every rank stops after the same step, within two optimizer steps, "
            "writes a checkpoint and exits with status %d%s",
            self._signal,
            PREEMPTED_EXIT_CODE,
            "; Ctrl-C again to stop at once" if number == signal.SIGINT else "",
        )


_SEQ, _POSTED, _ACTION = "seq", "posted", "action/"


def _signal_number(value: str | int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return int(signal.Signals(value))
    name = str(value).upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise ValueError(
            f"{value!r} is not a signal here; use names such as 'SIGTERM', 'SIGUSR1', 'SIGINT'"
        ) from None
