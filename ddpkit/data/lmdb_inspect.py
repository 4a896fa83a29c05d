"""Look at a finished database: ``describe_lmdb`` (``ddpkit lmdb info``) and ``verify_lmdb``.

Verification decodes every record with the dataset's own decoder
(``ddpkit.data.images``), so a database that verifies is one that training
can read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from typing import Any

import lmdb
import numpy as np
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from ddpkit.data.lmdb_format import env_for_reading, read_index
from ddpkit.data.lmdb_index import FORMAT_NAME, LMDBFormatError, sample_key
from ddpkit.data.threads import check_workers, ordered_map

__all__ = ["BadSample", "VerifyReport", "describe_lmdb", "verify_lmdb", "verify_report"]


@dataclass(frozen=True)
class BadSample:
    """A record that does not decode.

    Attributes:
        index: the sample index.
        path: its ``path`` column entry (where it was built from), or "".
        reason: what the decoder said.
    """

    index: int
    path: str
    reason: str

    def describe(self) -> str:
        """``"<path>: <reason>"``, or the reason alone without a path."""
        return f"{self.path}: {self.reason}" if self.path else self.reason


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_report` found.

    Attributes:
        path: the database.
        samples: how many records were decoded.
        bad: the records that do not decode, in index order.
    """

    path: str
    samples: int
    bad: tuple[BadSample, ...]

    @property
    def ok(self) -> bool:
        """Every record decodes."""
        return not self.bad


def verify_report(
    path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    progress: bool = False,
    max_pixels: int | None = None,
) -> VerifyReport:
    """Decode every sample of a database in parallel threads, as the dataset would.

    Args:
        path: the database.
        workers: decoding threads, 1..1024 (default: usable CPUs).
        progress: show a tqdm bar on stderr when it is a terminal.
        max_pixels: the most pixels an image may have, as the dataset's
            ``max_pixels`` (default: Pillow's limit); a larger one is listed.

    Returns:
        A :class:`VerifyReport`: the count and every record that does not decode.

    Raises:
        FileNotFoundError, LMDBFormatError: ``path`` is not a ddpkit database.
        ValueError, TypeError: ``workers`` is not a whole number in 1..1024.
    """
    # The decoder and the CPU count import torch: here, so that `ddpkit lmdb info` starts without.
    from ddpkit.data.images import check_image, pixel_limit
    from ddpkit.distributed.devices import usable_cpus

    check_workers(workers)
    pixel_limit(max_pixels)
    path = os.fspath(path)
    try:
        index = read_index(path, columns=("path",))
        names: Sequence[str] = index.columns["path"]
    except LMDBFormatError:
        index = read_index(path)  # built without a path column
        names = [""] * len(index)
    bad: list[BadSample] = []
    decode = partial(_check_chunk, names=names, check=partial(check_image, max_pixels=max_pixels))
    threads = workers or usable_cpus()
    with (
        env_for_reading(path) as env,
        tqdm(
            total=len(index), unit="img", disable=None if progress else True, desc="lmdb verify"
        ) as bar,
        closing(ordered_map(decode, _records(env, len(index)), threads)) as checked,
    ):
        for chunk, found in checked:
            bad += found
            bar.update(len(chunk))
    return VerifyReport(path, len(index), tuple(bad))


def _records(env: lmdb.Environment, count: int) -> Iterator[tuple[int, bytes | str | None]]:
    """``(index, bytes)`` of each record, or ``(index, why it cannot be read)``: verify goes on."""
    txn = env.begin()
    try:
        for i in range(count):
            record: bytes | str | None
            try:
                record = txn.get(sample_key(i))
            except lmdb.Error as exc:  # MDB_CORRUPTED, MDB_PAGE_NOTFOUND ...
                record = f"the record cannot be read, the database file is damaged ({exc})"
                txn.abort()  # LMDB: a transaction that failed is unusable; the next is fresh
                txn = env.begin()
            yield i, record
    finally:
        txn.abort()


def verify_lmdb(
    path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    progress: bool = False,
    max_pixels: int | None = None,
) -> list[tuple[int, str]]:
    """``(index, reason)`` of each sample that does not decode; empty when all do.

    :func:`verify_report` with the result as pairs; the reason starts with
    the sample's ``path`` column entry when the index has one.

    Example:
        >>> for index, reason in verify_lmdb("data/train.lmdb"):  # doctest: +SKIP
        ...     print(index, reason)
    """
    report = verify_report(path, workers=workers, progress=progress, max_pixels=max_pixels)
    return [(b.index, b.describe()) for b in report.bad]


def describe_lmdb(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``ddpkit lmdb info`` shows, as a JSON-ready dict.

    Returns:
        ``path``, ``format``, ``format_version``, ``ddpkit_version`` (that wrote
        it), ``samples``, ``classes`` (name -> sample count, in label order),
        ``size_bytes`` (its files on disk) and ``metadata`` (source, builder options).

    Raises:
        FileNotFoundError, LMDBFormatError: ``path`` is not a ddpkit database.

    Example:
        >>> describe_lmdb("data/train.lmdb")["samples"]  # doctest: +SKIP
        1281167
    """
    path = os.fspath(path)
    index = read_index(path)
    counts = np.bincount(index.labels, minlength=len(index.classes))
    files = [os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]
    return {
        "path": os.path.abspath(path),
        "format": FORMAT_NAME,
        "format_version": index.version,
        "ddpkit_version": index.ddpkit_version,
        "samples": len(index),
        "classes": {name: int(n) for name, n in zip(index.classes, counts, strict=True)},
        "size_bytes": sum(os.path.getsize(f) for f in files if os.path.isfile(f)),
        "metadata": dict(index.metadata),
    }


def _check_chunk(
    chunk: list[tuple[int, bytes | str | None]],
    *,
    names: Sequence[str],
    check: Callable[[bytes | None, str], str | None],
) -> list[BadSample]:
    """The records of ``chunk`` that ``check`` finds do not decode (runs in a worker thread)."""
    found = []
    for index, data in chunk:
        reason = data if isinstance(data, str) else check(data, "decode")
        if reason is not None:
            found.append(BadSample(index, names[index], reason))
    return found
