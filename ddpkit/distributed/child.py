"""A rank started by ``processes``: it dies with its parent, and leaves it a note on ``os._exit``.

The hang watchdog ends a rank with ``os._exit(124)``: no exception, no report
through ``processes``' queue. Before that it calls :func:`note_exit`; a parent
that started the process with ``ddpkit.distributed.processes`` (``spawn``,
``run_distributed``) reads the note with :func:`read_note` and repeats it,
instead of "exited without returning".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent", "note_exit", "read_note", "write_notes_to"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# In a process that a parent of ddpkit.distributed.processes started: where its note goes.
_path: str | None = None


def write_notes_to(directory: str, index: int) -> None:
    """In the child with ``index``: send later :func:`note_exit` calls to ``directory``."""
    global _path
    _path = os.path.join(directory, str(index))


def note_exit(message: str) -> None:
    """Leave ``message`` for the parent as the reason this process is about to ``os._exit``.

    Does nothing in a process no ddpkit parent started. Never raises.
    """
    path = _path
    if path is None:
        return
    with contextlib.suppress(OSError):
        with open(f"{path}.tmp", "w", encoding="utf-8") as file:
            file.write(message)
        os.replace(f"{path}.tmp", path)  # the parent reads all of it or nothing


def read_note(directory: str, index: int) -> str:
    """The note child ``index`` left in ``directory``; "" if none."""
    path = os.path.join(directory, str(index))
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as file:
        return file.read().strip()
    return ""


def die_with_parent(parent: int) -> None:
    """End this process when its parent ends, even by SIGKILL; call it first thing in a child.

    Linux: the kernel sends SIGKILL on the parent's death (``PR_SET_PDEATHSIG``).
    Elsewhere: a daemon thread checks once a second. Either way a parent that
    is already gone ends this process at once.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # died before the request took effect
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
