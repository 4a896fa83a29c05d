"""The DataLoader workers' forkserver in a process group of its own.

torchrun stops a worker with ``killpg(SIGTERM)``; a container runtime and
``kill -- -PGID`` signal a whole group too. The training process catches the
signal and stops after the next step, and needs its data workers until then.
The workers move to a group of their own as they start
(``loaders._worker_start``), but a forkserver (``multiprocessing_context=
"forkserver"``, Python's default on Linux from 3.14) is the training
process's child in its group: the signal killed it, torch's workers saw their
parent gone and exited, and the next batch failed with "DataLoader worker
exited unexpectedly" (or a FileNotFoundError from the batch's shared memory).

:func:`keep_forkserver_apart` names this module in the forkserver's preload
list; imported there, it moves the server into a group of its own, and the
workers it forks are born outside the training process's group. The server
ends when the training process does: on Linux at once, even after a SIGKILL
(a parent-death signal); elsewhere by multiprocessing's liveness pipe, once
its children have ended.
Python has no option to start the server in a new session, so a preload
module, the one hook that runs inside it, does it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
from multiprocessing import forkserver
from typing import Any

from ddpkit.distributed.child import die_with_parent

__all__ = ["keep_forkserver_apart"]

_lock = threading.Lock()


def _imported_by_forkserver() -> bool:
    """Whether this is the server's own preload of this module.

    True inside ``multiprocessing.forkserver.main`` with this module in its
    preload list; False in a process the server forked (its stack still holds
    ``main``, under ``_serve_one``) and in any other process.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == forkserver.__name__:
            if frame.f_code.co_name == "_serve_one":
                return False
            if frame.f_code is forkserver.main.__code__:
                return __name__ in (frame.f_locals.get("preload") or ())
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _start_method(context: Any) -> str | None:
    """How a DataLoader given ``context`` starts its workers; None: not known."""
    if isinstance(context, str):
        return context
    if context is not None and not isinstance(context, multiprocessing.context.DefaultContext):
        return str(context.get_start_method())
    default = multiprocessing.context._default_context if context is None else context
    name = default.get_start_method(allow_none=True)
    if name is None:
        # Python's default, not chosen yet: read it without fixing it, as
        # get_start_method() would (a later set_start_method would then fail).
        name = getattr(getattr(default, "_default_context", None), "_name", None)
    return name


def keep_forkserver_apart(context: Any) -> None:
    """Have the next forkserver this process starts move to a process group of its own.

    Does nothing unless ``context`` (a DataLoader's ``multiprocessing_context``)
    starts workers through the forkserver. The module goes first in the
    preload list, so the server leaves the group before it imports the others
    (torch: seconds); the modules already there stay. A server already running
    keeps its group; a later ``set_forkserver_preload`` replaces the list.
    """
    if _start_method(context) not in (None, "forkserver"):
        return
    with _lock:
        modules = list(getattr(forkserver._forkserver, "_preload_modules", ()))  # no getter
        if __name__ not in modules:
            forkserver.set_forkserver_preload([__name__, *modules])


if _imported_by_forkserver():
    with contextlib.suppress(OSError):  # already a group leader (a session's first process)
        os.setpgid(0, 0)
    # Out of the group, no group kill reaches the server any more: end it with the
    # process that started it, even by SIGKILL, or the children of a plain DataLoader
    # (which watch only the server) would keep each other alive for ever. Linux's
    # parent-death signal starts no thread (this process forks); it fires when the
    # starting thread ends, which for a DataLoader is the one that iterates it.
    if sys.platform.startswith("linux"):
        die_with_parent(os.getppid())
