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
is a fresh ``spawn`` process, as it would be under torchrun. A suite that
starts many runs can have each rank forked from a server that imported torch
once (``start_method="forkserver"``, or ``DDPKIT_TEST_START_METHOD=forkserver``
in the environment): a run then starts in a fraction of a second instead of
the seconds each rank spends importing torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

from ddpkit._numbers import as_int, positive_seconds
from ddpkit.distributed.processes import RankFailedError, run_processes

__all__ = ["DistributedTestError", "run_distributed"]


class DistributedTestError(RankFailedError):
    """A rank of :func:`run_distributed` raised, or died without reporting.

    Attributes:
        rank: the rank whose failure came first (the others' errors, listed
            in the message, are usually its consequence).
        remote_traceback: that rank's formatted traceback (empty if it died
            without one, for example from a signal).
    """


@dataclass(frozen=True)
class _Rendezvous:
    """How a child joins the group: a file path, or the parent's TCP store."""

    kind: Literal["file", "tcp", "none"]
    file_path: str = ""
    host: str = ""
    port: int = 0


def _init_group(rendezvous: _Rendezvous, rank: int, world_size: int, timeout_s: float) -> None:
    timeout = timedelta(seconds=timeout_s)
    if rendezvous.kind == "none":
        return
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
    # Creating a Gloo group is not a synchronisation point: a rank whose function
    # makes no collective could return and close its connections while a peer is
    # still completing its own, which that peer reports as "Connection closed by
    # peer" (pytorch/pytorch#61396). One barrier: every rank is connected first.
    if world_size > 1:
        dist.barrier()


def _child_main(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    rendezvous: _Rendezvous,
    timeout_s: float,
    env: dict[str, str],
    environ: dict[str, str],
) -> Any:
    # The caller's environment as it was at the call, as a spawned process would
    # have it (a forkserver's children inherit the server's, from its start).
    os.environ.clear()
    os.environ.update(environ)
    if rendezvous.kind != "none":
        # As a launcher, the variables torchrun would set, so code under test that
        # reads them (ddpkit.get_local_rank, for one) sees a consistent picture.
        # Without a group the code under test starts its own job, so they stay unset.
        os.environ.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
            }
        )
    os.environ.update(env)
    _init_group(rendezvous, rank, world_size, timeout_s)
    return fn(rank, world_size, *args)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    init: Literal["file", "tcp"] | None = "file",
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    start_method: Literal["spawn", "forkserver"] | None = None,
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
        init: ``"file"`` or ``"tcp"`` rendezvous; None starts the processes
            without a process group, for testing code that creates its own
            (``ddpkit.init_distributed`` and friends).
        timeout: seconds for the whole run, and the process group's collective
            timeout. Past it every rank is killed.
        env: environment variables set in each rank before the process group
            is created.
        start_method: ``"spawn"``: each rank a fresh interpreter, as under
            torchrun. ``"forkserver"``: each rank forked from a server that
            imported torch once (``ddpkit.distributed.processes.FORKSERVER_PRELOAD``),
            with this process's environment of the moment; much faster to start.
            None: ``DDPKIT_TEST_START_METHOD`` from the environment, else ``"spawn"``.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        DistributedTestError: a rank raised (its message and traceback are in
            the error) or died without reporting; the other ranks are terminated.
        TimeoutError: ``timeout`` passed; the message names the ranks that had
            not finished.
        ValueError: ``world_size``, ``init``, ``timeout`` or ``start_method``
            is invalid.
    """
    world_size = as_int("world_size", world_size, 1)
    if init not in ("file", "tcp", None):
        raise ValueError(f"init must be 'file', 'tcp' or None, got {init!r}")
    seconds = positive_seconds(timeout)
    if seconds is None:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    timeout = seconds
    if start_method is None:
        start_method = os.environ.get("DDPKIT_TEST_START_METHOD") or "spawn"  # type: ignore[assignment]
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(
            f"start_method (or DDPKIT_TEST_START_METHOD) must be 'spawn' or 'forkserver', "
            f"got {start_method!r}"
        )

    tmpdir = tempfile.mkdtemp(prefix="ddpkit-test-")
    store: dist.TCPStore | None = None
    if init is None:
        rendezvous = _Rendezvous("none")
    elif init == "file":
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

    try:
        outcome = run_processes(
            _child_main,
            world_size,
            (fn, world_size, tuple(args), rendezvous, timeout, dict(env or {}), dict(os.environ)),
            timeout=timeout,
            start_method=start_method,
            error=DistributedTestError,
            timeout_hint="Look for a rank that skips a collective or waits forever, "
            "or raise timeout= if the work is just slow.",
        )
    finally:
        del store
        shutil.rmtree(tmpdir, ignore_errors=True)
    if outcome.failure is not None:
        raise outcome.failure
    assert outcome.values is not None  # without stop types, processes return or fail
    return outcome.values
