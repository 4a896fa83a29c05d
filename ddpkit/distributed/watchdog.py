"""The hang watchdog: a rank that stops making progress is named, stacks logged, the job exits.

When one rank stalls (a data loader hangs, NFS is stuck, a deadlock) the others
wait in the next collective for its timeout, 30 minutes by default, and nothing
says which rank stopped. Here a daemon thread on every rank runs a
:class:`~ddpkit.distributed.heartbeat.Heartbeat`, which publishes what the
loop last reported to :meth:`HangWatchdog.progress`; on rank 0 it also runs the
:class:`~ddpkit.distributed.heartbeat.Judge`, which compares them and names
the ranks furthest behind (``heartbeat`` holds the two and their contract).
This module owns the thread and the ending: every rank logs the stacks of all
its threads and exits with ``HANG_EXIT_CODE`` (124) for a launcher to restart.
Heartbeats go through the c10d store on the watchdog's own connection, never a
collective (which can hang too), each call bounded by ``BoundedCalls``; each
carries how many collectives its rank issued, as the hang report numbers them.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from ddpkit import _graveyard
from ddpkit._numbers import positive_seconds
from ddpkit.distributed.child import note_exit
from ddpkit.distributed.comm import get_rank, get_world_size, is_dist_initialized
from ddpkit.distributed.deadline import BoundedCalls, DeadlinePassed
from ddpkit.distributed.hang_report import answer, render, write_report
from ddpkit.distributed.heartbeat import Heartbeat, Judge, where
from ddpkit.distributed.job import restore_environ
from ddpkit.distributed.recorder import point_dumps
from ddpkit.distributed.stops import HANG_EXIT_CODE

__all__ = ["HangWatchdog", "format_stacks"]

logger = logging.getLogger("ddpkit")
_monotonic = time.monotonic

# The budget, with T = timeout, I = interval <= 5 s, C = _CALL_S and ticks I + C apart:
# rank 0 decides by T + 2(I + C) = T + 14, the ranks are out by T + 26, rank 0 (which
# waits for them) by T + 28; a rank on its own (T + 2I + 5 silence) is out by T + 27.
_MAX_INTERVAL_S = 5.0
_CALL_S = 2.0  # all store calls of one heartbeat, together
_DUMP_S = 3.0  # logging the stacks may block (a full pipe): the exit comes anyway


def format_stacks() -> str:
    """Return the Python stacks of all threads of this process, main thread first.

    Example:
        >>> logging.getLogger("ddpkit").error("stacks:\\n%s", format_stacks())
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    main = threading.main_thread().ident
    parts = []
    for ident in sorted(frames, key=lambda i: i != main):
        stack = "".join(traceback.format_stack(frames[ident]))
        name = names.get(ident, "<not a threading.Thread>")
        parts.append(f"Thread {name!r} ({ident}), most recent call last:\n{stack}")
    return "\n".join(parts)


