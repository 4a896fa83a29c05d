"""Build a ddpkit LMDB database from an ImageFolder tree, a list file or Parquet files.

The builder writes into a temporary directory beside the output and renames it
into place only once the index record is written: an interrupted or failed
build never leaves anything at the output path, and a left-over temporary
directory has no index record, so it never opens as a finished database.
"""

from __future__ import annotations

import os
import shutil
import time
from array import array
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import lmdb
import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from ddpkit import _graveyard
from ddpkit._docs import see
from ddpkit.data.build_output import check_output, move_into_place, temp_output
from ddpkit.data.images import Check, pixel_limit, prepare_image
from ddpkit.data.lmdb_index import INDEX_KEY, encode_index_buffer, sample_key
from ddpkit.data.lmdb_pages import PageEstimate
from ddpkit.data.lmdb_sources import (
    Sample,
    Source,
    detect_format,
    imagefolder_source,
    list_source,
    parquet_source,
)
from ddpkit.data.threads import check_workers, ordered_map
from ddpkit.distributed.devices import usable_cpus
from ddpkit.files import is_no_space, is_quota, no_space

__all__ = ["MAX_MAP_SIZE", "MIN_MAP_SIZE", "BuildSummary", "ImageError", "build_lmdb"]

_COMMIT_SAMPLES = 1000
_COMMIT_BYTES = 256 << 20
# A modest first reservation: the map doubles whenever a batch does not fit.
_INITIAL_MAP_SIZE = 1 << 30
# LMDB reserves the whole map in the address space (128 TiB on x86-64 Linux); a page
# is the least it can hold.
MIN_MAP_SIZE = 4096
MAX_MAP_SIZE = 64 << 40


class ImageError(ValueError):
    """An image could not be read, or failed the requested check."""


