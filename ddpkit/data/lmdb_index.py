"""The ddpkit LMDB format, version 1, on paper: sample keys and the Arrow index record.

Layout of one database (an LMDB environment directory, or a single file):

* sample ``i`` is stored under the key ``i`` as 8 bytes, big-endian (so the
  B-tree's order is the index order and the builder appends); the value is the
  image file's encoded bytes (JPEG, PNG, WebP ...), exactly as read unless the
  builder was asked to re-encode;
* the record :data:`INDEX_KEY` holds an Arrow IPC stream: a table with an
  ``int64`` column ``label`` and optional per-sample columns (``path`` ...),
  whose schema metadata names the format, its version, the class names and the
  sample count.

Nothing in it is pickled: opening a database from an untrusted source cannot
run code. :func:`decode_index` checks everything :func:`encode_index`
guarantees. The full specification is ``docs/lmdb-format.md``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ddpkit._version import __version__

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_KEY",
    "LEGACY_KEYS",
    "LMDBFormatError",
    "LMDBIndex",
    "decode_index",
    "encode_index",
    "encode_index_buffer",
    "sample_key",
]

FORMAT_NAME = "ddpkit-lmdb"
FORMAT_VERSION = 1
INDEX_KEY = b"__ddpkit_index__"
# The keys of the pickled layout written by the widely copied folder2lmdb.py.
LEGACY_KEYS = (b"__keys__", b"__len__")

_KEY = struct.Struct(">Q")


class LMDBFormatError(ValueError):
    """A path is not a ddpkit LMDB that this version can read; the message says what to do."""


# The key of sample ``index``: 8 bytes, big-endian, so keys sort in index order. The
# Struct's own method, not a function around it: the dataset calls it for every item,
# where a Python frame more costs a tenth of a percent.
sample_key: Callable[[int], bytes] = _KEY.pack


@dataclass(frozen=True)
class LMDBIndex:
    """What the index record of one database says.

    Attributes:
        labels: ``int64`` class index of every sample, in sample order.
        classes: class names; label ``k`` is ``classes[k]``.
        version: the format version the database was written with.
        ddpkit_version: the ddpkit version that wrote it.
        columns: the other per-sample columns that were asked for (``path`` ...).
        metadata: any further schema metadata (builder options, source).
    """

    labels: np.ndarray
    classes: tuple[str, ...]
    version: int
    ddpkit_version: str
    columns: Mapping[str, list[Any]] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.labels)


def encode_index(
    labels: Sequence[int] | np.ndarray,
    classes: Sequence[str],
    *,
    columns: Mapping[str, Sequence[Any]] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Serialise the index record: an Arrow IPC stream (no pickle).

    Raises:
        ValueError: a label outside ``0..len(classes)-1`` or a column whose
            length differs from the number of labels.
    """
    record = encode_index_buffer(labels, classes, columns=columns, metadata=metadata)
    return bytes(record.to_pybytes())


def encode_index_buffer(
    labels: Sequence[int] | np.ndarray,
    classes: Sequence[str],
    *,
    columns: Mapping[str, Sequence[Any]] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> pa.Buffer:
    """Serialise the index record, an Arrow IPC stream (no pickle), without a final copy.

    Raises:
        ValueError: a label outside ``0..len(classes)-1``, a column whose
            length differs from the number of labels, or a column or metadata
            key that would replace one of the format's own (``label``,
            ``format``, ``version``, ``classes``, ``num_samples``, ``ddpkit_version``).
    """
    reserved = sorted(
        {"format", "version", "classes", "num_samples", "ddpkit_version"} & set(metadata or {})
    )
    if "label" in (columns or {}):
        reserved.insert(0, "label (a column)")
    if reserved:
        raise ValueError(
            f"{', '.join(reserved)}: the index record's own field(s); give extra columns and "
            "metadata other names"
        )
    # Checked before the cast to int64, which would turn a uint64 label above 2**63 negative.
    if len(labels):
        given = labels if isinstance(labels, np.ndarray) else np.asarray(labels, dtype=object)
        low, high = int(given.min()), int(given.max())
        if low < 0 or high >= len(classes):
            raise ValueError(
                f"labels must lie in 0..{len(classes) - 1} for {len(classes)} classes, got "
                f"{low}..{high}"
            )
    label_array = np.asarray(labels, dtype=np.int64)
    data: dict[str, Any] = {"label": pa.array(label_array, type=pa.int64())}
    for name, values in (columns or {}).items():
        if len(values) != len(label_array):
            raise ValueError(
                f"index column {name!r} has {len(values)} values for {len(label_array)} samples"
            )
        data[name] = values if isinstance(values, pa.Array) else pa.array(values)
    meta = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "classes": json.dumps(list(classes)),
        "num_samples": str(len(label_array)),
        "ddpkit_version": __version__,
        **(metadata or {}),
    }
    table = pa.table(data).replace_schema_metadata(meta)
    # Measure first, then write into a buffer of exactly that size: a growing stream
    # would hold up to twice the record while it doubles (hundreds of MB at 10M samples).
    counter = pa.MockOutputStream()
    with pa.ipc.new_stream(counter, table.schema) as writer:
        writer.write_table(table)
    buffer = pa.allocate_buffer(counter.size())
    with pa.ipc.new_stream(pa.FixedSizeBufferWriter(buffer), table.schema) as writer:
        writer.write_table(table)
    return buffer