class HangWatchdog:
    """Exit the job, naming the rank that stopped, once a rank makes no progress for ``timeout``.

    It arms at the first ``"done"``: a slow first step (compilation, autotune,
    worker start) never trips it. Phases in :data:`UNTIMED_PHASES` (a loader
    starting its workers, train or validation, any epoch) are never timed:
    while any rank is in one (and its heartbeat goes on: a rank stopped there
    holds nobody past ``timeout``), no rank's clock runs, and each rank's
    starts again when it is over. Rank 0 decides by ``timeout + 2 * (interval
    + 2)`` s after the stall; every rank then logs its stacks and calls
    ``os._exit(124)``. A rank that cannot reach the store exits by itself after
    ``timeout`` s without progress, one that hears nothing from rank 0 after
    ``timeout + 2 * interval + 5`` s. Every process is gone within ``timeout +
    30`` s of its own last progress. Without a process group it watches this
    process alone. One watchdog per ``prefix`` at a time; a stopped one never
    ends the process.

    Args:
        timeout: seconds without progress that count as a hang.
        interval: seconds between heartbeats; default ``min(timeout / 4, 5)``,
            at most ``timeout / 2`` and 5.
        prefix: the watchdog's keys in the store.
        store: the store the ranks share; default the default process group's.
        rank: this rank; default the default process group's.
        world_size: the ranks; default the default process group's.
        report_dir: where rank 0 writes ``hang-report.txt`` (and each rank its
            flight-recorder dump) on a hang or a report signal; None: the
            report is logged only.
        report_signal: a signal name (``"SIGUSR2"``); sent to any rank of a
            running job, every rank answers and rank 0 writes the report
            without stopping the job. Installed when started in the main
            thread; None: none.

    Raises:
        ValueError: ``timeout`` or ``interval`` is not a usable number of
            seconds, or ``store`` is given without ``rank`` and ``world_size``
            and there is no process group.

    Example:
        >>> with HangWatchdog(timeout=600.0) as watchdog:
        ...     for step in range(start, steps):
        ...         watchdog.progress(step, "data")
        ...         batch = next(batches)
        ...         watchdog.progress(step, "compute")
        ...         train_step(batch)
        ...         watchdog.progress(step + 1, "done")
    """

    def __init__(
        self,
        timeout: float,
        *,
        interval: float | None = None,
        prefix: str = "ddpkit/watchdog",
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        report_dir: str | os.PathLike[str] | None = None,
        report_signal: str | None = None,
    ) -> None:
        seconds = positive_seconds(timeout)
        if seconds is None:
            raise ValueError(f"timeout must be positive finite seconds, got {timeout!r}")
        most = min(seconds / 2, _MAX_INTERVAL_S)
        every = (
            min(seconds / 4, _MAX_INTERVAL_S) if interval is None else positive_seconds(interval)
        )
        if every is None or every > most:
            raise ValueError(
                f"interval must be positive seconds, at most timeout / 2 and {_MAX_INTERVAL_S:g} "
                f"(here {most:g}), got {interval!r}; leave it out for the default"
            )
        if report_signal is not None and not isinstance(
            getattr(signal, str(report_signal), None), signal.Signals
        ):
            raise ValueError(
                f"report_signal must be a signal name such as 'SIGUSR2', got {report_signal!r}"
            )
        if store is not None and not is_dist_initialized() and None in (rank, world_size):
            raise ValueError("store= needs rank= and world_size= when there is no process group")
        self.timeout, self.interval = seconds, every
        self._prefix = prefix
        # How the process ends on a verdict; a test replaces it before start().
        self._exit: Callable[[int], object] = os._exit
        self._base, self._rank, self._world = store, rank, world_size
        self._heartbeat = Heartbeat(rank or 0)
        self._judge: Judge | None = None  # rank 0's, made by start()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._report_dir = None if report_dir is None else os.fspath(report_dir)
        self._signal = report_signal
        self._started: set[int] = set()  # loaders whose persistent workers run
        self._environ: Any = ()  # what point_dumps set, put back by stop()
        self._asked = threading.Event()  # the report signal arrived here
        self._answered = 0  # the last report request this rank answered
        self._previous_handler: Any = None
        self._backend: str | None = None

    def progress(self, step: int, phase: str) -> None:
        """Record that this rank reached ``phase`` of ``step``; cheap enough for every batch.

        Every place is reported here, in the loop's order: the verdict orders
        the ranks by it. Within one step number the steps come first
        (``"done"``, a step's ``"save"``, ``"data"``, ``"compute"``), then, at
        an epoch's end, ``"epoch_end"``, validation, ``"callbacks"``, the
        epoch's ``"save"`` and ``"trackers"``; the next epoch's ``"data"`` at
        the same step is after them all.

        Args:
            step: the optimizer step, counted over the run.
            phase: ``"data"`` (waiting for the training batch), ``"compute"``,
                ``"done"`` (with the next step: one finished), ``"save"``,
                ``"epoch_end"`` (after an epoch's last step: its totals),
                ``"val_data"`` (waiting for a validation batch), ``"validate"``,
                ``"callbacks"`` (the epoch's report and callbacks), or
                ``"start_data"`` / ``"start_val_data"`` (a loader starting its
                workers), ``"end_data"`` / ``"end_val_data"`` (stopping them)
                and ``"trackers"`` (the run's last records): untimed. Another
                name stays in the part of the loop it is reported in.

        Example:
            >>> watchdog.progress(step + 1, "done")
        """
        self._heartbeat.progress(step, phase)

    def watch(
        self,
        loader: Any,
        batches: Iterable[Any],
        step: Callable[[], int],
        waiting: str = "data",
        busy: str = "compute",
        ended: Callable[[], bool] | None = None,
    ) -> Iterator[Any]:
        """``batches`` (of ``loader``), with :meth:`progress` told when this rank waits for them.

        ``waiting`` before each batch, ``busy`` once it is here, at ``step()``.
        A ``DataLoader`` starts its workers in ``iter()``, and batch ``k`` comes
        from worker ``k``: until one batch came from each worker (each
        imported, ran its ``worker_init_fn``, fetched), the phase is
        ``"start_" + waiting``; after the last batch of workers that are not
        persistent, while the iterator joins them, and once ``ended()`` says
        the epoch is over (a rank reading out the rest of a longer stream, to
        count what it drops), ``"end_" + waiting``. Neither is timed.
        """
        starting = self._starts_workers(loader)
        ending = _ending_workers(loader)
        over = ended or (lambda: False)
        self.progress(step(), f"start_{waiting}" if starting else waiting)
        for count, batch in enumerate(batches, 1):
            self.progress(step(), f"end_{waiting}" if over() else busy)
            yield batch
            end = count == ending or over()
            phase = "start_" if count < starting else "end_" if end else ""
            self.progress(step(), phase + waiting)
        self.progress(step(), busy)  # what follows the last batch is the work

    def _starts_workers(self, loader: Any) -> int:
        """How many workers iterating ``loader`` starts (persistent ones start once)."""
        if not isinstance(loader, DataLoader) or loader.num_workers == 0:
            return 0
        if loader.persistent_workers:
            if id(loader) in self._started:
                return 0
            self._started.add(id(loader))
        return loader.num_workers

    def start(self) -> HangWatchdog:
        """Start the watchdog thread and return the watchdog.

        Raises:
            RuntimeError: it was started before; make a new one.
        """
        if self._thread is not None:
            raise RuntimeError("this HangWatchdog was started before; create a new one")
        if is_dist_initialized():
            if self._base is None:
                self._base = dist.distributed_c10d._get_default_store()
            self._rank = get_rank() if self._rank is None else self._rank
            self._world = get_world_size() if self._world is None else self._world
            self._backend = str(dist.get_backend())
            if self._report_dir is not None and self._backend == "nccl":
                self._environ = point_dumps(self._report_dir)  # NCCL's own dump on a timeout
        if self._signal is not None and threading.current_thread() is threading.main_thread():
            number = getattr(signal, self._signal)
            self._previous_handler = signal.signal(number, lambda *_: self._asked.set())
        self._heartbeat.rank = self._rank or 0
        if is_dist_initialized() and self._world == get_world_size():
            self._heartbeat.collectives = _collective_count()
        if self._base is not None and not self._rank:
            # A rank's heartbeat comes every interval, plus its store calls: past 2.5 of them
            # without one it is stopped, frozen or lost.
            silence = min(self.timeout, 2.5 * self.interval)
            self._judge = Judge(self._world or 1, self.timeout, silence)
        self._thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; safe to call again. Returns within about 2 s."""
        self._stop.set()
        restore_environ(self._environ)
        self._environ = ()
        if self._previous_handler is not None:
            with contextlib.suppress(ValueError):  # not the main thread: leave it
                signal.signal(getattr(signal, str(self._signal)), self._previous_handler)
            self._previous_handler = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=_CALL_S + 0.5)

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            self._watch()
        except Exception:  # say so: a job left unwatched must not look watched
            logger.exception("hang watchdog: rank %s stopped watching after an error", self._rank)

    def _watch(self) -> None:
        calls = None if self._base is None else BoundedCalls(math.inf, "ddpkit-watchdog-store")
        store: Any = None
        lost = ""
        wait = 0.0  # the first heartbeat at once: it replaces an earlier run's
        while not self._stop.wait(wait):
            wait = self.interval
            step, phase, stamp, part = self._heartbeat.last
            if calls is not None and not lost:
                calls.deadline = _monotonic() + _CALL_S
                try:
                    store = calls(self._open) if store is None else store
                    if self._exchange(store, calls, step, phase, stamp, part):
                        return
                except DeadlinePassed:
                    lost = f"no answer in {_CALL_S:g} s"
                except RuntimeError as exc:  # c10d's DistError is one
                    lost = f"{type(exc).__name__}: {(str(exc) or repr(exc)).splitlines()[0]}"
                if lost:
                    logger.warning("hang watchdog: rank %s lost the store (%s)", self._rank, lost)
            # A rank waiting for another that starts its workers: its clock is held too.
            held_at = self._heartbeat.held_at if not lost else -math.inf
            idle = _monotonic() - max(stamp, held_at)
            limit = self.timeout if calls is None or lost else self.timeout + 2 * wait + 5
            if self._heartbeat.timed(phase) and idle > limit:
                self._finish(self._alone(idle, where(step, phase), calls is not None, lost, limit))
                return
        if calls is not None:
            if store is not None and not lost:  # or rank 0 takes this finished rank for hung
                calls.deadline = _monotonic() + _CALL_S
                with contextlib.suppress(DeadlinePassed, RuntimeError):
                    self._heartbeat.sign_off(store, calls)
            calls.close()

    def _alone(self, idle: float, where: str, grouped: bool, lost: str, limit: float) -> str:
        """Why this rank exits by itself: no group, no store, or no word from rank 0."""
        head = f"hang watchdog: no progress for {idle:.1f} s (timeout {self.timeout:g} s) {where}"
        if lost:
            head += f" on rank {self._rank}, which lost the c10d store ({lost}): its host (rank 0 "
            head += (
                "or the agent) is gone or stopped, so no rank can name the one that stopped first"
            )
        elif grouped:
            head += f" on rank {self._rank}, and rank 0 reported no hang within {limit:g} s: it is"
            head += " stuck too, or its watchdog thread cannot run"
        return f"{head}. Logging this rank's stacks; exiting with status {HANG_EXIT_CODE}."

    def _open(self) -> dist.Store:
        assert self._base is not None  # its own connection: the training's calls cannot block it
        return dist.PrefixStore(self._prefix, self._base.clone())

    def _exchange(
        self, store: Any, calls: BoundedCalls, step: int, phase: str, stamp: float, part: int
    ) -> bool:
        """One round: publish the heartbeat; obey the verdict or, on rank 0, judge. True: exited."""
        heartbeat, judge = self._heartbeat, self._judge
        heartbeat.publish(store, calls, step, phase, stamp, part)
        verdict = heartbeat.verdict(store, calls)
        if verdict is not None:
            here = f"rank {self._rank} stops {where(step, phase)}"
            said = verdict.removeprefix("hang watchdog: ")
            self._finish(f"hang watchdog: {here}, on rank 0's verdict: {said}", store, calls)
            return True
        self._follow_requests(store, calls)
        if judge is None:
            heartbeat.follow_holds(store, calls)
            return False
        verdict = judge.judge(store, calls)
        heartbeat.held_at = judge.held_at  # rank 0's own clock is held with the others'
        if verdict is not None:
            judge.post(store, calls, verdict)
            self._finish(verdict, store, calls)
        return verdict is not None

    def _answer(self, stacks: str) -> dict[str, Any]:
        return answer(self._rank or 0, stacks, self._backend, self._report_dir)

    def _read_answers(self, store: Any, calls: BoundedCalls, tag: str) -> dict[int, Any]:
        keys = [f"answer/{tag}/{r}" for r in range(1, self._world or 1)]
        return {
            int(k.rsplit("/", 1)[1]): json.loads(calls(store.get, k))
            for k in keys
            if calls(store.check, [k])
        }

    def _report(self, answers: dict[int, Any], reason: str) -> None:
        """Render the answers, log the summary, write ``hang-report.txt`` when there is a place."""
        answers = {r: answers.get(r) for r in range(self._world or 1)}
        summary, text = render(answers, self._world or 1, reason)
        path = None if self._report_dir is None else write_report(self._report_dir, text)
        where = f"written to {path}" if path is not None else "not written to a file"
        logger.error("hang report (%s):\n%s", where, summary)

    def _follow_requests(self, store: Any, calls: BoundedCalls) -> None:
        """Answer a report request (the report signal on any rank); rank 0 writes the report."""
        if self._asked.is_set():
            self._asked.clear()
            number = int(calls(store.add, "report/n", 1))
            calls(store.set, f"report/why/{number}", f"signal {self._signal} on rank {self._rank}")
        number = int(calls(store.add, "report/n", 0))
        if number <= self._answered:
            return
        self._answered = number
        mine = self._answer(format_stacks())
        rank = self._rank or 0
        if rank != 0:
            calls(store.set, f"answer/{number}/{rank}", json.dumps(mine))
            return
        # Rank 0 waits one heartbeat round for the others (bounded), then writes.
        keys = [f"answer/{number}/{r}" for r in range(1, self._world or 1)]
        calls.deadline = _monotonic() + self.interval + 2 * _CALL_S
        with contextlib.suppress(RuntimeError):  # c10d's timeout: some did not answer
            if keys:
                calls(store.wait, keys, timedelta(seconds=self.interval + _CALL_S))
        why = calls(store.get, f"report/why/{number}").decode()
        answers = {0: mine, **self._read_answers(store, calls, str(number))}
        self._report(answers, f"report asked by {why}; the job goes on")

    def _finish(self, message: str, store: Any = None, calls: BoundedCalls | None = None) -> None:
        """Log ``message`` and the stacks, answer through the store, end the process."""
        if self._stop.is_set():
            return
        rank = self._rank or 0
        # Rank 0 may host the store: it waits for the ranks it heard from to read the
        # verdict. The others wait for each other (each reads the verdict within an
        # interval), so that none exits, breaking its peers' collectives, before every
        # rank has begun its own exit with status 124.
        others = [r for r in range(1, self._world or 1) if r != rank]
        heard = self._judge.heard if self._judge is not None else []
        waits = calls is not None and bool(heard if rank == 0 else others)
        grace = self.interval + 2 * _CALL_S if waits else _CALL_S
        # Logging can block for good (a full pipe, a lock the stuck thread holds): exit anyway.
        backstop = threading.Timer(_DUMP_S + grace, self._exit, (HANG_EXIT_CODE,))
        backstop.name, backstop.daemon = "ddpkit-watchdog-exit", True
        backstop.start()
        # From here the exit status is 124 whatever ends the process first: a peer that
        # exited breaks this rank's collective, and the main thread's error would end it
        # with status 1 while these lines are still being written. The interpreter's exit
        # waits here for the watchdog's own.
        ending = threading.Event()
        hold = functools.partial(_hold_exit, ending, _DUMP_S + grace + 1.0, self._exit)
        atexit.register(hold)
        note_exit(message)  # a launcher from ddpkit (spawn) repeats it
        logger.error("%s", message)
        stacks = format_stacks()
        logger.error("hang watchdog: stacks of rank %d, all threads:\n%s", rank, stacks)
        mine = self._answer(stacks)
        with contextlib.suppress(Exception):  # a second channel, straight to descriptor 2
            faulthandler.dump_traceback(all_threads=True)
        for handler in [*logger.handlers, *logging.getLogger().handlers]:
            with contextlib.suppress(Exception):
                handler.flush()
        if calls is not None:
            calls.deadline = _monotonic() + grace
            with contextlib.suppress(DeadlinePassed, RuntimeError):
                if rank != 0:  # the answer first: rank 0 reads it once it has the ack
                    calls(store.set, f"answer/hang/{rank}", json.dumps(mine))
                    self._heartbeat.acknowledge(store, calls)
                if waits:
                    acks = [f"ack/{r}" for r in (heard if rank == 0 else others)]
                    calls(store.wait, acks, timedelta(seconds=grace))
        if rank == 0:
            answers = {0: mine}
            if calls is not None:
                calls.deadline = _monotonic() + _CALL_S
                with contextlib.suppress(DeadlinePassed, RuntimeError):
                    answers.update(self._read_answers(store, calls, "hang"))
            self._report(answers, message)
        if not self._stop.is_set():
            self._exit(HANG_EXIT_CODE)
        # Reached only where the exit function returns (tests).
        ending.set()
        atexit.unregister(hold)
        backstop.cancel()


def _ending_workers(loader: Any) -> int | None:
    """After which batch a ``DataLoader``'s iterator stops its workers; None: never, or unknown."""
    if not isinstance(loader, DataLoader) or loader.num_workers == 0 or loader.persistent_workers:
        return None
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without a length
        return None


def _collective_count() -> Callable[[], int | None]:
    """How many collectives this process issued on the default group so far; None: unknown.

    The backend's own count (Gloo's and NCCL's: the flight recorder's ``#n`` in the hang
    report), read by the watchdog's thread; a backend that keeps none gives 0 or None.
    """
    read = getattr(dist.group.WORLD, "_get_sequence_number_for_group", None)

    def count() -> int | None:
        try:
            return None if read is None else int(read())
        except Exception:  # a backend without the count: the verdict goes by places alone
            return None

    return count


def _hold_exit(ending: threading.Event, limit: float, exit: Callable[[int], object]) -> None:
    """At interpreter exit during a hang verdict: wait for the watchdog to end the process."""
    if not ending.wait(limit):
        exit(HANG_EXIT_CODE)


def __getattr__(name: str) -> Any:
    return _graveyard.moved_name(__name__, name)
