"""ddpkit: PyTorch DistributedDataParallel building blocks.

The public API is the names in ``__all__``: every name of the four parts'
faces (``ddpkit.distributed``, ``ddpkit.data``, ``ddpkit.checkpoint``,
``ddpkit.training``), :class:`Position` and ``__version__``; everything else is
internal. A face lists each of its names once, and this module takes them all
(``ddpkit._lazy``). The names load on first use, so ``import ddpkit`` (and the
``ddpkit`` command) starts without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit import _graveyard
from ddpkit._lazy import lazy_names
from ddpkit._version import __version__ as __version__

_graveyard.install()  # the modules of earlier releases still import, with a warning

if TYPE_CHECKING:  # the public names: every face's, each listed once (ddpkit._lazy)
    from ddpkit.checkpoint import *  # noqa: F403
    from ddpkit.command_line import CommandLine as CommandLine
    from ddpkit.command_line import load_config as load_config
    from ddpkit.data import *  # noqa: F403
    from ddpkit.distributed import *  # noqa: F403
    from ddpkit.position import Position as Position
    from ddpkit.training import *  # noqa: F403

if not TYPE_CHECKING:  # see ddpkit._lazy: mypy must not see an __all__ it cannot read
    __getattr__, __dir__, __all__ = lazy_names(__name__, __file__)
