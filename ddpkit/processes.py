"""Run a function in N fresh processes; raise ``RankFailedError`` for the one that failed first.

Shared by :func:`ddpkit.spawn` and :func:`ddpkit.testing.run_distributed`.
When one rank of a job fails, the others usually fail a moment later with
"connection closed by peer" from inside a collective; reporting whichever
process exited first would often show that echo instead of the real error.
Each child therefore reports its outcome with a timestamp *before* it tears
down its process group, and the parent raises the earliest failure that is not
such an echo, with that rank's traceback.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

__all__ = ["RankFailedError", "die_with_parent", "run_processes"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# How long a terminated child gets to exit before it is killed outright.
_TERMINATE_GRACE_S = 2.0
_POLL_S = 0.05
# How long a rank that exited may take to have its report arrive.
_DEAD_REPORT_GRACE_S = 0.5
# After the first failure, how long to wait for the other ranks' reports so the
# earliest real failure (not a peer's "connection closed") is the one raised;
# longer than _DEAD_REPORT_GRACE_S so a silent death is seen in that window.
_FAILURE_SETTLE_S = 1.5

# (index, ok, pickled value or error message, traceback, time of failure)
_Report = tuple[int, bool, Any, str, float]


class RankFailedError(RuntimeError):
    """A process of the job raised, or died without reporting.

    Attributes:
        rank: the process whose failure came first (the cause; other ranks'
            errors, listed in the message, are usually its consequence).
        remote_traceback: that process's formatted traceback (empty if it died
            without one, for example from a signal).
    """

    def __init__(self, message: str, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def _failure_report(index: int, message: str) -> _Report:
    """Build a failure report; call it inside the ``except`` block it describes."""
    return (index, False, message, traceback.format_exc(), time.time())


def die_with_parent(parent: int) -> None:
    """End this process when its parent ends, even by SIGKILL; call it first thing in a child.

    Linux: the kernel sends SIGKILL on the parent's death (``PR_SET_PDEATHSIG``).
    Elsewhere: a daemon thread checks once a second. Either way a parent that
    is already gone ends this process at once.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # died before the request took effect
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _child_entry(
    target: Callable[..., Any], index: int, args: tuple[Any, ...], results: Any, parent: int
) -> None:
    die_with_parent(parent)  # a parent killed with SIGKILL must not leave its ranks running
    report: _Report
    try:
        value = target(index, *args)
    except BaseException as exc:
        report = _failure_report(index, f"{type(exc).__name__}: {exc}")
    else:
        try:
            # Pickle here, not in the queue's feeder thread, where an error
            # would only be printed and the parent would wait in vain. Plain
            # pickle, not multiprocessing's: that one sends tensors as shared
            # memory handles, which die with this process.
            report = (index, True, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), "", 0.0)
        except Exception as exc:
            report = _failure_report(
                index,
                f"the return value of rank {index} could not be sent to the parent: "
                f"{type(exc).__name__}: {exc}",
            )
    # Report before tearing the group down: the teardown is what makes the
    # other ranks fail, and their reports must not look like the first failure.
    results.put(report)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
) -> list[Any]:
    """Run ``target(index, *args)`` in ``nprocs`` spawned processes; return the results in order.

    Raises ``error`` for the failure that came first (see the module docstring)
    after terminating the other processes, and ``TimeoutError`` naming the
    unfinished ranks when ``timeout`` seconds pass. Messages call process
    ``index`` rank ``first_rank + index`` of ``world_size`` (default ``nprocs``).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [
        # Not daemonic: the children may start DataLoader workers of their own.
        ctx.Process(
            target=_child_entry,
            args=(target, index, tuple(args), results, os.getpid()),
            name=f"{name}{index}",
        )
        for index in range(nprocs)
    ]
    values: dict[int, Any] = {}
    try:
        for p in processes:
            p.start()
        labels = _Labels(first_rank, world_size if world_size is not None else nprocs)
        values = _collect(processes, results, timeout, error, timeout_hint, labels)
    except BaseException:
        _stop(processes, kill=True)
        raise
    else:
        _stop(processes, kill=False)
    finally:
        results.close()
        results.join_thread()
    return [values[i] for i in range(nprocs)]


def _stop(processes: Sequence[BaseProcess], *, kill: bool) -> None:
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
    error: type[RankFailedError],
    timeout_hint: str,
    labels: _Labels,
) -> dict[int, Any]:
    """Wait for every rank's report; raise on the first real failure or at the deadline."""
    world_size = len(processes)
    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
    values: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    dead_since: dict[int, float] = {}
    settle_until: float | None = None  # set by the first failure
    while len(values) + len(failures) < world_size:
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            break
        if now > deadline:
            missing = [labels.first + r for r in range(world_size) if r not in values]
            raise TimeoutError(
                f"{len(missing)} of {world_size} ranks had not finished after {timeout:g} s: "
                f"rank(s) {_ranks(missing)}. They were killed. {timeout_hint}".rstrip()
            )
        try:
            rank, ok, payload, remote_tb, at = results.get(timeout=_POLL_S)
        except queue.Empty:
            for rank, p in enumerate(processes):
                if rank in values or rank in failures or p.exitcode is None:
                    continue
                # A rank that exited may still have its report in the pipe:
                # give it a moment before calling it a silent death.
                first_seen = dead_since.setdefault(rank, time.time())
                if time.time() - first_seen > _DEAD_REPORT_GRACE_S:
                    failures[rank] = _Failure(
                        rank,
                        f"exited with code {p.exitcode} without returning or raising "
                        "(killed by a signal, os._exit, or a crash in native code)",
                        "",
                        first_seen,
                    )
            if failures and settle_until is None:
                settle_until = time.monotonic() + _FAILURE_SETTLE_S
            continue
        if ok:
            values[rank] = pickle.loads(payload)
            continue
        failures[rank] = _Failure(rank, payload, remote_tb, at)
        if settle_until is None:
            settle_until = time.monotonic() + _FAILURE_SETTLE_S
    if failures:
        raise _failure_error(list(failures.values()), labels, error)
    return values


@dataclass(frozen=True)
class _Labels:
    """How messages name process ``index``: rank ``first + index`` of ``world_size``."""

    first: int
    world_size: int


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
    return error(message, rank, cause.remote_traceback)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
