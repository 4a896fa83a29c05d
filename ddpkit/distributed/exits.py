"""How a script ends on a mistake: one line saying what to do, a status, no traceback.

:func:`expected_errors` wraps a script's ``main``: an error ddpkit raised on
purpose (its own error classes, and the ``ValueError``, ``TypeError``,
``OSError`` and ``RuntimeError`` it raises from its own code with what to
do), a missing file, and the same raised in a rank of :func:`ddpkit.spawn`,
is printed as ``error: ...`` on stderr and ends the process with status 1.
Anything else (a bug's ``AttributeError``, an error from inside another
library) keeps its traceback, as does everything with ``--debug`` or
``DDPKIT_DEBUG=1``. Python's own ``sys.excepthook`` has no such rule, and a
traceback of 30 lines hides the one that says what to do.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from ddpkit.distributed.processes import RankFailedError

__all__ = ["expected_errors", "is_expected"]

_PACKAGE = str(Path(__file__).resolve().parents[1])
# What ddpkit raises on purpose from its own code, the message saying what to do.
_ON_PURPOSE = (ValueError, TypeError, OSError, RuntimeError)
_ON_PURPOSE_NAMES = {"ValueError", "TypeError", "OSError", "RuntimeError"}
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
_LAST_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+.*\n\s*(.*)$', re.MULTILINE)
_LAST_LINE = re.compile(r"^([\w.]+(?:Error|Exception)): (.*)$", re.MULTILINE | re.DOTALL)


def is_expected(exc: BaseException) -> str | None:
    """The one line to show for ``exc`` when it is a mistake ddpkit explained, else None."""
    if isinstance(exc, RankFailedError):
        return _remote(exc)
    if isinstance(exc, _MISSING):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    ours = type(exc).__module__.startswith("ddpkit.")
    # A `raise` in ddpkit's code: a bug's TypeError from a bad call there keeps its traceback.
    raised_here = bool(frames) and _raised_in_ddpkit(frames[-1].filename, frames[-1].line)
    if ours or (raised_here and isinstance(exc, _ON_PURPOSE)):
        return str(exc)
    return None


def _remote(exc: RankFailedError) -> str | None:
    """A failed rank's error, judged by its traceback's text as :func:`is_expected` judges."""
    text = exc.remote_traceback.rstrip()
    frames, last = _LAST_FRAME.findall(text), None
    lines = text.splitlines()
    start = next((i for i in range(len(lines) - 1, -1, -1) if _LAST_LINE.match(lines[i])), None)
    if start is not None:
        last = _LAST_LINE.match("\n".join(lines[start:]))
    if last is None or not frames:
        return None
    name, message = last.group(1), last.group(2)
    short = name.rsplit(".", 1)[-1]
    missing = short in {t.__name__ for t in _MISSING}
    ours = name.startswith("ddpkit.")  # a class of ddpkit's, printed with its module
    here = _raised_in_ddpkit(*frames[-1]) and short in _ON_PURPOSE_NAMES
    if missing or ours or here:
        return f"rank {exc.rank}: {message}"
    return None


def _raised_in_ddpkit(filename: str, line: str | None) -> bool:
    return filename.startswith(_PACKAGE) and (line or "").lstrip().startswith("raise ")


@contextlib.contextmanager
def expected_errors(debug: bool | None = None) -> Iterator[None]:
    """Print an expected error as one line on stderr and exit with status 1; re-raise the rest.

    ``debug`` (default: ``DDPKIT_DEBUG`` set to anything but ``0`` or empty)
    re-raises everything, tracebacks included.

    Example:
        >>> def main(argv=None):
        ...     args = parse_args(argv)
        ...     with ddpkit.expected_errors(debug=args.debug):
        ...         train(args)
    """
    if debug is None:
        debug = os.environ.get("DDPKIT_DEBUG", "") not in ("", "0")
    try:
        yield
    except Exception as exc:
        line = None if debug else is_expected(exc)
        if line is None:
            raise
        print(f"error: {line}\n(the traceback: --debug, or DDPKIT_DEBUG=1)", file=sys.stderr)
        raise SystemExit(1) from None
