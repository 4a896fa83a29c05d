"""``ordered_map``: a function over chunks of an iterable, in threads, in order, bounded memory.

The LMDB builder prepares images with it, and ``verify`` decodes them with it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["MAX_WORKERS", "check_workers", "ordered_map"]

CHUNK = 16  # items per task handed to a worker thread
# More threads than this only add memory (4 chunks each in flight) and start-up time.
MAX_WORKERS = 1024


def check_workers(workers: int | None) -> None:
    """Refuse a thread count that is not a whole number in ``1..MAX_WORKERS`` (None: default).

    Raises:
        TypeError: not an integer (``bool`` included).
        ValueError: outside ``1..MAX_WORKERS``.
    """
    if workers is None:
        return
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise TypeError(f"workers must be a whole number of threads, got {workers!r}")
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must lie in 1..{MAX_WORKERS} threads; got {workers}")


_T = TypeVar("_T")
_R = TypeVar("_R")


def ordered_map(
    fn: Callable[[list[_T]], _R], items: Iterable[_T], workers: int
) -> Generator[tuple[list[_T], _R], None, None]:
    """``(chunk, fn(chunk))`` over chunks of ``items``, in order, ``fn`` in ``workers`` threads.

    A few chunks per thread are in flight at most, so memory stays bounded
    however long the source is. Close it (``contextlib.closing``) to cancel
    the rest at once when the consumer stops early.
    """
    it = iter(items)
    chunks = iter(lambda: list(itertools.islice(it, CHUNK)), [])
    if workers == 1:
        yield from ((chunk, fn(chunk)) for chunk in chunks)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="ddpkit-lmdb")
    pending: deque[tuple[list[_T], Future[_R]]] = deque()
    try:
        for chunk in chunks:
            pending.append((chunk, pool.submit(fn, chunk)))
            if len(pending) >= 4 * workers:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # prompt on errors and Ctrl-C