@dataclass(frozen=True)
class BuildSummary:
    """What :func:`build_lmdb` wrote.

    Attributes:
        output: the database path.
        samples: the number of samples stored.
        classes: the class names; label ``k`` is ``classes[k]``.
        class_counts: the number of stored samples of each class.
        bytes_written: the total size of the stored image bytes.
        seconds: the wall time of the build.
        skipped: ``(path or row id, reason)`` of each image left out (``on_error="skip"``).
    """

    output: str
    samples: int
    classes: tuple[str, ...]
    class_counts: tuple[int, ...]
    bytes_written: int
    seconds: float
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def images_per_second(self) -> float:
        """Stored samples per second of build time."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        """Human-readable lines: counts, size, time, throughput and the skipped count."""
        return (
            f"wrote {self.samples} samples in {len(self.classes)} classes to {self.output}\n"
            f"  {self.bytes_written / 2**20:.1f} MiB of image bytes in {self.seconds:.1f} s "
            f"({self.images_per_second:.0f} img/s)\n"
            f"  {len(self.skipped)} skipped"
        )


def build_lmdb(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    source_format: Literal["auto", "imagefolder", "list", "parquet"] = "auto",
    root: str | None = None,
    classes: Sequence[str] | None = None,
    image_column: str = "image",
    label_column: str = "label",
    workers: int | None = None,
    max_side: int | None = None,
    quality: int = 90,
    check: Literal["none", "header", "decode"] = "header",
    on_error: Literal["fail", "skip"] = "fail",
    map_size: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    allow_empty: bool = False,
    max_pixels: int | None = None,
) -> BuildSummary:
    """Write the images of ``source`` and their labels into a new database at ``output``.

    Sample ``i`` is the ``i``-th image of the source: ImageFolder order (exactly
    ``torchvision.datasets.ImageFolder``'s), list-file line order, or Parquet row
    order over the files sorted by name. Image bytes are stored as read unless
    ``max_side`` asks for a smaller copy.

    Args:
        source: an ImageFolder root, a list file (``path,label`` or ``path label``
            lines, ``#`` comments), or a Parquet file or directory of ``*.parquet``.
        output: the database directory to create.
        source_format: how to read ``source``; ``"auto"`` tells from the path.
        root: list files only: where relative paths start (default: the list's directory).
        classes: list and Parquet sources: the class names (default: ``str(k)``
            for labels ``0..max``, or the sorted unique names of string labels).
        image_column: Parquet: a binary column, or a struct with a ``bytes``
            field (and optionally ``path``), as Hugging Face ``datasets`` writes.
        label_column: Parquet: an integer or string column.
        workers: threads reading and checking images, 1..1024 (default: usable CPUs).
        max_side: images whose longer side exceeds it are shrunk to it (aspect
            kept, alpha dropped) and stored as RGB JPEG at ``quality``.
        quality: JPEG quality of shrunk images, 1..100.
        check: ``"none"`` (non-empty), ``"header"`` (PIL identifies the format
            and size) or ``"decode"`` (full decode).
        on_error: ``"fail"`` raises on the first bad image; ``"skip"`` leaves it
            out and lists it in :attr:`BuildSummary.skipped`.
        map_size: the first LMDB map size in bytes, 4 KiB to 64 TiB (default 1 GiB); it
            doubles when full.
        overwrite: replace a database at ``output`` once the new one is complete;
            only an LMDB database is ever replaced.
        progress: show a tqdm bar on stderr when it is a terminal.
        allow_empty: write a database even when no image could be stored
            (by default that is an ``ImageError`` and nothing is written).
        max_pixels: the most pixels an image may have, checked from its header
            (``check="header"`` or ``"decode"``; default: Pillow's limit, see
            :func:`ddpkit.data.images.pixel_limit`); a larger one is a bad image.

    Returns:
        A :class:`BuildSummary`.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        FileExistsError: ``output`` exists and ``overwrite`` is false, or it is
            not an LMDB database (a file, a link, a directory with other files);
            checked before any work.
        ImageError: a bad image (or a directory reached twice through links)
            with ``on_error="fail"``, or no image stored without ``allow_empty``.
        ValueError: an invalid option, list-file line, Parquet column or label;
            an empty path, or ``output`` that is or lies inside ``source``.
        OSError: the disk filled up (``ENOSPC``; the message says how much room
            was needed and how much is free); nothing is left at ``output``.

    Example:
        >>> summary = build_lmdb("data/train", "data/train.lmdb", max_side=512)  # doctest: +SKIP
        >>> print(summary.format())  # doctest: +SKIP
    """
    # "db/" and "db" are one output: a trailing separator must not hide a link.
    source, output = os.fspath(source), _strip_separators(os.fspath(output))
    check_workers(workers)
    pixel_limit(max_pixels)
    workers = usable_cpus() if workers is None else workers
    _check_choice("source_format", source_format, ("auto", "imagefolder", "list", "parquet"))
    _check_choice("check", check, ("none", "header", "decode"))
    _check_choice("on_error", on_error, ("fail", "skip"))
    for name, value, low in [("max_side", max_side, 1), ("quality", quality, 1)]:
        if value is not None and value < low:
            raise ValueError(f"{name} must be at least {low}; got {value}")
    if quality > 100:
        raise ValueError(f"quality must lie in 1..100; got {quality}")
    if map_size is not None and not MIN_MAP_SIZE <= map_size <= MAX_MAP_SIZE:
        raise ValueError(
            f"map_size must lie in {MIN_MAP_SIZE}..{MAX_MAP_SIZE} bytes (4 KiB to 64 TiB; "
            f"--map-size 4K to 64T); got {map_size}. LMDB reserves the whole map in the "
            "address space, and it doubles when full, so a small start is fine. "
            + see("data-lmdb-databases-datasets-loaders")
        )
    if source.strip() and not os.path.exists(source):
        raise FileNotFoundError(f"{source}: no such file or directory to build a database from")
    check_output(source, output, overwrite)
    fmt = detect_format(source) if source_format == "auto" else source_format
    if root is not None and fmt != "list":
        raise ValueError(f"root={root!r} applies to list files only; {source} is read as {fmt}")
    if fmt == "imagefolder":
        if classes is not None:
            raise ValueError(
                "classes= applies to list and Parquet sources; an ImageFolder's "
                "classes are its directory names"
            )
        src = imagefolder_source(source)
    elif fmt == "list":
        src = list_source(source, root, classes)
    else:
        src = parquet_source(source, image_column, label_column, classes)

    if src.problems and on_error == "fail":
        where, reason = src.problems[0]
        raise ImageError(f"{where}: {reason}. {_FIX}")
    start = time.perf_counter()
    tmp = temp_output(output)
    prepare = partial(
        _prepare_chunk, check=check, max_side=max_side, quality=quality, max_pixels=max_pixels
    )
    metadata = {
        "source": os.path.abspath(source),
        "source_format": fmt,
        "max_side": str(max_side or "none"),
    }
    try:
        written = _write(
            tmp, src, prepare, workers, on_error, map_size or _INITIAL_MAP_SIZE, progress
        )
        if not written.labels and not allow_empty:
            raise ImageError(
                f"no image of {source} could be stored ({len(written.skipped)} skipped, the first: "
                f"{written.skipped[0] if written.skipped else 'none found'}); nothing was written "
                "to the output. Fix the images, or pass allow_empty=True (--allow-empty)"
            )
        samples = len(written.labels)
        counts = written.finish(src.classes, metadata)
        move_into_place(tmp, source, output, overwrite)
    except BaseException:  # KeyboardInterrupt too: never leave a half-built directory
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildSummary(
        output,
        samples,
        src.classes,
        tuple(int(c) for c in counts),
        written.bytes,
        time.perf_counter() - start,
        (*src.problems, *written.skipped),
    )


def _strip_separators(path: str) -> str:
    stripped = path.rstrip("/" + os.sep)
    return stripped or path[:1]


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _prepare_chunk(
    chunk: list[Sample], *, check: Check, max_side: int | None, quality: int, max_pixels: int | None
) -> list[tuple[bytes | None, str]]:
    """``(bytes to store, "")`` or ``(None, why it is unusable)`` for each image.

    Runs in worker threads: file reads, decoding, resizing and encoding release the GIL.
    """
    prepared: list[tuple[bytes | None, str]] = []
    for sample in chunk:
        data = sample.data
        if data is None and sample.file is not None:
            try:
                with open(sample.file, "rb") as f:
                    data = f.read()
            except OSError as exc:  # a fact about this image, like a damaged file
                prepared.append((None, f"{type(exc).__name__}: {exc}"))
                continue
        prepared.append(prepare_image(data, check, max_side, quality, max_pixels=max_pixels))
    return prepared


_FIX = "Fix or remove it, or pass on_error='skip' (--on-error skip) to leave it out"


class _Written:
    """What the build stored so far, compactly: a label and a name per sample, 16 + ~30 bytes.

    Python lists of ints and strings would cost ten times that; with a million
    images the builder's memory would then grow with the dataset.
    """

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env
        self.pages = PageEstimate(env.stat()["psize"])
        self.labels = array("q")
        self.name_offsets = array("q", [0])  # Arrow's offsets: where each name starts and ends
        self.names = bytearray()
        self.skipped: list[tuple[str, str]] = []
        self.bytes = 0

    def add(self, label: int, name: str, size: int) -> None:
        self.pages.add(size)
        self.labels.append(label)
        self.names += name.encode("utf-8", "surrogateescape")
        self.name_offsets.append(len(self.names))

    def label_array(self) -> np.ndarray:
        return np.frombuffer(self.labels, dtype=np.int64) if self.labels else np.zeros(0, np.int64)

    def finish(self, classes: Sequence[str], metadata: dict[str, str]) -> np.ndarray:
        """Write the index record, last and alone; return the count of each class.

        Without the index record this is not a ddpkit database. The packed
        arrays are viewed by Arrow without a copy and let go once the record
        is serialised, so the builder's peak holds the record about twice.
        """
        labels = self.label_array()
        counts = np.bincount(labels, minlength=len(classes))
        paths = pa.LargeStringArray.from_buffers(
            len(labels), pa.py_buffer(self.name_offsets), pa.py_buffer(self.names)
        )
        index = encode_index_buffer(labels, classes, columns={"path": paths}, metadata=metadata)
        del labels, paths
        self.labels, self.name_offsets, self.names = array("q"), array("q", [0]), bytearray()
        try:
            _put_all(self.env, [(INDEX_KEY, memoryview(index))], append=False)
            self.env.sync(True)
        except (lmdb.Error, OSError) as exc:
            if is_no_space(exc):
                needed = self.pages.bytes() + self.pages.record(len(index))
                raise no_space(self.env.path(), needed, quota=is_quota(exc)) from exc
            raise
        finally:
            self.env.close()
        return counts


def _write(
    tmp: str,
    src: Source,
    prepare: Callable[[list[Sample]], list[tuple[bytes | None, str]]],
    workers: int,
    on_error: str,
    map_size: int,
    progress: bool,
) -> _Written:
    # No fsync per commit: an unfinished build is thrown away, so only the end must be durable.
    # No lock file: one writer owns the directory, and a lock map on a full tmpfs can SIGBUS.
    try:
        env = lmdb.open(
            tmp,
            subdir=True,
            map_size=map_size,
            lock=False,
            readahead=False,
            meminit=False,
            sync=False,
            metasync=False,
        )
    except lmdb.MemoryError as exc:  # the address space (or `ulimit -v`) has no room for it
        raise ValueError(
            f"map_size={map_size} bytes ({map_size / 2**30:.1f} GiB) cannot be reserved in this "
            f"process's address space ({exc}); pass a smaller map_size (--map-size): it "
            "doubles when full. " + see("data-lmdb-databases-datasets-loaders")
        ) from exc
    written = _Written(env)
    batch: list[tuple[bytes, bytes]] = []
    batch_bytes = 0
    try:
        with (
            tqdm(
                total=src.total, unit="img", disable=None if progress else True, desc="lmdb build"
            ) as bar,
            closing(ordered_map(prepare, src.samples, workers)) as prepared,
        ):
            for chunk, results in prepared:
                for sample, (data, reason) in zip(chunk, results, strict=True):
                    where = sample.file or sample.name
                    if data is None and on_error == "fail":
                        raise ImageError(f"{where}: {reason}. {_FIX}")
                    if data is None:
                        written.skipped.append((where, reason))
                        continue
                    batch.append((sample_key(len(written.labels)), data))
                    written.add(sample.label, sample.name, len(data))
                    batch_bytes += len(data)
                if len(batch) >= _COMMIT_SAMPLES or batch_bytes >= _COMMIT_BYTES:
                    written.pages.commits += 1
                    _put_all(env, batch, append=True)
                    written.bytes, batch, batch_bytes = written.bytes + batch_bytes, [], 0
                bar.update(len(chunk))
        _put_all(env, batch, append=True)
        written.bytes += batch_bytes
    except BaseException as exc:
        env.close()
        if isinstance(exc, lmdb.Error | OSError) and is_no_space(exc):
            # What the whole build would need, in LMDB's pages, from the images so far;
            # the index record stores about 50 bytes per sample.
            done = len(written.labels) + len(written.skipped)
            scale = src.total / max(done, 1)
            index = 64 * src.total + 4096 + len(written.names) * src.total // max(done, 1)
            needed = written.pages.bytes(scale) + written.pages.record(index)
            raise no_space(tmp, needed, quota=is_quota(exc)) from exc
        raise
    return written


def _put_all(
    env: lmdb.Environment, items: Sequence[tuple[bytes, bytes | memoryview]], *, append: bool
) -> None:
    """Write ``items`` in one transaction, doubling the map until they fit."""
    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in items:
                    txn.put(key, value, append=append)
            return
        except lmdb.MapFullError:  # the transaction was aborted: grow the map and redo it
            env.set_mapsize(env.info()["map_size"] * 2)


def __getattr__(name: str) -> Any:
    return _graveyard.moved_name(__name__, name)
