"""PyTorch's flight recorder of collectives: on by default, read back for a hang report.

torch keeps, per process, a ring buffer of the last collectives each process
group issued (sequence number, name, sizes, the Python stack that issued it)
when ``TORCH_FR_BUFFER_SIZE`` is above 0. In torch 2.14 it records Gloo as
well as NCCL collectives. :func:`enable_recorder` turns it on (before the
process group is made: torch reads the variable once) unless the user set the
variables; for NCCL it also turns on the dump on a collective timeout and the
asynchronous error handling that ends a rank whose collective timed out.
:func:`local_history` reads this process's buffer back, in the plain form the
hang report (``ddpkit.distributed.hang_report``) exchanges between ranks.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

__all__ = [
    "BUFFER_SIZE",
    "NCCL_SETTINGS",
    "dump_prefix",
    "enable_recorder",
    "local_history",
    "point_dumps",
    "recorder_state",
]

BUFFER_SIZE = 200
"""Collectives kept per process: a DDP step issues a few (one per gradient
bucket), so this covers the last steps at a few kB of memory."""

# For NCCL: dump the buffer of every rank when a collective times out, and end
# the rank (without the clean-up that can hang) instead of letting it wait for ever.
NCCL_SETTINGS = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
_DUMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def enable_recorder(
    backend: str, environ: MutableMapping[str, str] | None = None
) -> tuple[tuple[str, str | None], ...]:
    """Turn the flight recorder on for ``backend``, leaving alone what the user set.

    Call it before the process group is created. Returns ``(name, value
    before)`` of each variable set, for :func:`ddpkit.distributed.job.restore_environ`.
    """
    env = os.environ if environ is None else environ
    wanted: dict[str, str] = {}
    if not any(name in env for name in _BUFFER_VARS):
        wanted["TORCH_FR_BUFFER_SIZE"] = str(BUFFER_SIZE)
    if backend == "nccl":
        wanted.update({k: v for k, v in NCCL_SETTINGS.items() if k not in env})
    before = tuple((name, env.get(name)) for name in wanted)
    env.update(wanted)
    return before


def dump_prefix(directory: str | os.PathLike[str]) -> str:
    """Where each rank's dump of the recorder goes in ``directory``: the prefix, rank appended.

    The same names NCCL's dump on timeout uses, which PyTorch's analyzer reads:
    ``python -m torch.distributed.flight_recorder.fr_trace DIR/flight-recorder -p rank_``.
    """
    return str(Path(directory) / "flight-recorder" / "rank_")


def point_dumps(
    directory: str | os.PathLike[str], environ: MutableMapping[str, str] | None = None
) -> tuple[tuple[str, str | None], ...]:
    """Send NCCL's dumps on timeout into ``directory``, unless the user named a place.

    NCCL reads the variable at its first dump, so this works after the process
    group is up. Returns ``(name, value before)`` of what it set.
    """
    env = os.environ if environ is None else environ
    if _DUMP_FILE in env:
        return ()
    before = ((_DUMP_FILE, None),)
    prefix = dump_prefix(directory)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    env[_DUMP_FILE] = prefix
    return before


def recorder_state(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the recorder will do in a job started with ``environ``, in words, per subject.

    Keys: ``"buffer"``, ``"nccl dump on timeout"``, ``"nccl error handling"``.
    """
    env = os.environ if environ is None else environ
    size = next((env[name] for name in _BUFFER_VARS if name in env), None)
    buffer = (
        f"{size} collectives per process (set by the user)"
        if size not in (None, "0")
        else "off (TORCH_FR_BUFFER_SIZE=0 set by the user)"
        if size == "0"
        else f"{BUFFER_SIZE} collectives per process (init_distributed's default)"
    )
    dump = env.get("TORCH_NCCL_DUMP_ON_TIMEOUT")
    handling = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    where = env.get(_DUMP_FILE)
    into = f"into {where}<rank>" if where else "beside the checkpoints (fit with a watchdog)"
    return {
        "buffer": buffer,
        "nccl dump on timeout": (
            f"on, {into}" if dump in (None, "1", "true") else f"off ({dump!r})"
        )
        + ("" if dump is not None else " (init_distributed's default)"),
        "nccl error handling": (
            "a timed-out collective ends its rank"
            if handling in (None, "1", "3")
            else f"TORCH_NCCL_ASYNC_ERROR_HANDLING={handling}: a timed-out rank may wait for ever"
        ),
    }


def local_history(backend: str | None = None, frames: bool = False) -> dict[str, Any] | None:
    """This process's flight-recorder buffer as torch dumps it (a dict), or None when empty/off.

    Safe from any thread without ``frames``; with them (each entry's stack), call
    it from the main thread only.

    ``backend="nccl"`` reads NCCL's recorder, any other the one Gloo uses.
    """
    from torch._C import _distributed_c10d as c10d

    name = "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace"
    dump = getattr(c10d, name, None)
    if dump is None:  # a torch without the recorder
        return None
    try:
        # Our own process's buffer, pickled by torch: plain dicts, lists and numbers. Without
        # its stack traces: symbolizing them from a thread other than the main one blocks
        # for good in torch 2.14 (the hang report reads the main thread's stack instead).
        raw = dump(includeCollectives=True, includeStackTraces=frames, onlyActive=False)
        trace: dict[str, Any] = pickle.loads(raw)
    except (RuntimeError, pickle.UnpicklingError):
        return None
    return trace if trace.get("entries") else None
