"""Jobs whose ranks disagree, stop or die mid-run, run by tests/distributed/test_hang_report.py.

``python tests/helpers/hang_jobs.py SCENARIO RANK WORLD_SIZE PORT TIMEOUT REPORT_DIR`` runs
one rank of a tiny loop of collectives under a :class:`~ddpkit.distributed.watchdog.HangWatchdog`
that writes its report into REPORT_DIR. Each rank logs to its stderr.

``desync``: rank 2 sends itself the report signal (SIGUSR2) at step 1, and the job goes
on; at step ``BAD_STEP`` rank 1 broadcasts while the others all-reduce.
``stop_kill``: at step ``BAD_STEP`` rank 1 stops itself (SIGSTOP) and rank 2 is killed
(SIGKILL) while the others go on into their all-reduce.
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

from ddpkit.distributed.recorder import enable_recorder
from ddpkit.distributed.watchdog import HangWatchdog

BAD_STEP = 4
# Each step this long: every rank publishes a heartbeat of a finished step (every 0.5 s)
# before BAD_STEP; a rank stopped before its first one reads as starting, never timed.
STEP_S = 0.3


def sum_gradients(grads: torch.Tensor) -> None:
    dist.all_reduce(grads)  # every rank: the step's collective


def share_rank_1_state(state: torch.Tensor) -> None:
    dist.broadcast(state, src=1)  # only rank 1 gets here: the desync


def main() -> None:
    scenario, rank_s, world_s, port, timeout, report_dir = sys.argv[1:7]
    rank, world = int(rank_s), int(world_s)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
    )
    # The GPU battery runs the desync over NCCL, one GPU per rank (DDPKIT_HANG_BACKEND=nccl).
    backend = os.environ.get("DDPKIT_HANG_BACKEND", "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    enable_recorder(backend)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    watchdog = HangWatchdog(
        timeout=float(timeout), report_dir=report_dir, report_signal="SIGUSR2"
    ).start()
    for step in range(BAD_STEP + 2):
        watchdog.progress(step, "compute")
        time.sleep(STEP_S)
        if step == 1 and scenario == "desync" and rank == 2:
            os.kill(os.getpid(), signal.SIGUSR2)  # a user asks how the job is doing
        if step == BAD_STEP and scenario == "desync" and rank == 1:
            share_rank_1_state(torch.zeros(7, device=device))
        elif step == BAD_STEP and scenario == "stop_kill" and rank in (1, 2):
            os.kill(os.getpid(), signal.SIGSTOP if rank == 1 else signal.SIGKILL)
        else:
            sum_gradients(torch.ones(3, device=device))
        watchdog.progress(step + 1, "done")
    watchdog.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
