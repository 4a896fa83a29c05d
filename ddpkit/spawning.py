"""``spawn()``: one process per GPU on this node, the ``--multiprocessing-distributed`` mode.

The same job torchrun would start, from inside a script: ``spawn(main, nnodes=2,
node_rank=0, init_method="tcp://10.0.0.1:23456")`` on the first server and
``node_rank=1`` on the second. A child that fails terminates its siblings,
and the parent raises :class:`ddpkit.RankFailedError` with the traceback of
the rank that failed *first* (not of a sibling that merely lost its peer).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.devices import resolve_backend
from ddpkit.dist import join_job
from ddpkit.job import DistInfo, JobPlan, as_timeout, check_count, resolve_job
from ddpkit.launchers import LaunchEnv, MasterEndpoint, master_endpoint, parse_port
from ddpkit.processes import run_processes

__all__ = ["spawn"]


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

    Returns:
        What ``fn`` returned in each process of this node, in local-rank order.

    Raises:
        ValueError: bad counts, no GPU and no ``nprocs``, or several nodes
            without ``init_method``.
        ddpkit.RankFailedError: a child raised or died; the others were
            terminated. ``.rank`` is the failing global rank and the message
            holds its traceback.

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
    check_count("nprocs", nprocs, 1)
    check_count("nnodes", nnodes, 1)
    check_count("node_rank", node_rank, 0)
    if node_rank >= nnodes:
        raise ValueError(f"node_rank={node_rank} must be in 0..{nnodes - 1} for nnodes={nnodes}")
    if nnodes > 1 and init_method is None:
        raise ValueError(
            f"spawn(nnodes={nnodes}) needs init_method='tcp://<node-0 address>:<port>', the "
            "same on every node, so the nodes can find each other"
        )

    store = None
    if init_method is None:
        # Host the store here (port 0: the OS picks a free one) and let every
        # child, rank 0 included, connect to it: torchrun's agent-store mode.
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=rendezvous_timeout
        )
        endpoint = MasterEndpoint("127.0.0.1", str(store.port), "spawn")
    elif init_method.startswith("env:"):
        endpoint = master_endpoint()  # read here, in the parent, and handed to each child
    else:
        endpoint = MasterEndpoint(None, None, "")
    job = _Job(
        fn=fn,
        args=tuple(args),
        nprocs=nprocs,
        nnodes=nnodes,
        node_rank=node_rank,
        init_method=init_method or "env://",
        endpoint=endpoint,
        store_is_external=store is not None,
        backend=backend,
        rendezvous_timeout=rendezvous_timeout,
        timeout=timeout,
    )
    try:
        _plan(job, 0)  # a bad init method or MASTER_PORT: said once, here, not by every child
        return run_processes(
            _child,
            nprocs,
            (job,),
            name="ddpkit-local-rank",
            first_rank=node_rank * nprocs,
            world_size=nnodes * nprocs,
        )
    finally:
        del store


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
    )
    plan = resolve_job(job.init_method, launch=launch, endpoint=job.endpoint)
    assert plan is not None  # a launcher is given
    return launch, plan
