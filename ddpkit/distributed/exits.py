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
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

__all__ = ["expected_errors", "is_expected"]

_PACKAGE = str(Path(__file__).resolve().parents[1])
# What ddpkit raises on purpose from its own code, the message saying what to do.
_ON_PURPOSE = (ValueError, TypeError, OSError, RuntimeError)
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def is_expected(exc: BaseException) -> str | None:
    """The one line to show for ``exc`` when it is a mistake ddpkit explained, else None.

    A failed rank of :func:`ddpkit.spawn` (``RankFailedError``) was judged in the rank.
    """
    if hasattr(exc, "expected_line"):  # RankFailedError: what its rank judged, rank named
        line: str | None = getattr(exc, "expected_line", None)
        return None if line is None else f"rank {getattr(exc, 'rank', '?')}: {line}"
    if isinstance(exc, _MISSING):
        return str(exc)
    last = traceback.extract_tb(exc.__traceback__)[-1:]
    ours = type(exc).__module__.startswith("ddpkit.")
    # A `raise` in ddpkit's code: a bug's TypeError from a bad call there keeps its traceback.
    raised_here = any(
        f.filename.startswith(_PACKAGE) and (f.line or "").lstrip().startswith("raise ")
        for f in last
    )
    if ours or (raised_here and isinstance(exc, _ON_PURPOSE)):
        return str(exc)
    return None


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
