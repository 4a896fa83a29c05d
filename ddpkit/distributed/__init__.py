"""The distributed runtime: where a process sits, how it joins the job, and how a job stops.

Start one process per GPU with a launcher (``torchrun``, SLURM's ``srun``,
``mpirun``) or with :func:`spawn`, then call :func:`init_distributed` in each:
it reads the launcher's variables once (``launchers``), resolves the job
(``job.resolve_job`` -> :class:`DistInfo`), plans the network (``network``),
meets the other ranks through a bounded c10d store (``rendezvous``) and
creates the process group (``process_group``)::

    from ddpkit.distributed import init_distributed, wrap_ddp, is_main_process

    with init_distributed() as info:           # torchrun, SLURM, Open MPI or one process
        model = wrap_ddp(build_model(), sync_bn=True)
        ...

Every helper here works with and without a process group (``comm``,
``rank0``), so one script runs as one process or many. A job stops together:
``stops`` agrees on the step after which every rank stops on a signal
(:class:`Preempted`, exit status 75), and ``watchdog`` names a rank that
stopped making progress (exit status 124). ``doctor`` shows the same network
plan ``init_distributed`` applies.

This package imports nothing of ``ddpkit.checkpoint`` or ``ddpkit.training``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_names

if TYPE_CHECKING:
    from ddpkit.distributed.comm import (
        all_gather_object,
        all_reduce_sum,
        barrier,
        get_local_rank,
        get_rank,
        get_world_size,
        is_main_process,
    )
    from ddpkit.distributed.job import DistInfo
    from ddpkit.distributed.network import (
        NetworkConfigError,
        NetworkPlan,
        configure_network,
        plan_network,
    )
    from ddpkit.distributed.parallel import no_sync, unwrap_model, wrap_ddp
    from ddpkit.distributed.process_group import init_distributed, shutdown
    from ddpkit.distributed.processes import RankFailedError
    from ddpkit.distributed.rank0 import Rank0Error, rank0_first, rank0_only
    from ddpkit.distributed.rendezvous import RendezvousError
    from ddpkit.distributed.spawning import spawn
    from ddpkit.distributed.stops import (
        HANG_EXIT_CODE,
        PREEMPTED_EXIT_CODE,
        HangStopped,
        Preempted,
        SignalStopped,
    )
    from ddpkit.distributed.watchdog import HangWatchdog

__all__ = [
    "HANG_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "DistInfo",
    "HangStopped",
    "HangWatchdog",
    "NetworkConfigError",
    "NetworkPlan",
    "Preempted",
    "Rank0Error",
    "RankFailedError",
    "RendezvousError",
    "SignalStopped",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "configure_network",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "no_sync",
    "plan_network",
    "rank0_first",
    "rank0_only",
    "shutdown",
    "spawn",
    "unwrap_model",
    "wrap_ddp",
]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "ddpkit.distributed.comm": (
            "all_gather_object",
            "all_reduce_sum",
            "barrier",
            "get_local_rank",
            "get_rank",
            "get_world_size",
            "is_main_process",
        ),
        "ddpkit.distributed.job": ("DistInfo",),
        "ddpkit.distributed.network": (
            "NetworkConfigError",
            "NetworkPlan",
            "configure_network",
            "plan_network",
        ),
        "ddpkit.distributed.parallel": ("no_sync", "unwrap_model", "wrap_ddp"),
        "ddpkit.distributed.process_group": ("init_distributed", "shutdown"),
        "ddpkit.distributed.processes": ("RankFailedError",),
        "ddpkit.distributed.rank0": ("Rank0Error", "rank0_first", "rank0_only"),
        "ddpkit.distributed.rendezvous": ("RendezvousError",),
        "ddpkit.distributed.spawning": ("spawn",),
        "ddpkit.distributed.stops": (
            "HANG_EXIT_CODE",
            "PREEMPTED_EXIT_CODE",
            "HangStopped",
            "Preempted",
            "SignalStopped",
        ),
        "ddpkit.distributed.watchdog": ("HangWatchdog",),
    },
)
