"""Job functions that the distributed tests start in other processes.

They live in an importable module (not in a test file) so that spawned
children, torchrun workers and processes in network namespaces can import
them. Each writes what it saw as JSON so the test can check it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import ddpkit


def describe(info: ddpkit.DistInfo) -> dict[str, object]:
    """The info fields, the result of a real all_reduce, and the network variables."""
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "world_size": info.world_size,
        "local_world_size": info.local_world_size,
        "node_rank": info.node_rank,
        "device": str(info.device),
        "backend": info.backend,
        "is_distributed": info.is_distributed,
        "is_main": info.is_main,
        "launcher": info.launcher,
        "init_method": info.init_method,
        "sum": t.item(),
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME"),
    }


def write_description(info: ddpkit.DistInfo, outdir: str) -> None:
    """spawn() target: record this rank's view in ``outdir/rank<N>.json``."""
    Path(outdir, f"rank{info.rank}.json").write_text(json.dumps(describe(info)))


def write_environment(info: ddpkit.DistInfo, outdir: str) -> None:
    """spawn() target: record the launcher variables this child's environment holds."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
    seen: dict[str, object] = {name: os.environ.get(name) for name in names}
    seen["init_method"] = info.init_method
    Path(outdir, f"env{info.rank}.json").write_text(json.dumps(seen))


def sleep_and_record(info: ddpkit.DistInfo, outdir: str) -> None:
    """spawn() target: record this rank's pid, then wait to be killed."""
    Path(outdir, f"rank{info.rank}.pid").write_text(str(os.getpid()))
    time.sleep(300)


def fail_on_rank_one(info: ddpkit.DistInfo) -> None:
    """spawn() target: rank 1 raises while rank 0 waits in a collective."""
    if info.rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()


def spawn_node(node_rank: int, nnodes: int, nprocs: int, init_method: str, outdir: str) -> None:
    """One node of a multi-node job, as a user would start it on each server."""
    ddpkit.spawn(
        write_description,
        nprocs,
        args=(outdir,),
        nnodes=nnodes,
        node_rank=node_rank,
        init_method=init_method,
        rendezvous_timeout=timedelta(seconds=60),
    )


def torchrun_worker(outdir: str) -> None:
    """A script body under torchrun: init_distributed() with no arguments."""
    with ddpkit.init_distributed() as info:
        Path(outdir, f"rank{info.rank}.json").write_text(json.dumps(describe(info)))


def first_batch_seconds(outdir: str, name: str) -> None:
    """Time a plain DataLoader's first batch from 2 workers; record it and the start method."""
    import multiprocessing

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(64.0))
    began = time.perf_counter()
    next(iter(DataLoader(data, batch_size=4, num_workers=2)))
    seconds = time.perf_counter() - began
    seen = {"seconds": seconds, "method": multiprocessing.get_start_method()}
    Path(outdir, f"{name}.json").write_text(json.dumps(seen))


def loader_in_a_rank(info: ddpkit.DistInfo, outdir: str) -> None:
    """spawn() target: :func:`first_batch_seconds` in a rank of ``ddpkit.spawn``."""
    first_batch_seconds(outdir, f"spawned{info.rank}")


if __name__ == "__main__":
    # `python tests/helpers/dist_jobs.py torchrun OUTDIR`
    # or `... node NODE_RANK NNODES NPROCS URL OUTDIR`
    if sys.argv[1] == "torchrun":
        torchrun_worker(sys.argv[2])
    elif sys.argv[1] == "first-batch":  # as a rank torchrun starts: a fresh interpreter
        first_batch_seconds(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "node":
        spawn_node(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        raise SystemExit(f"unknown job {sys.argv[1]!r}")
