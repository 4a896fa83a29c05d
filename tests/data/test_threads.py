"""ddpkit.data.threads.ordered_map: chunks in order, errors passed on, bounded work in flight."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from ddpkit.data.threads import CHUNK, ordered_map


def _squares(chunk: list[int]) -> list[int]:
    return [x * x for x in chunk]


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("n", [0, 1, CHUNK, CHUNK + 1, 5 * CHUNK + 3])
def test_chunks_come_back_in_order_with_their_results(workers: int, n: int) -> None:
    out = list(ordered_map(_squares, range(n), workers))
    assert [x for chunk, _ in out for x in chunk] == list(range(n))
    assert all(result == _squares(chunk) for chunk, result in out)
    assert all(len(chunk) == CHUNK for chunk, _ in out[:-1])
    assert all(chunk for chunk, _ in out)  # no empty chunk, not even for an empty source


def test_order_holds_when_later_chunks_finish_first() -> None:
    def slow_first(chunk: list[int]) -> int:
        if chunk[0] == 0:
            time.sleep(0.2)
        return chunk[0]

    out = [result for _, result in ordered_map(slow_first, range(6 * CHUNK), 4)]
    assert out == [k * CHUNK for k in range(6)]


@pytest.mark.parametrize("workers", [1, 2])
def test_an_error_in_fn_reaches_the_consumer_at_its_chunk(workers: int) -> None:
    def fail_on_third(chunk: list[int]) -> int:
        if chunk[0] == 2 * CHUNK:
            raise ValueError("bad chunk")
        return chunk[0]

    got: list[int] = []

    def consume() -> None:
        for _, result in ordered_map(fail_on_third, range(10 * CHUNK), workers):
            got.append(result)

    with pytest.raises(ValueError, match="bad chunk"):
        consume()
    assert got == [0, CHUNK]


def test_the_source_is_read_lazily_and_work_in_flight_is_bounded() -> None:
    pulled = 0

    def endless() -> Iterator[int]:
        nonlocal pulled
        while True:
            pulled += 1
            yield pulled

    workers = 2
    stream = ordered_map(len, endless(), workers)
    with contextlib.closing(stream):
        for _ in range(3):
            next(stream)
        # At most 4 chunks per worker in flight beyond what was consumed.
        assert pulled <= (3 + 4 * workers + 1) * CHUNK


def test_closing_early_cancels_the_rest() -> None:
    started = []
    lock = threading.Lock()

    def record(chunk: list[int]) -> int:
        with lock:
            started.append(chunk[0])
        time.sleep(0.01)
        return chunk[0]

    stream = ordered_map(record, range(1000 * CHUNK), 2)
    with contextlib.closing(stream):
        next(stream)
    time.sleep(0.1)
    with lock:
        count = len(started)
    assert count <= 4 * 2 + 2  # only what was already queued ran, not the 1000 chunks
