"""ddpkit: PyTorch DistributedDataParallel building blocks.

The public API is the names in ``__all__``; everything else is internal.
"""

from ddpkit._procs import RankFailedError
from ddpkit._version import __version__
from ddpkit.comm import (
    all_gather_object,
    all_reduce_sum,
    barrier,
    get_local_rank,
    get_rank,
    get_world_size,
    is_main_process,
)
from ddpkit.dist import DistInfo, RendezvousError, init_distributed, shutdown
from ddpkit.launch import spawn
from ddpkit.launchers import LaunchEnv, detect_launcher
from ddpkit.network import NetworkConfigError, configure_network

__all__ = [
    "DistInfo",
    "LaunchEnv",
    "NetworkConfigError",
    "RankFailedError",
    "RendezvousError",
    "__version__",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "configure_network",
    "detect_launcher",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "shutdown",
    "spawn",
]
