"""Run a function on N real Gloo processes on the CPU, with a hard timeout.

This is how ddpkit tests itself, and it is public so that you can test your own
DDP code the same way in CI, without GPUs::

    from ddpkit.testing import run_distributed

    def _sum_of_ranks(rank: int, world_size: int) -> int:
        import torch, torch.distributed as dist
        t = torch.tensor([rank])
        dist.all_reduce(t)
        return int(t)

    def test_all_reduce() -> None:
        assert run_distributed(_sum_of_ranks, 3) == [3, 3, 3]

The function must be importable (defined at module level), because each rank
is a fresh ``spawn`` process, as it would be under torchrun.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal

import torch.distributed as dist

__all__ = ["DistributedTestError", "run_distributed"]

# How long a terminated child gets to exit before it is killed outright.
_TERMINATE_GRACE_S = 2.0
_POLL_S = 0.05
# How long a rank that exited may take to have its report arrive.
_DEAD_REPORT_GRACE_S = 0.5
# After the first failure, how long to wait for the other ranks' reports so the
# earliest real failure (not a peer's "connection closed") is the one raised;
# longer than _DEAD_REPORT_GRACE_S so a silent death is seen in that window.
_FAILURE_SETTLE_S = 1.5

# (rank, ok, pickled value or error message, traceback, time of failure)
_Report = tuple[int, bool, Any, str, float]


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` raised, or died without reporting.

    Attributes:
        rank: the first rank that failed.
        remote_traceback: that rank's formatted traceback (empty if it died
            without one, for example from a signal).
    """

    def __init__(self, message: str, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class _Rendezvous:
    """How a child joins the group: a file path, or the parent's TCP store."""

    kind: Literal["file", "tcp"]
    file_path: str = ""
    host: str = ""
    port: int = 0


def _init_group(rendezvous: _Rendezvous, rank: int, world_size: int, timeout_s: float) -> None:
    timeout = timedelta(seconds=timeout_s)
    if rendezvous.kind == "file":
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous.file_path}",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    else:
        store = dist.TCPStore(rendezvous.host, rendezvous.port, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )


def _failure_report(rank: int, message: str) -> _Report:
    """Build a failure report; call it inside the ``except`` block it describes."""
    return (rank, False, message, traceback.format_exc(), time.time())


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    rendezvous: _Rendezvous,
    timeout_s: float,
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(env)
    # The launcher variables torchrun would set, so code under test that reads
    # them (ddpkit.get_local_rank, for one) sees a consistent picture.
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    report: _Report
    try:
        _init_group(rendezvous, rank, world_size, timeout_s)
        value = fn(rank, world_size, *args)
    except BaseException as exc:
        report = _failure_report(rank, f"{type(exc).__name__}: {exc}")
    else:
        try:
            # Pickle here, not in the queue's feeder thread, where an error
            # would only be printed and the parent would wait in vain.
            report = (rank, True, bytes(ForkingPickler.dumps(value)), "", 0.0)
        except Exception as exc:
            report = _failure_report(
                rank,
                f"the return value of rank {rank} could not be sent to the parent: "
                f"{type(exc).__name__}: {exc}",
            )
    # Report before tearing the group down: the teardown is what makes the
    # other ranks fail, and their reports must not look like the first failure.
    results.put(report)
    if dist.is_initialized():
        dist.destroy_process_group()


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


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    init: Literal["file", "tcp"] = "file",
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo processes and collect results.

    Each rank is a fresh ``spawn`` process with a Gloo process group already
    initialised on the CPU (and destroyed after ``fn`` returns). Concurrent
    calls never collide: ``init="file"`` rendezvous through a file in a new
    temporary directory, and ``init="tcp"`` through a TCP store that this
    process hosts on a port the OS assigned, held for the whole run.

    Args:
        fn: a module-level (picklable) function ``fn(rank, world_size, *args)``.
        world_size: number of processes, at least 1.
        args: extra positional arguments for ``fn``; must be picklable.
        init: ``"file"`` or ``"tcp"`` rendezvous.
        timeout: seconds for the whole run, and the process group's collective
            timeout. Past it every rank is killed.
        env: environment variables set in each rank before the process group
            is created.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        DistributedTestError: a rank raised (its message and traceback are in
            the error) or died without reporting; the other ranks are terminated.
        TimeoutError: ``timeout`` passed; the message names the ranks that had
            not finished.
        ValueError: ``world_size``, ``init`` or ``timeout`` is invalid.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if init not in ("file", "tcp"):
        raise ValueError(f"init must be 'file' or 'tcp', got {init!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="ddpkit-test-")
    store: dist.TCPStore | None = None
    if init == "file":
        rendezvous = _Rendezvous("file", file_path=os.path.join(tmpdir, "rendezvous"))
    else:
        # Port 0: the OS picks a free port and this store keeps it bound until
        # the run ends, so no other test can take it in between.
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
        rendezvous = _Rendezvous("tcp", host="127.0.0.1", port=store.port)

    child_env = dict(env or {})
    processes = [
        ctx.Process(
            target=_child_main,
            args=(fn, rank, world_size, tuple(args), rendezvous, timeout, child_env, results),
            name=f"ddpkit-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    try:
        for p in processes:
            p.start()
        values = _collect(processes, results, timeout)
    except BaseException:
        _stop(processes, kill=True)
        raise
    else:
        _stop(processes, kill=False)
    finally:
        results.close()
        results.join_thread()
        if store is not None:
            del store
        shutil.rmtree(tmpdir, ignore_errors=True)
    return [values[r] for r in range(world_size)]


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
)


def _collect(processes: Sequence[BaseProcess], results: Any, timeout: float) -> dict[int, Any]:
    """Wait for every rank's report; raise on the first real failure or at the deadline."""
    world_size = len(processes)
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    dead_since: dict[int, float] = {}
    settle_until: float | None = None  # set by the first failure
    while len(values) + len(failures) < world_size:
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            break
        if now > deadline:
            missing = [r for r in range(world_size) if r not in values]
            raise TimeoutError(
                f"run_distributed: {len(missing)} of {world_size} ranks had not "
                f"finished after {timeout:g} s: rank(s) {_ranks(missing)}. "
                "They were killed. Look for a rank that skips a collective "
                "or waits forever, or raise timeout= if the work is just slow."
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
        raise _failure_error(list(failures.values()), world_size)
    return values


def _failure_error(failures: Sequence[_Failure], world_size: int) -> DistributedTestError:
    # The cause is the earliest failure that is not just "a peer went away".
    ordered = sorted(failures, key=lambda f: (f.is_consequence, f.at))
    cause, others = ordered[0], ordered[1:]
    message = f"rank {cause.rank} of {world_size} failed: {cause.message}"
    if others:
        also = "; ".join(f"rank {f.rank}: {f.message.splitlines()[0][:200]}" for f in others)
        message += f"\n(then also failed: {also})"
    if cause.remote_traceback:
        message += f"\n\n--- traceback from rank {cause.rank} ---\n{cause.remote_traceback}"
    return DistributedTestError(message, cause.rank, cause.remote_traceback)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
