"""Work on rank 0 only, or on rank 0 first: ``rank0_only``, ``rank0_first``, ``Rank0Error``.

Safe with and without a process group. A failure on rank 0 inside a synced
call reaches the other ranks as :class:`Rank0Error` instead of leaving them
waiting at the next collective.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar, overload

from ddpkit.distributed.comm import all_gather_object, barrier, get_rank, is_dist_initialized

__all__ = ["Rank0Error", "rank0_first", "rank0_only"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Rank0Error(RuntimeError):
    """Raised on the other ranks when rank 0 failed inside a ``rank0_only(sync=True)`` call.

    Attributes:
        exc_type: the qualified name of rank 0's exception type.
        exc_message: rank 0's exception message.
        remote_traceback: rank 0's formatted traceback.
    """

    def __init__(self, message: str, exc_type: str, exc_message: str, remote_traceback: str):
        super().__init__(message)
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback


@overload
def rank0_only(fn: Callable[_P, _R], /) -> Callable[_P, _R | None]: ...
@overload
def rank0_only(
    fn: None = None, /, *, sync: bool = False
) -> Callable[[Callable[_P, _R]], Callable[_P, _R | None]]: ...


def rank0_only(
    fn: Callable[_P, _R] | None = None, /, *, sync: bool = False
) -> Callable[_P, _R | None] | Callable[[Callable[_P, _R]], Callable[_P, _R | None]]:
    """Run the decorated function on rank 0 only; the other ranks get None.

    Without a process group the function always runs. With ``sync=True`` a call
    is a collective (all ranks must call it, or it deadlocks): every rank waits
    for rank 0, and if rank 0 raised, it re-raises its exception while every
    other rank raises :class:`Rank0Error`, instead of waiting at the next
    collective for a rank that is gone.

    Args:
        fn: the function, when used as ``@rank0_only``.
        sync: wait for rank 0 and share its failure: ``@rank0_only(sync=True)``.

    Returns:
        The decorated function: rank 0's result on rank 0, None elsewhere.

    Raises:
        Rank0Error: (calls with ``sync=True``, ranks > 0) rank 0 raised; its
            exception type, message and traceback are on the error.

    Example:
        >>> @rank0_only(sync=True)
        ... def write_report(path: str) -> None: ...
    """

    def decorate(func: Callable[_P, _R]) -> Callable[_P, _R | None]:
        @functools.wraps(func)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
            rank = get_rank()
            if not (sync and is_dist_initialized()):
                return func(*args, **kwargs) if rank == 0 else None
            result, error, report = None, None, None
            if rank == 0:
                try:
                    result = func(*args, **kwargs)
                except Exception as e:
                    error = e
                    report = (type(e).__qualname__, str(e), "".join(traceback.format_exception(e)))
            verdict = all_gather_object(report)[0]
            if error is not None:
                raise error
            if verdict is not None:
                raise Rank0Error(
                    f"rank 0 raised {verdict[0]}: {verdict[1]} (in {func.__qualname__}); rank "
                    f"{rank} stops too rather than wait for it. Rank 0's traceback has the cause",
                    *verdict,
                )
            return result

        return wrapper

    return decorate if fn is None else decorate(fn)


@contextlib.contextmanager
def rank0_first() -> Iterator[None]:
    """Run the body on rank 0 first, then on the other ranks (build a cache, then read it).

    All ranks must enter it, or it deadlocks. If rank 0's body raises, the other
    ranks are still released.

    Example:
        >>> with rank0_first():
        ...     dataset = build_or_open_cache(path)
    """
    if get_rank() != 0:
        barrier()
    try:
        yield
    finally:
        if get_rank() == 0:
            barrier()
