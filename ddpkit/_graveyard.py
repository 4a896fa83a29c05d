"""Every public path that moved or was removed since ddpkit 0.1.0, still served, with a warning.

One warning class (:class:`DdpkitDeprecationWarning`, a ``DeprecationWarning``)
and one helper (:func:`deprecated`) for every deprecation in ddpkit. A moved
module (``ddpkit.dist``, ``ddpkit.train`` ...) still imports: an import hook
installed by ``import ddpkit`` serves it as a stand-in that warns once, when
it is imported, and hands out the names of its new home. A moved name
(``ddpkit.LaunchEnv``, ``ddpkit.checkpoint.rank0_only`` ...) warns on each
look-up and returns the object from its new place. Nothing here imports torch
until a stand-in's name is looked up.

The old paths will be removed in ddpkit 0.3; CHANGELOG.md lists each one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MOVED_MODULES",
    "MOVED_NAMES",
    "DdpkitDeprecationWarning",
    "deprecated",
    "install",
    "moved_name",
]

REMOVED_IN = "0.3"


class DdpkitDeprecationWarning(DeprecationWarning):
    """A ddpkit name, path or argument that still works but will be removed in ddpkit 0.3."""


def deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` (a name, path or argument) is deprecated in favour of ``new``.

    ``stacklevel`` counts from the caller of this function, as for ``warnings.warn``
    called there (the default points at the caller's caller: the user's line).
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in ddpkit {REMOVED_IN}; use {new}",
        DdpkitDeprecationWarning,
        stacklevel=stacklevel,
    )


# Former module -> where its names live now (looked up in order).
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    # 0.1.0's modules that no longer exist
    "ddpkit._procs": ("ddpkit.distributed.processes",),
    "ddpkit.launch": ("ddpkit.distributed.spawning",),
    # the flat modules of 0.1.0 and later, now in four packages
    "ddpkit.child": ("ddpkit.distributed.child",),
    "ddpkit.comm": ("ddpkit.distributed.comm",),
    "ddpkit.control": ("ddpkit.distributed.stops",),
    "ddpkit.deadline": ("ddpkit.distributed.deadline",),
    "ddpkit.devices": ("ddpkit.distributed.devices",),
    "ddpkit.dist": ("ddpkit.distributed.process_group", "ddpkit.distributed"),
    "ddpkit.doctor": ("ddpkit.distributed.doctor",),
    "ddpkit.interfaces": ("ddpkit.distributed.interfaces",),
    "ddpkit.job": ("ddpkit.distributed.job",),
    "ddpkit.launchers": ("ddpkit.distributed.launchers",),
    "ddpkit.network": ("ddpkit.distributed.network",),
    "ddpkit.parallel": ("ddpkit.distributed.parallel",),
    "ddpkit.ports": ("ddpkit.distributed.ports",),
    "ddpkit.processes": ("ddpkit.distributed.processes",),
    "ddpkit.rank0": ("ddpkit.distributed.rank0",),
    "ddpkit.rendezvous": ("ddpkit.distributed.rendezvous",),
    "ddpkit.spawning": ("ddpkit.distributed.spawning",),
    "ddpkit.watchdog": ("ddpkit.distributed.watchdog",),
    "ddpkit.checkpoint_files": ("ddpkit.checkpoint.files",),
    "ddpkit.checkpoint_sync": (
        "ddpkit.checkpoint.sync",
        "ddpkit.checkpoint.restore",
        "ddpkit.checkpoint.outcomes",
        "ddpkit.checkpoint.state",
    ),
    "ddpkit.serialization": ("ddpkit.checkpoint.serialization",),
    "ddpkit.snapshot": ("ddpkit.checkpoint.background",),
    "ddpkit.transfer": ("ddpkit.checkpoint.transfer",),
    "ddpkit.ema": ("ddpkit.training.ema",),
    "ddpkit.evaluation": ("ddpkit.training.evaluation",),
    "ddpkit.losses": ("ddpkit.training.losses",),
    "ddpkit.metrics": ("ddpkit.training.metrics",),
    "ddpkit.models": ("ddpkit.training.models",),
    "ddpkit.plotting": ("ddpkit.training.plotting",),
    "ddpkit.reporting": ("ddpkit.training.reporting",),
    "ddpkit.schedules": ("ddpkit.training.schedules",),
    "ddpkit.steps": ("ddpkit.training.epoch",),
    "ddpkit.train": ("ddpkit.training.loop", "ddpkit.training"),
}

# (module, former name) -> (module, name): names that moved out of a module that remains.
MOVED_NAMES: dict[tuple[str, str], tuple[str, str]] = {
    ("ddpkit", "LaunchEnv"): ("ddpkit.distributed.launchers", "LaunchEnv"),
    ("ddpkit", "detect_launcher"): ("ddpkit.distributed.launchers", "detect_launcher"),
    ("ddpkit", "RankZeroError"): ("ddpkit.distributed.rank0", "Rank0Error"),
    ("ddpkit", "rank_zero_first"): ("ddpkit.distributed.rank0", "rank0_first"),
    ("ddpkit.checkpoint", "rank0_only"): ("ddpkit.distributed.rank0", "rank0_only"),
    ("ddpkit.checkpoint", "RankZeroError"): ("ddpkit.distributed.rank0", "Rank0Error"),
    ("ddpkit.checkpoint", "rank_zero_first"): ("ddpkit.distributed.rank0", "rank0_first"),
    ("ddpkit.checkpoint", "capture_rng_state"): ("ddpkit.rng", "capture_rng_state"),
    ("ddpkit.checkpoint", "restore_rng_state"): ("ddpkit.rng", "restore_rng_state"),
    ("ddpkit.data.lmdb_build", "verify_lmdb"): ("ddpkit.data.lmdb_inspect", "verify_lmdb"),
    ("ddpkit.data.lmdb_build", "describe_lmdb"): ("ddpkit.data.lmdb_inspect", "describe_lmdb"),
    ("ddpkit.data.loaders", "DistributedEvalSampler"): (
        "ddpkit.data.samplers",
        "DistributedEvalSampler",
    ),
    ("ddpkit.data.loaders", "set_epoch"): ("ddpkit.data.samplers", "set_epoch"),
    # Listed by the module that re-exported them until each __all__ named only its own.
    **{
        ("ddpkit.data.lmdb_format", name): ("ddpkit.data.lmdb_index", name)
        for name in ("FORMAT_NAME", "FORMAT_VERSION", "encode_index", "sample_key")
    },
    ("ddpkit.distributed.network", "ifname_selects"): (
        "ddpkit.distributed.interfaces",
        "ifname_selects",
    ),
    ("ddpkit.distributed.watchdog", "UNTIMED_PHASES"): (
        "ddpkit.distributed.heartbeat",
        "UNTIMED_PHASES",
    ),
    ("ddpkit.training.config", "SaveCadence"): ("ddpkit.checkpoint.cadence", "SaveCadence"),
}


def moved_name(module: str, name: str) -> Any:
    """The object a former ``module.name`` now is, with a warning; AttributeError if none.

    Called by the ``__getattr__`` of each module that lost a name.
    """
    target = MOVED_NAMES.get((module, name))
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module, new_name = target
    # 4: past this function and the module __getattr__ that called it, at the user's line
    deprecated(f"{module}.{name}", _public_path(new_module, new_name), stacklevel=4)
    return getattr(importlib.import_module(new_module), new_name)


def _public_path(module: str, name: str) -> str:
    """Where to import ``name`` from: the top level when it is public there."""
    top = sys.modules.get("ddpkit")
    if top is not None and name in getattr(top, "__all__", ()):
        return f"ddpkit.{name}"
    return f"{module}.{name}"


class _StandIn(types.ModuleType):
    """A former module: its names come from the modules that hold them now."""

    __homes__: Sequence[str]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for home in self.__homes__:
            module = importlib.import_module(home)
            if hasattr(module, name):
                value = getattr(module, name)
                setattr(self, name, value)  # later look-ups skip this method
                return value
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for home in self.__homes__:
            names.update(dir(importlib.import_module(home)))
        return sorted(names)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the former modules of :data:`MOVED_MODULES` and makes their stand-ins."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__homes__ = MOVED_MODULES[spec.name]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # warnings skips importlib's own frames: the warning points at the import line.
        deprecated(f"module {module.__name__}", f"module {MOVED_MODULES[module.__name__][0]}")


_FINDER = _Finder()


def install() -> None:
    """Serve the former modules from now on in this process (``import ddpkit`` calls it)."""
    if _FINDER not in sys.meta_path:
        # First: no other finder (an editable install's map, say) may answer for these names.
        sys.meta_path.insert(0, _FINDER)
