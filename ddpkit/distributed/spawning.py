"""``spawn()``: one process per GPU on this node, the ``--multiprocessing-distributed`` mode.

The same job torchrun would start, from inside a script: ``spawn(main, nnodes=2,
node_rank=0, init_method="tcp://10.0.0.1:23456")`` on the first server and
``node_rank=1`` on the second. A child that fails terminates its siblings,
and the parent raises :class:`ddpkit.RankFailedError` with the traceback of
the rank that failed *first* (not of a sibling that merely lost its peer).

Like torchrun's agent, the parent can restart all children after a failure
(``max_restarts``) and passes the signals it receives on to them: a
preemption ends the job with :class:`ddpkit.distributed.stops.Preempted`, never a restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.process import BaseProcess
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._numbers import as_int
from ddpkit.distributed.devices import resolve_backend
from ddpkit.distributed.job import DistInfo, JobPlan, as_timeout, resolve_job
from ddpkit.distributed.launchers import LaunchEnv, MasterEndpoint, master_endpoint, parse_port
from ddpkit.distributed.process_group import join_job
from ddpkit.distributed.processes import Outcome, RankFailedError, Stop, run_processes
from ddpkit.distributed.stops import (
    HANG_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    HangStopped,
    Preempted,
    SignalStopped,
)

__all__ = ["spawn"]

logger = logging.getLogger("ddpkit")

# A second Ctrl-C this soon after the first is the same key press bouncing.
_SECOND_SIGINT_S = 1.0


@dataclass(frozen=True)
class _Job:
    """What every child of one ``spawn`` call needs: picklable, sent to each child."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    nprocs: int
    nnodes: int
    node_rank: int
    init_method: str
    endpoint: MasterEndpoint
    store_is_external: bool
    backend: str
    rendezvous_timeout: timedelta
    timeout: timedelta
    restart_count: int = 0


