"""ddpkit: PyTorch DistributedDataParallel building blocks.

The public API is the names in ``__all__``; everything else is internal.
"""

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

__all__ = [
    "__version__",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_main_process",
]