def decode_index(
    record: bytes | memoryview, *, source: str, columns: Sequence[str] = ()
) -> LMDBIndex:
    """Parse an index record; the label array is copied, so ``record`` may be a view into a map.

    Args:
        record: the bytes stored under :data:`INDEX_KEY`.
        source: the database path, for error messages.
        columns: further per-sample columns to load as Python lists.

    Raises:
        LMDBFormatError: not a ddpkit index, a newer or unknown version, or
            inconsistent contents.
    """
    try:
        table = pa.ipc.open_stream(pa.py_buffer(record)).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise LMDBFormatError(
            f"{source}: the index record is not readable Arrow data: {exc}"
        ) from exc
    twice = sorted({name for name in table.column_names if table.column_names.count(name) > 1})
    if twice:  # one name, two columns: which one is meant is unknown
        raise _damaged_index(
            source, f"it has more than one column named {', '.join(map(repr, twice))}"
        )
    try:
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    except UnicodeDecodeError as exc:
        raise _damaged_index(source, f"its metadata is not UTF-8 text ({exc})") from exc
    if meta.get("format") != FORMAT_NAME:
        raise LMDBFormatError(
            f"{source}: the index record says format {meta.get('format')!r}, not {FORMAT_NAME!r}"
        )
    try:
        version = int(meta.get("version", ""))
    except ValueError:
        version = -1
    if version != FORMAT_VERSION:
        newer = version > FORMAT_VERSION
        raise LMDBFormatError(
            f"{source}: ddpkit LMDB format version {meta.get('version')!r} "
            + (
                f"is newer than this ddpkit ({__version__}) reads (version {FORMAT_VERSION}): "
                "upgrade ddpkit (pip install -U ddpkit)"
                if newer
                else f"is unknown; this ddpkit reads version {FORMAT_VERSION}. Rebuild the "
                "database with `ddpkit lmdb build`"
            )
        )
    classes = _classes(meta, source)
    labels = _labels(table, source, len(classes))
    if str(len(labels)) != meta.get("num_samples"):
        raise _damaged_index(
            source, f"it lists {len(labels)} labels but says num_samples={meta.get('num_samples')}"
        )
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise LMDBFormatError(f"{source}: the index has no column(s) {missing}")
    extra = {name: table.column(name).to_pylist() for name in columns}
    known = {"format", "version", "classes", "num_samples", "ddpkit_version"}
    return LMDBIndex(
        labels=labels,
        classes=classes,
        version=version,
        ddpkit_version=meta.get("ddpkit_version", "unknown"),
        columns=extra,
        metadata={k: v for k, v in meta.items() if k not in known},
    )


def _damaged_index(source: str, what: str) -> LMDBFormatError:
    return LMDBFormatError(
        f"{source}: the index record is damaged: {what}. Rebuild the database with "
        "`ddpkit lmdb build`."
    )


def _classes(meta: Mapping[str, str], source: str) -> tuple[str, ...]:
    """The ``classes`` field: a JSON list of distinct strings."""
    if "classes" not in meta:
        raise _damaged_index(source, "it has no 'classes' field")
    try:
        classes = json.loads(meta["classes"])
    except ValueError as exc:
        raise _damaged_index(source, f"its 'classes' field is not JSON ({exc})") from exc
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        kind = type(classes).__name__
        raise _damaged_index(source, f"its 'classes' field is a {kind}, not a list of names")
    if len(set(classes)) != len(classes):
        raise _damaged_index(source, "its 'classes' field names a class twice")
    return tuple(classes)


def _labels(table: pa.Table, source: str, num_classes: int) -> np.ndarray:
    """The ``label`` column as int64, every value a class index; copied out of the map."""
    if "label" not in table.column_names:
        raise _damaged_index(source, f"it has no 'label' column (columns: {table.column_names})")
    column = table.column("label")
    if not pa.types.is_integer(column.type):
        raise _damaged_index(source, f"its 'label' column holds {column.type}, not integers")
    if column.null_count:
        raise _damaged_index(source, f"its 'label' column has {column.null_count} empty value(s)")
    # Checked in the column's own type: a uint64 label above 2**63 cast to int64
    # first would be reported as a negative number it never was.
    values = column.to_numpy()
    bad = np.flatnonzero((values < 0) | (values >= num_classes))
    if bad.size:
        first = int(bad[0])
        raise _damaged_index(
            source,
            f"sample {first} has label {values[first].item()}, outside the {num_classes} "
            f"classes (0..{num_classes - 1}); {bad.size} label(s) are out of range",
        )
    # Copy: the record may live in a memory map that closes with its environment.
    labels: np.ndarray = values.astype(np.int64, copy=True)
    return labels
