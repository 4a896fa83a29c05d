"""Where ``build_lmdb`` reads samples from: an ImageFolder tree, a list file, Parquet files.

Each reader returns the class names, the sample count and an iterable of
samples in source order (the order that becomes the database's index order).
The samples are produced as they are consumed, so memory does not grow with
the number of images: the readers hold one directory listing, one line or
one Parquet batch at a time, plus a few bytes per sample at most.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from glob import escape, glob
from pathlib import PurePath
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Sample",
    "Source",
    "detect_format",
    "imagefolder_source",
    "list_source",
    "parquet_source",
]

# The label is the last field: paths may hold spaces and commas, labels may not.
_LIST_LINE = re.compile(r"(?P<path>.+?)\s*[,\t ]\s*(?:(?P<index>[+-]?\d+)|(?P<name>[^,\t ]+))")


class Sample(NamedTuple):
    """One image to store: its name for the index, its label, and where its bytes are."""

    name: str  # the index's ``path`` column entry
    label: int
    file: str | None  # read by a worker thread ...
    data: bytes | None  # ... unless the bytes are already here (Parquet, verify)


class Source(NamedTuple):
    """What a reader found: class names, how many samples, the samples in order, and problems.

    ``problems`` are ``(path, reason)`` of what the reader left out because it
    cannot be stored as it is (a directory reached twice through links).
    """

    classes: tuple[str, ...]
    total: int
    samples: Iterable[Sample]
    problems: tuple[tuple[str, str], ...] = ()


def detect_format(source: str) -> str:
    if os.path.isfile(source):
        return "parquet" if source.endswith(".parquet") else "list"
    if glob(os.path.join(escape(source), "*.parquet")):
        return "parquet"
    if any(entry.is_dir() for entry in os.scandir(source)):
        return "imagefolder"
    raise ValueError(
        f"{source}: a directory with neither class subdirectories nor *.parquet "
        "files; pass source_format= (--format) to say how to read it"
    )


# torchvision.datasets.folder's IMG_EXTENSIONS and find_classes, written out: importing
# torchvision takes seconds (its models import torch._dynamo) that the builder's start
# would spend on a tuple and a sorted listing; a test holds them equal to torchvision's.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def imagefolder_source(source: str) -> Source:
    """torchvision's ImageFolder discovery and order, without following a link twice.

    Classes and order are ``torchvision.datasets.ImageFolder``'s exactly: the
    classes sorted, within each the directories walked with links followed and
    sorted by path, their files sorted. A directory reached a second time
    (a symlink loop, or two links to one directory) would repeat its images,
    or never end: it is left out and reported in ``problems``.
    """
    names = sorted(entry.name for entry in os.scandir(source) if entry.is_dir())
    if not names:
        raise FileNotFoundError(
            f"{source}: no class directory; an ImageFolder tree holds one subdirectory "
            "of images per class"
        )
    seen = {os.path.realpath(source): source}  # a link back to the root is a loop too
    problems: list[tuple[str, str]] = []
    walks, total = [], 0
    for name in names:
        reported = len(problems)
        directories, count = _walk(os.path.join(source, name), IMG_EXTENSIONS, seen, problems)
        if count == 0 and not (directories == [] and len(problems) > reported):
            raise FileNotFoundError(
                f"{source}: class {name!r} holds no image file (extensions: "
                f"{', '.join(IMG_EXTENSIONS)}); remove the directory or add its images"
            )
        walks.append(directories)
        total += count
    samples = _imagefolder_samples(source, walks, IMG_EXTENSIONS)
    return Source(tuple(names), total, samples, tuple(problems))


def _walk(
    top: str, extensions: tuple[str, ...], seen: dict[str, str], problems: list[tuple[str, str]]
) -> tuple[list[str], int]:
    """The directories under ``top`` (sorted), and how many image files they hold."""
    directories, count = [], 0
    real = os.path.realpath(top)
    if real in seen:
        problems.append((top, _twice(seen[real])))
        return [], 0
    seen[real] = top
    for root, subdirs, files in os.walk(top, followlinks=True):
        directories.append(root)
        count += sum(1 for f in files if f.lower().endswith(extensions))
        kept = []
        for sub in subdirs:
            path = os.path.join(root, sub)
            real = os.path.realpath(path)
            if real in seen:
                problems.append((path, _twice(seen[real])))
            else:
                seen[real] = path
                kept.append(sub)
        subdirs[:] = kept
    return sorted(directories), count


def _twice(first: str) -> str:
    return (
        f"a link to {first}, a directory already read: a symlink loop or a second link "
        "would repeat its images"
    )


def _imagefolder_samples(
    source: str, walks: list[list[str]], extensions: tuple[str, ...]
) -> Iterator[Sample]:
    for label, directories in enumerate(walks):
        for root in directories:
            # One directory's listing at a time; what os.walk calls files, in name order.
            with os.scandir(root) as listing:
                files = sorted(
                    e.name
                    for e in listing
                    if e.name.lower().endswith(extensions) and not e.is_dir()
                )
            for name in files:
                path = os.path.join(root, name)
                yield Sample(PurePath(os.path.relpath(path, source)).as_posix(), label, path, None)


def list_source(path: str, root: str | None, classes: Sequence[str] | None) -> Source:
    """A list file: checked whole first (count, labels), then read again line by line.

    A label is a line's last field: every label an integer index (classes
    ``str(k)`` for ``0..max`` unless ``classes`` names them), or every label a
    class name (classes sorted, as ImageFolder sorts its directories, unless
    ``classes`` gives them). Only the distinct names are kept between the reads.
    """
    base = os.path.dirname(os.path.abspath(path)) if root is None else root
    total, top, names = 0, -1, set[str]()
    given = None if classes is None else set(classes)
    first: tuple[int, str, bool] | None = None  # line number, line, label is an index
    for _, label, by_index, number, line in _list_lines(path):
        if first is None:
            first = (number, line, by_index)
        elif by_index != first[2]:
            raise ValueError(_mixed_labels(path, number, line, first))
        total += 1
        if by_index:
            top = max(top, _label_index(path, number, int(label), classes))
        elif given is None:
            names.add(label)
        elif label not in given:
            raise ValueError(
                f"{path}, line {number}: class {label!r} is not one of the {len(given)} "
                "classes given; add it to classes=, or leave classes= out to take the file's names"
            )
    if first is not None and not first[2]:
        classes = sorted(names) if classes is None else classes
        codes: dict[str, int] | None = {name: k for k, name in enumerate(classes)}
    else:
        classes = [str(k) for k in range(top + 1)] if classes is None else classes
        codes = None
    return Source(tuple(classes), total, _list_samples(path, base, classes, codes))


def _list_samples(
    path: str, base: str, classes: Sequence[str], codes: dict[str, int] | None
) -> Iterator[Sample]:
    for name, label, by_index, number, _ in _list_lines(path):
        if by_index and codes is None:
            k = _label_index(path, number, int(label), classes)
        elif codes is not None and (found := codes.get(label)) is not None:
            k = found
        else:  # the file changed since it was checked
            raise ValueError(
                f"{path}, line {number}: label {label!r} does not fit the labels read before "
                "(the file changed during the build?); build again"
            )
        yield Sample(name, k, os.path.join(base, name), None)


def _label_index(path: str, number: int, k: int, classes: Sequence[str] | None) -> int:
    if k < 0 or (classes is not None and k >= len(classes)):
        raise ValueError(
            f"{path}, line {number}: label {k} is negative or beyond "
            f"the {len(classes or ())} classes given"
        )
    return k


def _mixed_labels(path: str, number: int, line: str, first: tuple[int, str, bool]) -> str:
    name, index = "a class name", "an integer label"
    this, that = (name, index) if first[2] else (index, name)
    return (
        f"{path}, line {number}: {line!r} has {this}, but line {first[0]} ({first[1]!r}) "
        f"has {that}; write every label as a class name or every label as an integer "
        "index, not both"
    )


def _list_lines(path: str) -> Iterator[tuple[str, str, bool, int, str]]:
    """``(path, label, label is an index, line number, line)`` of each line with a sample."""
    with open(path, encoding="utf-8-sig") as lines:
        for number, line in enumerate(map(str.strip, lines), 1):
            if not line or line.startswith("#"):
                continue
            match = _LIST_LINE.fullmatch(line)
            if match is None:
                raise ValueError(
                    f"{path}, line {number}: expected 'path,label' or 'path label' (the "
                    f"label last: an integer index or a class name), got {line!r}"
                )
            index = match["index"]
            yield match["path"], index or match["name"], index is not None, number, line


def parquet_source(
    source: str, image_column: str, label_column: str, classes: Sequence[str] | None
) -> Source:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = (
        sorted(glob(os.path.join(escape(source), "*.parquet")))
        if os.path.isdir(source)
        else [source]
    )
    if not paths:
        raise FileNotFoundError(f"{source}: no *.parquet files in this directory")
    files = [pq.ParquetFile(p) for p in paths]
    parts = []
    for path, file in zip(paths, files, strict=True):
        schema = file.schema_arrow
        missing = sorted({image_column, label_column} - set(schema.names))
        if missing:
            raise ValueError(
                f"{path}: no column(s) {missing}; it has {schema.names} "
                "(pass image_column= / label_column=, --image-column / --label-column)"
            )
        kind = schema.field(image_column).type
        if not (
            pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)
            or (pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0)
        ):
            raise ValueError(
                f"{path}: column {image_column!r} has type {kind}; expected binary "
                "or a struct with a 'bytes' field"
            )
        # Only the label column: string labels need every name before the first sample.
        column = file.read(columns=[label_column]).column(0).combine_chunks()
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        parts.append(column)
    names, labels = _parquet_labels(source, parts, classes)
    rows = _parquet_rows(paths, files, image_column)
    samples = (s._replace(label=int(k)) for s, k in zip(rows, labels, strict=True))
    return Source(tuple(names), len(labels), samples)


def _parquet_labels(
    source: str, parts: list[Any], classes: Sequence[str] | None
) -> tuple[list[str], np.ndarray]:
    """Class names and an int64 label per row (8 bytes a row, not a Python object)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = any(pa.types.is_string(p.type) or pa.types.is_large_string(p.type) for p in parts)
    for part in parts:  # the index stores int64: a larger label is refused, not wrapped
        if pa.types.is_uint64(part.type) and (top := pc.max(part).as_py()) and top >= 2**63:
            raise ValueError(
                f"{source}: a label is {top}, not one of the classes (labels are class "
                f"indices, 0..number of classes - 1)"
            )
    column = pa.chunked_array([p.cast(pa.large_string() if text else pa.int64()) for p in parts])
    if text:
        found = pc.unique(column.drop_null()).to_pylist()
        names = list(classes) if classes is not None else sorted(v for v in found if v)
        codes = pc.index_in(column, value_set=pa.array(names, pa.large_string()))
    else:
        top = pc.max(column).as_py()
        top = -1 if top is None else top
        names = list(classes) if classes is not None else [str(k) for k in range(top + 1)]
        codes = column
    labels = codes.to_numpy(zero_copy_only=False) if not codes.null_count else None
    if labels is None or (labels.size and (labels.min() < 0 or labels.max() >= len(names))):
        valid = pc.and_(
            pc.is_valid(codes), pc.and_(pc.greater_equal(codes, 0), pc.less(codes, len(names)))
        )
        row = pc.index(pc.fill_null(valid, False), False).as_py()
        raise ValueError(
            f"{source}: row {row} (counting across files) has label "
            f"{column[row].as_py()!r}, not one of the {len(names)} classes {names[:10]}"
        )
    return names, labels.astype(np.int64, copy=False)


def _parquet_rows(paths: list[str], files: list[Any], image_column: str) -> Iterator[Sample]:
    for path, file in zip(paths, files, strict=True):
        row = 0
        # Record batches: a file's images are never all in memory at once.
        for batch in file.iter_batches(batch_size=256, columns=[image_column]):
            column = batch.column(0)
            if hasattr(column, "field"):  # {bytes, path} struct
                images = column.field("bytes").to_pylist()
                has_path = column.type.get_field_index("path") >= 0
                names = column.field("path").to_pylist() if has_path else [None] * len(images)
            else:
                images, names = column.to_pylist(), [None] * len(column)
            for i, (data, name) in enumerate(zip(images, names, strict=True), row):
                yield Sample(name or f"{os.path.basename(path)}#{i}", -1, None, data or b"")
            row += len(images)
