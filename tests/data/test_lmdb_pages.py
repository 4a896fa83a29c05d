"""Tests of ``ddpkit.data.lmdb_pages.PageEstimate``: the pages and bytes of ``data.mdb`` that
records of given sizes take, compared with what LMDB itself writes."""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import lmdb
import pytest

from ddpkit.data.lmdb_index import sample_key
from ddpkit.data.lmdb_pages import PageEstimate


def _write(
    path: Path, sizes: Sequence[int], per_commit: int = 1000
) -> tuple[Mapping[str, int], int]:
    """Append records of ``sizes`` as the builder does; LMDB's page counts and the file's size."""
    env = lmdb.open(str(path), map_size=1 << 30, subdir=True, sync=False)
    try:
        for start in range(0, len(sizes), per_commit):
            with env.begin(write=True) as txn:
                for k in range(start, min(start + per_commit, len(sizes))):
                    txn.put(sample_key(k), os.urandom(sizes[k]), append=True)
        stat = env.stat()
    finally:
        env.close()
    return {key: stat[key] for key in ("psize", "leaf_pages", "overflow_pages")}, (
        path / "data.mdb"
    ).stat().st_size


def _estimate(sizes: Sequence[int], page: int = 4096, per_commit: int = 1000) -> PageEstimate:
    estimate = PageEstimate(page)
    for k, size in enumerate(sizes, 1):
        estimate.add(size)
        estimate.commits += k % per_commit == 0
    return estimate


_SIZES = {
    "small": [100] * 500,
    "largest-in-leaf": [2022] * 50,
    "smallest-overflow": [2023] * 50,
    "five-kib": [5 * 1024] * 30,
    "mixed": [random.Random(1).randint(10, 9000) for _ in range(400)],
    "empty-values": [0] * 300,
}


@pytest.mark.parametrize("case", sorted(_SIZES))
def test_leaf_and_overflow_pages_are_those_lmdb_writes(tmp_path: Path, case: str) -> None:
    stat, _ = _write(tmp_path / "db", _SIZES[case])
    assert stat["psize"] == 4096
    estimate = _estimate(_SIZES[case])
    assert estimate.overflow_pages == stat["overflow_pages"]
    assert estimate.leaf_pages == stat["leaf_pages"]


def test_the_leaf_limit_is_lmdbs_largest_node(tmp_path: Path) -> None:
    estimate = PageEstimate(4096)
    assert estimate.node_max == 2038  # a 2022-byte value with its 8-byte key and 8-byte header
    estimate.add(2022)
    assert estimate.overflow_pages == 0
    estimate.add(2023)
    assert estimate.overflow_pages == 1
    stat, _ = _write(tmp_path / "db", [2022, 2023])
    assert stat["overflow_pages"] == 1


def test_a_five_kib_image_takes_two_whole_pages() -> None:
    estimate = PageEstimate(4096)
    before = estimate.bytes()
    estimate.add(5 * 1024)
    assert estimate.overflow_pages == 2
    assert estimate.bytes() - before >= 2 * 4096
    assert estimate.bytes() % 4096 == 0


@pytest.mark.parametrize("per_commit", [1000, 37])
def test_the_file_size_is_never_underestimated(tmp_path: Path, per_commit: int) -> None:
    sizes = [random.Random(per_commit).randint(500, 7000) for _ in range(1200)]
    _, actual = _write(tmp_path / "db", sizes, per_commit)
    needed = _estimate(sizes, per_commit=per_commit).bytes()
    assert actual <= needed <= actual * 1.25 + 64 * 4096  # high, but not wildly


def test_a_scaled_estimate_covers_that_many_more_records(tmp_path: Path) -> None:
    rng = random.Random(5)
    sizes = [rng.randint(100, 6000) for _ in range(900)]
    seen = _estimate(sizes[:300], per_commit=100)  # a third of the records so far
    _, actual = _write(tmp_path / "db", sizes, per_commit=100)
    assert seen.bytes(3.0) >= actual
    assert seen.bytes(3.0) >= seen.bytes(2.0) >= seen.bytes()


@pytest.mark.parametrize("size", [0, 100, 4000, 50_000])
def test_one_more_record_grows_the_file_by_at_most_record(tmp_path: Path, size: int) -> None:
    path = tmp_path / "db"
    _, before = _write(path, [3000] * 200)
    env = lmdb.open(str(path), map_size=1 << 30, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"__index__", os.urandom(size))
    finally:
        env.close()
    grown = (path / "data.mdb").stat().st_size - before
    assert 0 <= grown <= PageEstimate(4096).record(size)
    assert PageEstimate(4096).record(size) >= -(-size // 4096) * 4096  # at least its bytes


def test_larger_pages_keep_larger_records_in_their_leaves() -> None:
    estimate = PageEstimate(65536)  # the page size of some ARM64 and POWER systems
    estimate.add(5 * 1024)
    assert estimate.overflow_pages == 0
    assert estimate.leaf_pages == 1
    estimate.add(40_000)  # past half a page: overflow pages of its own
    assert estimate.overflow_pages == 1
    assert estimate.bytes() % 65536 == 0