def spawn(
    fn: Callable[..., Any],
    nprocs: int | None = None,
    *,
    args: Sequence[Any] = (),
    nnodes: int = 1,
    node_rank: int = 0,
    init_method: str | None = None,
    backend: str = "auto",
    rendezvous_timeout: timedelta = timedelta(seconds=120),
    timeout: timedelta = timedelta(minutes=30),
    max_restarts: int = 0,
) -> list[Any]:
    """Run ``fn(info, *args)`` in ``nprocs`` processes on this node, after ``init_distributed``.

    Global rank = ``node_rank * nprocs + local_rank``; world size =
    ``nnodes * nprocs``. Each process joins the group, calls ``fn`` with its
    :class:`DistInfo`, and leaves the group when ``fn`` returns or raises.
    Each child's environment also holds torchrun's ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, for code that reads them as in a torchrun worker.

    On one node without ``init_method``, this process hosts the rendezvous
    store on a port the operating system assigns and keeps it until the job
    ends, so there is no window in which another program can take the port.

    While the children run, SIGTERM and SIGUSR1 sent to this process are
    forwarded to them, and so is a first SIGINT (the children have process
    groups of their own, so a terminal's Ctrl-C reaches only this process);
    then it waits for them to stop, e.g. with :class:`ddpkit.distributed.stops.Preempted`
    after a checkpoint. A second SIGINT, more than a second later, kills them.

    Args:
        fn: module-level function ``fn(info: DistInfo, *args)``.
        nprocs: processes on this node; default one per visible GPU.
        args: extra arguments for ``fn`` (picklable).
        nnodes: number of nodes, each running this same call.
        node_rank: this node's index, 0 .. nnodes - 1; node 0 hosts rank 0.
        init_method: ``tcp://<node-0 address>:<port>`` (or ``env://``,
            ``file://``); required with several nodes.
        backend: ``"auto"``, ``"nccl"`` or ``"gloo"``.
        rendezvous_timeout: how long the ranks wait for each other to join.
        timeout: collective timeout once the group is up.
        max_restarts: after a child raises or dies, stop all of them and start
            all ``nprocs`` again, with a fresh rendezvous, this many times at
            most (one node only; torchrun restarts several). Attempt ``i`` sees
            ``DistInfo.restart_count == i`` and ``TORCHELASTIC_RESTART_COUNT=i``,
            so ``fn`` should resume from its newest checkpoint.

    Returns:
        What ``fn`` returned in each process of this node, in local-rank order.

    Raises:
        ValueError: bad counts, no GPU and no ``nprocs``, several nodes
            without ``init_method``, or several nodes with ``max_restarts``.
        ddpkit.RankFailedError: a child raised or died (on the last attempt);
            the others were killed. ``.rank`` is the failing global rank and
            the message holds its traceback.
        ddpkit.distributed.stops.Preempted: the children stopped on a signal (a child
            raised it, exited with status 75, or died of a signal forwarded
            to it); uncaught, this process exits with status 75.
        KeyboardInterrupt: a child raised it (after a forwarded Ctrl-C), or a
            second Ctrl-C killed the children.

    Example:
        >>> def main(info: DistInfo, epochs: int) -> None: ...
        >>> spawn(main, args=(90,), nnodes=2, node_rank=0, init_method="tcp://10.0.0.1:23456")
    """
    if not callable(fn):
        raise ValueError(f"spawn needs a function to run, got {fn!r}")
    rendezvous_timeout = as_timeout("rendezvous_timeout", rendezvous_timeout)
    timeout = as_timeout("timeout", timeout)
    resolve_backend(backend, torch.device("cpu"))  # a backend that exists, checked here
    if nprocs is None:
        nprocs = torch.cuda.device_count()
        if nprocs == 0:
            raise ValueError(
                "spawn(nprocs=None) starts one process per GPU, and no GPU is visible: "
                "pass nprocs=N to run N CPU processes with Gloo"
            )
    nprocs = as_int("nprocs", nprocs, 1)
    nnodes = as_int("nnodes", nnodes, 1)
    node_rank = as_int("node_rank", node_rank, 0)
    max_restarts = as_int("max_restarts", max_restarts, 0)
    if node_rank >= nnodes:
        raise ValueError(f"node_rank={node_rank} must be in 0..{nnodes - 1} for nnodes={nnodes}")
    if nnodes > 1 and init_method is None:
        raise ValueError(
            f"spawn(nnodes={nnodes}) needs init_method='tcp://<node-0 address>:<port>', the "
            "same on every node, so the nodes can find each other"
        )
    if nnodes > 1 and max_restarts > 0:
        raise ValueError(
            f"spawn(nnodes={nnodes}, max_restarts={max_restarts}): restarting several nodes "
            "needs a coordinator that restarts them together, which spawn does not have. "
            f"Start each node with torchrun instead: torchrun --nnodes {nnodes} "
            f"--nproc-per-node {nprocs} --max-restarts {max_restarts} --rdzv-backend c10d "
            "--rdzv-endpoint <node0-host>:29400 --rdzv-id <job-id> script.py ..."
        )

    job = _Job(
        fn=fn,
        args=tuple(args),
        nprocs=nprocs,
        nnodes=nnodes,
        node_rank=node_rank,
        init_method=init_method or "env://",
        # env:// is read here, in the parent, and handed to each child.
        endpoint=master_endpoint()
        if (init_method or "").startswith("env:")
        else MasterEndpoint(None, None, ""),
        store_is_external=init_method is None,
        backend=backend,
        rendezvous_timeout=rendezvous_timeout,
        timeout=timeout,
    )
    with _SignalRelay() as relay:
        for restart in range(max_restarts + 1):
            if relay.forwarded():  # a signal came between two attempts: stop
                raise _stop_exception((), relay.forwarded())
            outcome = _attempt(replace(job, restart_count=restart), relay)
            if outcome.values is not None:
                return outcome.values
            failure = outcome.failure
            if failure is None:
                raise _stop_exception(outcome.stops, relay.forwarded())
            if outcome.stops or relay.forwarded() or restart == max_restarts:
                raise _final(failure, restart, max_restarts)
            logger.warning(
                "%s; restarting all %d processes (restart %d of %d)",
                str(failure).splitlines()[0],
                nprocs,
                restart + 1,
                max_restarts,
            )
    raise AssertionError("unreachable: the last attempt returns or raises")


def _attempt(job: _Job, relay: _SignalRelay) -> Outcome:
    """Start all children of ``job`` once, each attempt with a rendezvous of its own."""
    store = None
    if job.store_is_external:
        # Host the store here (port 0: the OS picks a free one) and let every
        # child, rank 0 included, connect to it: torchrun's agent-store mode.
        # A new store per attempt: no key of a failed attempt can confuse the next.
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=job.rendezvous_timeout
        )
        job = replace(job, endpoint=MasterEndpoint("127.0.0.1", str(store.port), "spawn"))
    try:
        _plan(job, 0)  # a bad init method or MASTER_PORT: said once, here, not by every child
        return run_processes(
            _child,
            job.nprocs,
            (job,),
            name="ddpkit-local-rank",
            first_rank=job.node_rank * job.nprocs,
            world_size=job.nnodes * job.nprocs,
            stop_types=(Preempted, KeyboardInterrupt),
            stop_exit_codes=frozenset({PREEMPTED_EXIT_CODE}),
            relay=relay,
            own_process_groups=relay.forwards_sigint,
        )
    finally:
        del store


def _stop_exception(stops: Sequence[Stop], forwarded: Sequence[int]) -> BaseException:
    """What the parent raises when the children stopped and none failed."""
    raised = [s.exception for s in stops if s.exception is not None]
    preempted = [e for e in raised if isinstance(e, Preempted)]
    interrupted = any(isinstance(e, KeyboardInterrupt) for e in raised)
    if interrupted or (not preempted and signal.SIGINT in forwarded):
        return KeyboardInterrupt("spawn: the processes stopped on SIGINT")
    if preempted:  # the rank that saved the checkpoint says where it is
        return next((e for e in preempted if e.checkpoint), preempted[0])
    killed = [-s.exitcode for s in stops if s.exitcode is not None and s.exitcode < 0]
    if killed or forwarded:
        # The signal ended them without a word: they were not in fit (or not listening).
        stopped = SignalStopped((killed or forwarded)[0])
        logger.error("spawn: the processes were %s", stopped)
        return stopped
    return Preempted(f"exit status {PREEMPTED_EXIT_CODE} of rank {stops[0].rank}")


