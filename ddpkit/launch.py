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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._procs import run_processes
from ddpkit.dist import DistInfo, init_distributed

__all__ = ["spawn"]


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
    if nprocs is None:
        nprocs = torch.cuda.device_count()
        if nprocs == 0:
            raise ValueError(
                "spawn(nprocs=None) starts one process per GPU, and no GPU is visible: "
                "pass nprocs=N to run N CPU processes with Gloo"
            )
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank} must be in 0..{nnodes - 1} for nnodes={nnodes}")
    if nnodes > 1 and init_method is None:
        raise ValueError(
            f"spawn(nnodes={nnodes}) needs init_method='tcp://<node-0 address>:<port>', the "
            "same on every node, so the nodes can find each other"
        )

    env: dict[str, str] = {
        "DDPKIT_LAUNCHER": "spawn",
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": str(node_rank),
    }
    store = None
    if init_method is None:
        # Host the store here (port 0: the OS picks a free one) and let every
        # child, rank 0 included, connect to it: torchrun's agent-store mode.
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=rendezvous_timeout
        )
        env.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
        )
        init_method = "env://"
    try:
        child_args = (fn, tuple(args), nprocs, nnodes * nprocs, node_rank, init_method, backend)
        return run_processes(
            _child,
            nprocs,
            (*child_args, rendezvous_timeout, timeout, env),
            name="ddpkit-local-rank",
            first_rank=node_rank * nprocs,
            world_size=nnodes * nprocs,
        )
    finally:
        del store


def _child(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    world_size: int,
    node_rank: int,
    init_method: str,
    backend: str,
    rendezvous_timeout: timedelta,
    timeout: timedelta,
    env: dict[str, str],
) -> Any:
    os.environ.update(env)
    rank = node_rank * nprocs + local_rank
    # Stated the way torchrun states them, so the child reads like a torchrun worker.
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)}
    )
    info: DistInfo = init_distributed(
        init_method,
        backend,
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        rendezvous_timeout=rendezvous_timeout,
        timeout=timeout,
    )
    # The process group is destroyed by run_processes once the outcome is reported.
    return fn(info, *args)
