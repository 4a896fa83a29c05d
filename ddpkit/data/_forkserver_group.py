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
still ends when the training process does (multiprocessing's liveness pipe).
Python has no option to start the server in a new session, so a preload
module, the one hook that runs inside it, does it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from multiprocessing import forkserver
from typing import Any

__all__ = ["keep_forkserver_apart"]


def _imported_by_forkserver() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (the server)."""
    server = forkserver.main.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is server:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _starts_by_forkserver(context: Any) -> bool:
    """Whether a DataLoader given ``context`` starts its workers through the forkserver."""
    if context is None:
        name = multiprocessing.get_start_method(allow_none=True)
        if name is None:
            # Python's default, not chosen yet: read it without fixing it, as
            # get_start_method() would (a later set_start_method would then fail).
            default = getattr(multiprocessing.context._default_context, "_default_context", None)
            name = getattr(default, "_name", None)
        return name in (None, "forkserver")
    if isinstance(context, str):
        return context == "forkserver"
    return bool(context.get_start_method() == "forkserver")


def keep_forkserver_apart(context: Any) -> None:
    """Have the next forkserver this process starts move to a process group of its own.

    Does nothing unless ``context`` (a DataLoader's ``multiprocessing_context``)
    starts workers through the forkserver. Modules already in the preload list
    stay; a server already running keeps the group it started in.
    """
    if not _starts_by_forkserver(context):
        return
    modules = list(getattr(forkserver._forkserver, "_preload_modules", ()))  # no public getter
    if __name__ not in modules:
        forkserver.set_forkserver_preload([*modules, __name__])


if _imported_by_forkserver():
    with contextlib.suppress(OSError):  # already a group leader (a session's first process)
        os.setpgid(0, 0)