def _final(failure: RankFailedError, restarts: int, max_restarts: int) -> BaseException:
    """What the parent raises for the failure that ends the job: a hang's finding, or it."""
    if failure.exitcode == HANG_EXIT_CODE and failure.note:
        logger.error("spawn: %s", failure.note)  # the status alone would say nothing
        return HangStopped(failure.note)
    return _noted(failure, restarts, max_restarts)


def _noted(failure: RankFailedError, restarts: int, max_restarts: int) -> RankFailedError:
    """``failure``, its message saying how often the job was restarted before it."""
    if max_restarts == 0:
        return failure
    head, _, rest = str(failure).partition("\n")
    note = f"(after {restarts} restart{'s' * (restarts != 1)}, max_restarts={max_restarts})"
    return RankFailedError(
        f"{head}\n{note}\n{rest}".rstrip(),
        failure.rank,
        failure.remote_traceback,
        failure.exitcode,
        failure.note,
        failure.expected_line,
    )


class _SignalRelay:
    """Forward SIGTERM, SIGUSR1 and a first SIGINT to the children; a later SIGINT kills them.

    Handlers are installed (in the main thread only) for the life of the
    ``with`` block, and the previous ones put back after it.
    """

    def __init__(self) -> None:
        self._processes: Sequence[BaseProcess] = ()
        self._forwarded: list[int] = []
        self._first_sigint: float | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalRelay:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, getattr(signal, "SIGUSR1", None), signal.SIGINT):
                # Leave alone a signal ignored on purpose, or handled outside Python.
                if sig is not None and signal.getsignal(sig) not in (signal.SIG_IGN, None):
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def watch(self, processes: Sequence[BaseProcess]) -> None:
        """Forward to ``processes`` from now on, and what came while they started."""
        self._processes = processes
        for signum in self._forwarded:
            self._send(signum)

    @property
    def forwards_sigint(self) -> bool:
        """SIGINT is ours to forward (so the children may leave the terminal's process group)."""
        return signal.SIGINT in self._previous

    def forwarded(self) -> tuple[int, ...]:
        """The signals forwarded so far, each once, first come first."""
        return tuple(dict.fromkeys(self._forwarded))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._first_sigint is not None:
            if time.monotonic() - self._first_sigint > _SECOND_SIGINT_S:
                raise KeyboardInterrupt  # run_processes kills the children on its way out
            return
        if signum == signal.SIGINT:
            self._first_sigint = time.monotonic()
        self._forwarded.append(signum)
        self._send(signum)

    def _send(self, signum: int) -> None:
        for p in self._processes:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)


def _child(local_rank: int, job: _Job) -> Any:
    launch, plan = _plan(job, local_rank)
    # What a torchrun worker sees, for code that reads it; ddpkit itself does not.
    os.environ.update(
        {
            "RANK": str(launch.rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(launch.world_size),
            "LOCAL_WORLD_SIZE": str(job.nprocs),
            "GROUP_RANK": str(job.node_rank),
            "TORCHELASTIC_RESTART_COUNT": str(job.restart_count),
            **({"MASTER_ADDR": plan.master_addr} if plan.master_addr else {}),
            **({"MASTER_PORT": str(plan.master_port)} if plan.master_port else {}),
        }
    )
    info: DistInfo = join_job(
        plan,
        backend=job.backend,
        rendezvous_timeout=job.rendezvous_timeout,
        timeout=job.timeout,
    )
    # The process group is destroyed by run_processes once the outcome is reported.
    return job.fn(info, *job.args)


def _plan(job: _Job, local_rank: int) -> tuple[LaunchEnv, JobPlan]:
    """The launcher's view of the child with ``local_rank``, and its resolved job."""
    port = job.endpoint.port
    launch = LaunchEnv(
        launcher="spawn",
        rank=job.node_rank * job.nprocs + local_rank,
        local_rank=local_rank,
        world_size=job.nnodes * job.nprocs,
        local_world_size=job.nprocs,
        node_rank=job.node_rank,
        master_addr=job.endpoint.addr,
        master_port=parse_port(port, "MASTER_PORT") if port else None,
        store_is_external=job.store_is_external,
        restart_count=job.restart_count,
    )
    plan = resolve_job(job.init_method, launch=launch, endpoint=job.endpoint)
    assert plan is not None  # a launcher is given
    if job.restart_count and not plan.store_is_external:
        # A store the ranks host (a file, or rank 0's port) may outlive an attempt.
        plan = replace(plan, store_prefix=f"{plan.store_prefix}/restart{job.restart_count}")
    return launch, plan
