"""Where ``build_lmdb`` reads samples from: an ImageFolder tree, a list file, Parquet files.

Each reader returns the class names, the sample count and an iterable of
samples in source order (the order that becomes the database's index order).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from glob import escape, glob
from pathlib import PurePath
from typing import Any, NamedTuple

__all__ = [
    "Sample",
    "Source",
    "detect_format",
    "imagefolder_source",
    "list_source",
    "parquet_source",
]

_LIST_LINE = re.compile(r"(?P<path>.+?)\s*[,\t ]\s*(?P<label>[+-]?\d+)")


class Sample(NamedTuple):
    """One image to store: its name for the index, its label, and where its bytes are."""

    name: str  # the index's ``path`` column entry
    label: int
    file: str | None  # read by a worker thread ...
    data: bytes | None  # ... unless the bytes are already here (Parquet, verify)


class Source(NamedTuple):
    """What a reader found: class names, how many samples, and the samples in order."""

    classes: tuple[str, ...]
    total: int
    samples: Iterable[Sample]


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


def imagefolder_source(source: str) -> Source:
    # torchvision's own discovery, so classes and order are ImageFolder's exactly.
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    names, class_to_idx = find_classes(source)
    found = make_dataset(source, class_to_idx, extensions=IMG_EXTENSIONS)
    samples = [
        Sample(PurePath(os.path.relpath(path, source)).as_posix(), label, path, None)
        for path, label in found
    ]
    return Source(tuple(names), len(samples), samples)


def list_source(path: str, root: str | None, classes: Sequence[str] | None) -> Source:
    base = os.path.dirname(os.path.abspath(path)) if root is None else root
    samples = []
    with open(path, encoding="utf-8-sig") as lines:
        for number, line in enumerate(map(str.strip, lines), 1):
            if not line or line.startswith("#"):
                continue
            match = _LIST_LINE.fullmatch(line)
            if match is None:
                raise ValueError(
                    f"{path}, line {number}: expected 'path,label' or 'path label' "
                    f"with an integer label, got {line!r}"
                )
            label = int(match["label"])
            if label < 0 or (classes is not None and label >= len(classes)):
                raise ValueError(
                    f"{path}, line {number}: label {label} is negative or beyond "
                    f"the {len(classes or ())} classes given"
                )
            samples.append(Sample(match["path"], label, os.path.join(base, match["path"]), None))
    if classes is None:
        classes = [str(k) for k in range(max((s.label for s in samples), default=-1) + 1)]
    return Source(tuple(classes), len(samples), samples)


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
    values = []
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
        column = file.read(columns=[label_column]).column(0)
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        values += column.to_pylist()
    if any(isinstance(v, str) for v in values):
        names = list(classes) if classes is not None else sorted({v for v in values if v})
        position = {name: k for k, name in enumerate(names)}
        labels = [position.get(v, -1) for v in values]
    else:
        labels = values
        top = max((v for v in labels if isinstance(v, int)), default=-1)
        names = list(classes) if classes is not None else [str(k) for k in range(top + 1)]
    for row, (value, label) in enumerate(zip(values, labels, strict=True)):
        if not isinstance(label, int) or not 0 <= label < len(names):
            raise ValueError(
                f"{source}: row {row} (counting across files) has label {value!r}, "
                f"not one of the {len(names)} classes {names[:10]}"
            )
    rows = _parquet_rows(paths, files, image_column)
    samples = (s._replace(label=k) for s, k in zip(rows, labels, strict=True))
    return Source(tuple(names), len(labels), samples)


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
