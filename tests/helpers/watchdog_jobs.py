"""Training loops that stall, deadlock or lose rank 0, run by tests/distributed/test_watchdog.py.

``python tests/helpers/watchdog_jobs.py SCENARIO RANK WORLD_SIZE PORT TIMEOUT`` runs one
rank of a tiny DDP job with a :class:`~ddpkit.distributed.watchdog.HangWatchdog`. Each rank
logs to its stderr, which the test reads after the process has ended; a hang
ends the process through the watchdog's real ``os._exit``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.distributed.watchdog import HangWatchdog

STALL_STEP = 5
# The healthy run's steps take this long each, well inside the timeout.
STEP_S = 0.1


def read_batch_from_nfs(scenario: str, rank: int, step: int) -> torch.Tensor:
    """The batch for ``step``; the ranks this scenario stalls never return from here."""
    stalls = rank == 1 if scenario == "stall" else scenario.startswith("rank0_") and rank != 0
    if step == STALL_STEP and stalls:
        logging.getLogger("job").info("STALLED at %.3f", time.time())
        if scenario.startswith("rank0_"):  # tell rank 0 to go: this rank is in its stall
            dist.distributed_c10d._get_default_store().set(f"stalled/{rank}", "1")
        while True:  # the filesystem never answers
            time.sleep(3600)
    return torch.randn(8, 4)


def exchange_with_neighbours(rank: int, world: int) -> None:
    """Every rank receives before it sends: a ring in which nobody ever sends."""
    buf = torch.zeros(1)
    dist.recv(buf, src=(rank + 1) % world)
    dist.send(buf, dst=(rank - 1) % world)


def stop_once_the_others_stall(world: int, how: signal.Signals) -> None:
    """Rank 0, which hosts the store, is killed (OOM killer) or stopped (Ctrl-Z) mid-step."""
    store = dist.distributed_c10d._get_default_store()
    store.wait([f"stalled/{r}" for r in range(1, world)])
    os.kill(os.getpid(), how)


def train(scenario: str, rank: int, world: int, timeout: float) -> None:
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = STALL_STEP + 3 if scenario != "healthy" else int(3 * timeout / STEP_S)
    watchdog = HangWatchdog(timeout=timeout).start()
    for step in range(steps):
        watchdog.progress(step, "data")
        batch = read_batch_from_nfs(scenario, rank, step)
        watchdog.progress(step, "compute")
        if scenario == "healthy":  # the first step, longer than the timeout: compilation
            time.sleep(1.5 * timeout if step == 0 else STEP_S)
        if step == STALL_STEP and scenario == "deadlock":
            exchange_with_neighbours(rank, world)
        if step == STALL_STEP and scenario.startswith("rank0_") and rank == 0:
            how = signal.SIGSTOP if scenario == "rank0_stops" else signal.SIGKILL
            stop_once_the_others_stall(world, how)
        model(batch).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        watchdog.progress(step + 1, "done")
    if rank == 0:  # rank 0 saves, longer than the timeout, while the others stopped watching
        for _ in range(int(1.5 * timeout / STEP_S)):
            watchdog.progress(steps, "save")
            time.sleep(STEP_S)
    watchdog.stop()
    dist.barrier()


def stuck_alone(timeout: float) -> None:
    """One process, no group: a step finishes, then the process never moves again."""
    watchdog = HangWatchdog(timeout=timeout).start()
    watchdog.progress(0, "compute")
    watchdog.progress(1, "done")
    watchdog.progress(1, "data")
    logging.getLogger("job").info("STALLED at %.3f", time.time())
    while True:
        time.sleep(3600)


def main() -> None:
    scenario, rank, world, port, timeout = sys.argv[1:6]
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
    )
    if scenario == "alone":
        stuck_alone(float(timeout))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=int(rank),
        world_size=int(world),
        timeout=timedelta(seconds=120),
    )
    train(scenario, int(rank), int(world), float(timeout))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
