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

``wrap_ddp(model, comm_hook="bf16" | "fp16" | "powersgd")`` compresses the
gradients a step sends (``compression``: the bytes counted, PowerSGD's state
per rank). Every helper here works with and without a process group (``comm``,
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

if TYPE_CHECKING:  # the public names, each listed once (ddpkit._lazy)
    from ddpkit.distributed.comm import all_gather_object as all_gather_object
    from ddpkit.distributed.comm import all_reduce_sum as all_reduce_sum
    from ddpkit.distributed.comm import barrier as barrier
    from ddpkit.distributed.comm import get_local_rank as get_local_rank
    from ddpkit.distributed.comm import get_rank as get_rank
    from ddpkit.distributed.comm import get_world_size as get_world_size
    from ddpkit.distributed.comm import is_main_process as is_main_process
    from ddpkit.distributed.compression import CommHook as CommHook
    from ddpkit.distributed.compression import comm_hook_of as comm_hook_of
    from ddpkit.distributed.devices import cpu_share as cpu_share
    from ddpkit.distributed.exits import expected_errors as expected_errors
    from ddpkit.distributed.interfaces import NetworkConfigError as NetworkConfigError
    from ddpkit.distributed.job import DistInfo as DistInfo
    from ddpkit.distributed.launchers import launched_by as launched_by
    from ddpkit.distributed.membership import JoinRefused as JoinRefused
    from ddpkit.distributed.network import NetworkPlan as NetworkPlan
    from ddpkit.distributed.network import configure_network as configure_network
    from ddpkit.distributed.network import plan_network as plan_network
    from ddpkit.distributed.parallel import no_sync as no_sync
    from ddpkit.distributed.parallel import unwrap_model as unwrap_model
    from ddpkit.distributed.parallel import wrap_ddp as wrap_ddp
    from ddpkit.distributed.process_group import init_distributed as init_distributed
    from ddpkit.distributed.process_group import shutdown as shutdown
    from ddpkit.distributed.processes import RankFailedError as RankFailedError
    from ddpkit.distributed.rank0 import Rank0Error as Rank0Error
    from ddpkit.distributed.rank0 import rank0_first as rank0_first
    from ddpkit.distributed.rank0 import rank0_only as rank0_only
    from ddpkit.distributed.rendezvous import RendezvousError as RendezvousError
    from ddpkit.distributed.spawning import spawn as spawn
    from ddpkit.distributed.stops import HANG_EXIT_CODE as HANG_EXIT_CODE
    from ddpkit.distributed.stops import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
    from ddpkit.distributed.stops import HangStopped as HangStopped
    from ddpkit.distributed.stops import Preempted as Preempted
    from ddpkit.distributed.stops import SignalStopped as SignalStopped
    from ddpkit.distributed.watchdog import HangWatchdog as HangWatchdog

if not TYPE_CHECKING:  # see ddpkit._lazy: mypy must not see an __all__ it cannot read
    __getattr__, __dir__, __all__ = lazy_names(__name__, __file__)
