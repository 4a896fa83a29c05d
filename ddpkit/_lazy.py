"""Public names that load on first use: the ``__getattr__`` of ddpkit's public faces (PEP 562).

``import ddpkit`` and ``import ddpkit.data`` import nothing heavy; a name's
module loads when the name is first read. So ``ddpkit plot`` reads a run's
metrics without importing torch, and ``ddpkit lmdb info`` without the
transforms' torchvision. Each face keeps its ``TYPE_CHECKING`` imports for
type checkers and lists the same names here, by the module that holds them
(``tests/test_public_api.py`` checks the lists agree).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddpkit import _graveyard


def lazy_names(
    package: str, homes: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package``; ``homes`` maps a module to its names.

    A name no module holds falls through to the names earlier releases had
    there (``_graveyard``), and past those is an ``AttributeError``.
    """
    where = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            return _graveyard.moved_name(package, name)
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
