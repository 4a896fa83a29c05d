"""Build a ddpkit LMDB database from an ImageFolder tree, a list file or Parquet files.

The builder writes into a temporary directory beside the output and renames it
into place only once the index record is written: an interrupted or failed
build never leaves anything at the output path, and a left-over temporary
directory has no index record, so it never opens as a finished database.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from typing import Literal

import lmdb
import numpy as np
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from ddpkit.data.images import Check, prepare_image
from ddpkit.data.lmdb_format import INDEX_KEY, encode_index, sample_key
from ddpkit.data.lmdb_sources import (
    Sample,
    Source,
    detect_format,
    imagefolder_source,
    list_source,
    parquet_source,
)
from ddpkit.data.threads import ordered_map
from ddpkit.devices import usable_cpus

__all__ = ["BuildSummary", "ImageError", "build_lmdb"]

_COMMIT_SAMPLES = 1000
_COMMIT_BYTES = 256 << 20
# A modest first reservation: the map doubles whenever a batch does not fit.
_INITIAL_MAP_SIZE = 1 << 30


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
        workers: threads reading and checking images (default: usable CPUs).
        max_side: images whose longer side exceeds it are shrunk to it (aspect
            kept, alpha dropped) and stored as RGB JPEG at ``quality``.
        quality: JPEG quality of shrunk images, 1..100.
        check: ``"none"`` (non-empty), ``"header"`` (PIL identifies the format
            and size) or ``"decode"`` (full decode).
        on_error: ``"fail"`` raises on the first bad image; ``"skip"`` leaves it
            out and lists it in :attr:`BuildSummary.skipped`.
        map_size: the first LMDB map size in bytes (default 1 GiB); it doubles when full.
        overwrite: replace a database at ``output`` once the new one is complete.
        progress: show a tqdm bar on stderr.

    Returns:
        A :class:`BuildSummary`.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        FileExistsError: ``output`` exists and ``overwrite`` is false (checked
            before any work), or ``output`` is a directory that is not an LMDB.
        ImageError: a bad image with ``on_error="fail"``.
        ValueError: an invalid option, list-file line, Parquet column or label.

    Example:
        >>> summary = build_lmdb("data/train", "data/train.lmdb", max_side=512)  # doctest: +SKIP
        >>> print(summary.format())  # doctest: +SKIP
    """
    source, output = os.fspath(source), os.fspath(output)
    workers = usable_cpus() if workers is None else workers
    _check_choice("source_format", source_format, ("auto", "imagefolder", "list", "parquet"))
    _check_choice("check", check, ("none", "header", "decode"))
    _check_choice("on_error", on_error, ("fail", "skip"))
    for name, value, low in [
        ("workers", workers, 1),
        ("max_side", max_side, 1),
        ("quality", quality, 1),
        ("map_size", map_size, 4096),
    ]:
        if value is not None and value < low:
            raise ValueError(f"{name} must be at least {low}; got {value}")
    if quality > 100:
        raise ValueError(f"quality must lie in 1..100; got {quality}")
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source}: no such file or directory to build a database from")
    _check_output(output, overwrite)
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

    start = time.perf_counter()
    tmp = f"{output}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    prepare = partial(_prepare_chunk, check=check, max_side=max_side, quality=quality)
    metadata = {
        "source": os.path.abspath(source),
        "source_format": fmt,
        "max_side": str(max_side or "none"),
    }
    try:
        labels, written, skipped = _write(
            tmp, src, prepare, workers, on_error, map_size or _INITIAL_MAP_SIZE, metadata, progress
        )
        _move_into_place(tmp, output)
    except BaseException:  # KeyboardInterrupt too: never leave a half-built directory
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=len(src.classes))
    return BuildSummary(
        output,
        len(labels),
        src.classes,
        tuple(int(c) for c in counts),
        written,
        time.perf_counter() - start,
        tuple(skipped),
    )


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _check_output(output: str, overwrite: bool) -> None:
    if not os.path.lexists(output):
        return
    if not overwrite:
        raise FileExistsError(
            f"{output} already exists; pass overwrite=True (--overwrite) to "
            "replace it, or choose another output path"
        )
    if os.path.isdir(output) and not os.path.exists(os.path.join(output, "data.mdb")):
        raise FileExistsError(
            f"{output} is a directory without data.mdb, not an LMDB database; "
            "refusing to replace it even with overwrite: remove it yourself"
        )


def _prepare_chunk(
    chunk: list[Sample], *, check: Check, max_side: int | None, quality: int
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
        prepared.append(prepare_image(data, check, max_side, quality))
    return prepared


def _write(
    tmp: str,
    src: Source,
    prepare: Callable[[list[Sample]], list[tuple[bytes | None, str]]],
    workers: int,
    on_error: str,
    map_size: int,
    metadata: dict[str, str],
    progress: bool,
) -> tuple[list[int], int, list[tuple[str, str]]]:
    labels: list[int] = []
    names: list[str] = []
    skipped: list[tuple[str, str]] = []
    batch: list[tuple[bytes, bytes]] = []
    batch_bytes = written = 0
    # No fsync per commit: an unfinished build is thrown away, so only the end must be durable.
    env = lmdb.open(
        tmp,
        subdir=True,
        map_size=map_size,
        readahead=False,
        meminit=False,
        sync=False,
        metasync=False,
    )
    try:
        with (
            tqdm(total=src.total, unit="img", disable=not progress, desc="lmdb build") as bar,
            closing(ordered_map(prepare, src.samples, workers)) as prepared,
        ):
            for chunk, results in prepared:
                for sample, (data, reason) in zip(chunk, results, strict=True):
                    where = sample.file or sample.name
                    if data is None and on_error == "fail":
                        raise ImageError(
                            f"{where}: {reason}. Fix or remove it, or pass "
                            "on_error='skip' (--on-error skip) to leave it out"
                        )
                    if data is None:
                        skipped.append((where, reason))
                        continue
                    batch.append((sample_key(len(labels)), data))
                    labels.append(sample.label)
                    names.append(sample.name)
                    batch_bytes += len(data)
                if len(batch) >= _COMMIT_SAMPLES or batch_bytes >= _COMMIT_BYTES:
                    _put_all(env, batch, append=True)
                    written, batch, batch_bytes = written + batch_bytes, [], 0
                bar.update(len(chunk))
        _put_all(env, batch, append=True)
        # The index goes last and alone: without it this is not a ddpkit database.
        index = encode_index(labels, src.classes, columns={"path": names}, metadata=metadata)
        _put_all(env, [(INDEX_KEY, index)], append=False)
        env.sync(True)
    finally:
        env.close()
    return labels, written + batch_bytes, skipped


def _put_all(env: lmdb.Environment, items: list[tuple[bytes, bytes]], *, append: bool) -> None:
    """Write ``items`` in one transaction, doubling the map until they fit."""
    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in items:
                    txn.put(key, value, append=append)
            return
        except lmdb.MapFullError:  # the transaction was aborted: grow the map and redo it
            env.set_mapsize(env.info()["map_size"] * 2)


def _move_into_place(tmp: str, output: str) -> None:
    if not os.path.lexists(output):
        os.rename(tmp, output)
        return
    # overwrite=True (checked before the build): the old database goes only now.
    aside = f"{output}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(output, aside)
    try:
        os.rename(tmp, output)
    except BaseException:
        os.rename(aside, output)
        raise
    shutil.rmtree(aside) if os.path.isdir(aside) else os.remove(aside)
