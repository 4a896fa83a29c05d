"""Run a function in N fresh processes; raise ``RankFailedError`` for the one that failed first.

Shared by :func:`ddpkit.spawn` and :func:`ddpkit.testing.run_distributed`.
When one rank of a job fails, the others usually fail a moment later with
"connection closed by peer" from inside a collective; reporting whichever
process exited first would often show that echo instead of the real error.
Each child therefore reports its outcome with a timestamp *before* it tears
down its process group, and the parent raises the earliest failure that is not
such an echo, with that rank's traceback.

A process may also *stop* rather than fail (``spawn``: raise ``Preempted``
or ``KeyboardInterrupt``, or die of a signal the parent forwarded). A stopping
rank may be writing a checkpoint, so the others then get :data:`STOP_GRACE_S`,
not the short failure settle; :func:`run_processes` leaves the verdict to the caller.

A process that must end at once (``os._exit``: the hang watchdog) first leaves
the parent its reason (``child.note_exit``); the parent repeats it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Literal, Protocol

from ddpkit.distributed.child import die_with_parent, read_note, write_notes_to
from ddpkit.distributed.comm import destroy_group
from ddpkit.distributed.exits import is_expected

__all__ = [
    "STOP_GRACE_S",
    "Outcome",
    "RankFailedError",
    "Relay",
    "Stop",
    "run_processes",
]

# How long a terminated child gets to exit before it is killed outright.
_TERMINATE_GRACE_S = 2.0
_POLL_S = 0.05
# How long a rank that exited may take to have its report arrive.
_DEAD_REPORT_GRACE_S = 0.5
# After the first failure, how long to wait for the other ranks' reports so the
# earliest real failure (not a peer's "connection closed") is the one raised;
# longer than _DEAD_REPORT_GRACE_S so a silent death is seen in that window.
_FAILURE_SETTLE_S = 1.5
# Once a rank has stopped (or a stop signal was forwarded), how long the others
# get to finish: the rank that writes the checkpoint may still be at it.
STOP_GRACE_S = 120.0
# At a timeout each unfinished child writes its Python stacks to stderr on this
# signal (faulthandler), and gets this long to do so before it is killed.
_STACKS_SIGNAL = signal.SIGUSR2
_STACKS_S = 1.0

# (index, "ok" | "error" | "stop", pickled value / (message, expected line) / pickled exception,
#  traceback, time)
_Report = tuple[int, Literal["ok", "error", "stop"], Any, str, float]


class RankFailedError(RuntimeError):
    """A process of the job raised, or died without reporting.

    Attributes:
        rank: the process whose failure came first (the cause; other ranks'
            errors, listed in the message, are usually its consequence).
        remote_traceback: that process's formatted traceback (empty if it died
            without one, for example from a signal).
        exitcode: that process's exit status when it exited without a report, else None.
        note: what that process said (``child.note_exit``) before such an exit, else "".
        expected_line: the one line :func:`ddpkit.expected_errors` shows for that
            process's error, judged in the process itself (``exits.is_expected``), else None.
    """

    def __init__(
        self,
        message: str,
        rank: int,
        remote_traceback: str = "",
        exitcode: int | None = None,
        note: str = "",
        expected_line: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exitcode, self.note, self.expected_line = exitcode, note, expected_line


@dataclass(frozen=True)
class Stop:
    """A process that stopped rather than failed: global ``rank``, and how."""

    rank: int
    exception: BaseException | None  # the stop exception it raised; None: it sent no report
    exitcode: int | None = None  # without a report: a stop code, or -signal forwarded to it


@dataclass(frozen=True)
class Outcome:
    """How one run of the processes ended; see :func:`run_processes`."""

    values: list[Any] | None  # what each process returned, if every one did
    failure: RankFailedError | None  # the first real failure (peers lost next to a stop are none)
    stops: tuple[Stop, ...] = ()  # in the order they came


class Relay(Protocol):
    """What forwards the parent's signals to the processes of a run (``ddpkit.spawn``'s)."""

    def watch(self, processes: Sequence[BaseProcess]) -> None:
        """Forward signals to ``processes`` from now on."""

    def forwarded(self) -> Collection[int]:
        """The signals forwarded so far."""


def _failure_report(index: int, message: str, expected: str | None = None) -> _Report:
    """Build a failure report; call it inside the ``except`` block it describes."""
    return (index, "error", (message, expected), traceback.format_exc(), time.time())


StartMethod = Literal["spawn", "forkserver"]

# What a forkserver imports once, so that each process forked from it starts in a
# fraction of a second instead of importing torch and torchvision (seconds) on its own:
# torch's libraries and this module, where every process starts. The module a run's
# function lives in (ddpkit.testing's, say) comes from above: run_processes adds it.
# This layer names no other part (tests/test_architecture.py).
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torchvision", __name__)


def start_forkserver(ctx: Any, preload: Sequence[str] = FORKSERVER_PRELOAD) -> None:
    """Start ``ctx``'s forkserver with ``preload`` imported, and wait for it.

    The forkserver is one per process and keeps the modules it started with
    (an earlier user may have started it with others; a module that is not
    installed is left out). The first call waits for
    one process forked from it, so that a run's timeout does not count the
    server's imports.
    """
    global _forkserver_ready
    with _forkserver_lock:  # runs may start from several threads at once
        if _forkserver_ready:
            return
        ctx.set_forkserver_preload(list(preload))
        probe = ctx.Process(target=_nothing, name="ddpkit-forkserver-probe", daemon=True)
        probe.start()
        probe.join()
        _forkserver_ready = True


_forkserver_ready = False
_forkserver_lock = threading.Lock()


def _preload(target: Callable[..., Any]) -> tuple[str, ...]:
    """:data:`FORKSERVER_PRELOAD` and the module of ``target``, which each process imports."""
    module = getattr(target, "__module__", None)
    # A script's own __main__ is not preloaded: it is imported in each child, as under spawn.
    if not module or module == "__main__" or module in FORKSERVER_PRELOAD:
        return FORKSERVER_PRELOAD
    return (*FORKSERVER_PRELOAD, module)


def _nothing() -> None:
    pass


class _Stdio:
    """The starting process's descriptors 1 and 2 of the moment, for a forked child to take.

    A spawned child inherits them at its start; one forked by a forkserver would
    write to whatever the server inherited when it started (under pytest, the
    capture file of an earlier test). Pickled only while a process starts, when
    multiprocessing passes the descriptors along.
    """

    def __init__(self, fds: tuple[Any, ...] = ()) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[type[_Stdio], tuple[tuple[Any, ...]]]:
        return _Stdio, (tuple(mp.reduction.DupFd(fd) for fd in (1, 2)),)

    def take(self) -> None:
        for target, dup in zip((1, 2), self.fds, strict=True):
            fd = dup.detach()
            os.dup2(fd, target)
            os.close(fd)


def _child_entry(
    target: Callable[..., Any],
    index: int,
    args: tuple[Any, ...],
    results: Any,
    parent: int,
    stop_types: tuple[type[BaseException], ...],
    sigmask: set[signal.Signals] | None,
    notes: str,
    stdio: _Stdio | None = None,
    start_method: str | None = None,
) -> None:
    if stdio is not None:
        stdio.take()
    if parent:  # a spawned child: as a fresh interpreter under torchrun would start its own
        # A spawned child takes 'spawn' as its default start method; a rank started by
        # torchrun has the parent's choice, else Python's default (fork on Linux before
        # 3.14), so its DataLoader workers start in milliseconds, not seconds each.
        mp.set_start_method(start_method, force=True)
    write_notes_to(notes, index)
    if sigmask is not None:
        # A group of its own: a terminal's Ctrl-C reaches only the parent, which
        # forwards it. SIGINT was blocked from the fork until here (see _start).
        os.setpgid(0, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, sigmask)
    # A parent killed with SIGKILL must not leave its ranks running. Forked by a
    # forkserver (parent 0), this process's parent is that server, which ends
    # with the process that started it.
    die_with_parent(parent or os.getppid())
    with contextlib.suppress(AttributeError, RuntimeError, ValueError):
        faulthandler.register(_STACKS_SIGNAL, all_threads=True)  # see _collect's timeout
    report: _Report
    try:
        value = target(index, *args)
    except stop_types as exc:
        try:
            report = (index, "stop", pickle.dumps(exc), traceback.format_exc(), time.time())
        except Exception:
            report = _failure_report(index, f"{type(exc).__name__}: {exc}")
    except BaseException as exc:
        report = _failure_report(index, f"{type(exc).__name__}: {exc}", is_expected(exc))
    else:
        try:
            # Pickle here, not in the queue's feeder thread, where an error
            # would only be printed and the parent would wait in vain. Plain
            # pickle, not multiprocessing's: that one sends tensors as shared
            # memory handles, which die with this process.
            report = (index, "ok", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), "", 0.0)
        except Exception as exc:
            report = _failure_report(
                index,
                f"the return value of rank {index} could not be sent to the parent: "
                f"{type(exc).__name__}: {exc}",
            )
    # A DataLoader iterator that only a reference cycle holds (an exception's
    # traceback, say) is freed by the collector alone, and this process ends by
    # os._exit, which runs none: workers from a forkserver, and the server, would
    # wait for each other for ever. Collected here, its workers are shut down;
    # only while children run, as a collection costs a fifth of a second.
    if mp.active_children():
        gc.collect()
    # Report before tearing the group down: the teardown is what makes the
    # other ranks fail, and their reports must not look like the first failure.
    results.put(report)
    destroy_group()


def run_processes(
    target: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: float | None = None,
    name: str = "ddpkit-rank",
    error: type[RankFailedError] = RankFailedError,
    timeout_hint: str = "",
    first_rank: int = 0,
    world_size: int | None = None,
    stop_types: tuple[type[BaseException], ...] = (),
    stop_exit_codes: frozenset[int] = frozenset(),
    relay: Relay | None = None,
    own_process_groups: bool = False,
    start_method: StartMethod = "spawn",
) -> Outcome:
    """Run ``target(index, *args)`` in ``nprocs`` fresh processes; return how they ended.

    The :class:`Outcome` holds every result in order, or the failure that came
    first (see the module docstring; raise it), or the stops: a process that
    raises one of ``stop_types``, exits with one of ``stop_exit_codes``
    without a report, or dies of a signal ``relay`` forwarded. Unfinished
    processes are killed before this returns. Raises ``TimeoutError`` naming
    the unfinished ranks when ``timeout`` seconds pass. Messages call process
    ``index`` rank ``first_rank + index`` of ``world_size`` (default
    ``nprocs``). With ``own_process_groups`` each leaves the parent's process
    group first thing: a terminal's Ctrl-C reaches only the parent.
    ``start_method`` ``"forkserver"`` forks each process from a server that
    imported :data:`FORKSERVER_PRELOAD` and ``target``'s module once
    (:func:`start_forkserver`; the first run of the process starts it).
    """
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    if start_method == "forkserver" and own_process_groups:
        raise ValueError("own_process_groups needs start_method='spawn'")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        start_forkserver(ctx, _preload(target))
    results = ctx.Queue()
    notes = tempfile.mkdtemp(prefix="ddpkit-exit-notes-")
    processes: list[BaseProcess] = []
    outcome = None
    try:
        processes = _start(
            ctx, target, nprocs, args, results, name, stop_types, own_process_groups, notes
        )
        if relay is not None:
            relay.watch(processes)
        labels = _Labels(first_rank, world_size if world_size is not None else nprocs, notes)
        outcome = _collect(
            processes, results, timeout, timeout_hint, labels, stop_exit_codes, relay, error
        )
    finally:
        # Everything but a full set of results (an error here included) kills the rest.
        _stop(processes, kill=outcome is None or outcome.values is None)
        results.close()
        results.join_thread()
        shutil.rmtree(notes, ignore_errors=True)
    return outcome


def _start(
    ctx: Any,
    target: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any],
    results: Any,
    name: str,
    stop_types: tuple[type[BaseException], ...],
    own_process_groups: bool,
    notes: str,
) -> list[BaseProcess]:
    blocking = own_process_groups and hasattr(signal, "pthread_sigmask")
    # Until a child has left our process group, a Ctrl-C at the terminal would hit
    # it half-way through its imports: children inherit a mask that blocks SIGINT.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if blocking else None
    processes: list[BaseProcess] = []
    spawned = ctx.get_start_method() == "spawn"
    parent, stdio = (os.getpid(), None) if spawned else (0, _Stdio())  # 0: whoever forked it
    try:
        for index in range(nprocs):
            # Not daemonic: the children may start DataLoader workers of their own.
            p = ctx.Process(
                target=_child_entry,
                args=(
                    target,
                    index,
                    tuple(args),
                    results,
                    parent,
                    stop_types,
                    mask,
                    notes,
                    stdio,
                    mp.get_start_method(allow_none=True),  # this process's own
                ),
                name=f"{name}{index}",
            )
            processes.append(p)
            p.start()
    except BaseException:
        _stop(processes, kill=True)
        raise
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return processes


def _stop(processes: Sequence[BaseProcess], *, kill: bool) -> None:
    processes = [p for p in processes if p.pid is not None]  # started ones
    for p in processes:
        if p.is_alive():
            p.kill() if kill else p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


@dataclass(frozen=True)
class _Failure:
    rank: int
    message: str
    remote_traceback: str
    at: float  # wall-clock time of the failure, comparable across processes
    exitcode: int | None = None  # exited without a report: its status ...
    note: str = ""  # ... and what it said before (note_exit)
    expected_line: str | None = None  # what the rank judged its error (exits.is_expected)

    @property
    def is_consequence(self) -> bool:
        """True for errors that only say a peer went away (the effect, not the cause)."""
        text = self.message.lower()
        return any(marker in text for marker in _PEER_LOST_MARKERS)


# How Gloo and c10d word "another rank disappeared"; such errors are what the
# surviving ranks see after the rank that really failed tore its group down.
_PEER_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "gloo/transport",
    "socket closed",
    "ncclremoteerror",
    "remote process exited",
    "communicator was aborted",
)


def _collect(
    processes: Sequence[BaseProcess],
    results: Any,
    timeout: float | None,
    timeout_hint: str,
    labels: _Labels,
    stop_exit_codes: frozenset[int],
    relay: Relay | None,
    error: type[RankFailedError],
) -> Outcome:
    """Wait for every rank's report, or the settle (grace) after the first that did not return."""
    world_size = len(processes)
    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
    values: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    stops: dict[int, Stop] = {}
    dead_since: dict[int, float] = {}
    first_end: float | None = None  # when the first rank ended without returning
    while len(values) + len(failures) + len(stops) < world_size:
        now = time.monotonic()
        forwarded = relay.forwarded() if relay is not None else ()
        grace = STOP_GRACE_S if stops or forwarded else _FAILURE_SETTLE_S
        if first_end is not None and now >= first_end + grace:
            break
        if now > deadline:
            left = [r for r in range(world_size) if r not in values]
            for r in left:  # where each one is stuck, on stderr, before it is killed
                with contextlib.suppress(OSError, TypeError):
                    os.kill(processes[r].pid, _STACKS_SIGNAL)  # type: ignore[arg-type]
            time.sleep(_STACKS_S)
            missing = [labels.first + r for r in left]
            raise TimeoutError(
                f"{len(missing)} of {world_size} ranks had not finished after {timeout:g} s: "
                f"rank(s) {_ranks(missing)}. Their Python stacks are on stderr; they were "
                f"killed. {timeout_hint}".rstrip()
            )
        try:
            rank, kind, payload, remote_tb, at = results.get(timeout=_POLL_S)
        except queue.Empty:
            for rank, p in enumerate(processes):
                code = p.exitcode
                if rank in values or rank in failures or rank in stops or code is None:
                    continue
                # A rank that exited may still have its report in the pipe:
                # give it a moment before calling it a silent death.
                first_seen = dead_since.setdefault(rank, time.time())
                if time.time() - first_seen <= _DEAD_REPORT_GRACE_S:
                    continue
                if code in stop_exit_codes or -code in forwarded:
                    stops[rank] = Stop(labels.first + rank, None, code)
                    continue
                note = read_note(labels.notes, rank)
                why = note or (
                    "without returning or raising "
                    "(killed by a signal, os._exit, or a crash in native code)"
                )
                message = f"exited with code {code}{':' if note else ''} {why}"
                failures[rank] = _Failure(rank, message, "", first_seen, code, note)
            if (failures or stops) and first_end is None:
                first_end = time.monotonic()
            continue
        if kind == "ok":
            values[rank] = pickle.loads(payload)
            continue
        if kind == "stop":
            stops[rank] = Stop(labels.first + rank, pickle.loads(payload))
        else:
            failures[rank] = _Failure(rank, payload[0], remote_tb, at, expected_line=payload[1])
        if first_end is None:
            first_end = time.monotonic()
    if len(values) == world_size:
        return Outcome([values[i] for i in range(world_size)], None)
    # Next to a rank that stopped, "a peer went away" is no failure of its own.
    real = [f for f in failures.values() if not (stops and f.is_consequence)]
    failure = _failure_error(list(failures.values()), labels, error) if real else None
    return Outcome(None, failure, tuple(stops.values()))


@dataclass(frozen=True)
class _Labels:
    """How messages name process ``index``: rank ``first + index`` of ``world_size``."""

    first: int
    world_size: int
    notes: str = ""  # the directory of the processes' exit notes


def _failure_error(
    failures: Sequence[_Failure], labels: _Labels, error: type[RankFailedError]
) -> RankFailedError:
    # The cause is the earliest failure that is not just "a peer went away".
    ordered = sorted(failures, key=lambda f: (f.is_consequence, f.at))
    cause, others = ordered[0], ordered[1:]
    rank = labels.first + cause.rank
    message = f"rank {rank} of {labels.world_size} failed: {cause.message}"
    if others:
        also = "; ".join(
            f"rank {labels.first + f.rank}: {f.message.splitlines()[0][:200]}" for f in others
        )
        message += f"\n(then also failed: {also})"
    if cause.remote_traceback:
        message += f"\n\n--- traceback from rank {rank} ---\n{cause.remote_traceback}"
    return error(
        message, rank, cause.remote_traceback, cause.exitcode, cause.note, cause.expected_line
    )


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
