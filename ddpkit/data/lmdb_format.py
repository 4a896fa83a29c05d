"""The ddpkit LMDB format, version 1: raw image bytes under index keys, an Arrow index.

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
run code. The full specification is ``docs/lmdb-format.md``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lmdb
import numpy as np
import pyarrow as pa

from ddpkit._version import __version__

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_KEY",
    "LMDBFormatError",
    "LMDBIndex",
    "decode_index",
    "encode_index",
    "open_env",
    "read_index",
    "sample_key",
    "shared_env",
]

FORMAT_NAME = "ddpkit-lmdb"
FORMAT_VERSION = 1
INDEX_KEY = b"__ddpkit_index__"
# The keys of the pickled layout written by the widely copied folder2lmdb.py.
LEGACY_KEYS = (b"__keys__", b"__len__")

_KEY = struct.Struct(">Q")


class LMDBFormatError(ValueError):
    """A path is not a ddpkit LMDB that this version can read; the message says what to do."""


def sample_key(index: int) -> bytes:
    """The key of sample ``index``: 8 bytes, big-endian, so keys sort in index order."""
    return _KEY.pack(index)


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
    label_array = np.asarray(labels, dtype=np.int64)
    if label_array.size and (label_array.min() < 0 or label_array.max() >= len(classes)):
        raise ValueError(
            f"labels must lie in 0..{len(classes) - 1} for {len(classes)} classes, got "
            f"{int(label_array.min())}..{int(label_array.max())}"
        )
    data: dict[str, Any] = {"label": pa.array(label_array, type=pa.int64())}
    for name, values in (columns or {}).items():
        if len(values) != len(label_array):
            raise ValueError(
                f"index column {name!r} has {len(values)} values for {len(label_array)} samples"
            )
        data[name] = pa.array(values)
    meta = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "classes": json.dumps(list(classes)),
        "num_samples": str(len(label_array)),
        "ddpkit_version": __version__,
        **(metadata or {}),
    }
    table = pa.table(data).replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


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
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
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
    classes = tuple(json.loads(meta["classes"]))
    # Copy: the record may live in a memory map that closes with its environment.
    labels = table.column("label").to_numpy().astype(np.int64, copy=True)
    if str(len(labels)) != meta.get("num_samples"):
        raise LMDBFormatError(
            f"{source}: the index lists {len(labels)} labels but says num_samples="
            f"{meta.get('num_samples')}; the database is damaged, rebuild it"
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


def open_env(path: str | os.PathLike[str], *, readahead: bool = False) -> lmdb.Environment:
    """Open a database read-only, without locks, as many processes may at once.

    ``lock=False`` keeps readers out of LMDB's reader table, so any number of
    ranks x DataLoader workers can read without ``MDB_READERS_FULL``; it is
    safe because a finished database is never written again.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        LMDBFormatError: ``path`` is not an LMDB database.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path}: no such LMDB database (build one with `ddpkit lmdb build SOURCE {path}`)"
        )
    subdir = os.path.isdir(path)
    if subdir and not os.path.exists(os.path.join(path, "data.mdb")):
        raise LMDBFormatError(
            f"{path}: a directory without data.mdb is not an LMDB database (an interrupted "
            "build never takes the final name, so this is something else)"
        )
    try:
        return lmdb.open(
            path,
            subdir=subdir,
            readonly=True,
            lock=False,
            readahead=readahead,
            meminit=False,
            max_readers=1024,
        )
    except lmdb.InvalidError as exc:
        raise LMDBFormatError(f"{path}: not an LMDB database ({exc})") from exc


# One environment per database per process: py-lmdb refuses to open a path
# twice in one process, and datasets over the same file must share it.
# Entries are (pid, env); an entry inherited through fork() is replaced.
_SHARED: dict[str, tuple[int, lmdb.Environment]] = {}


def shared_env(path: str | os.PathLike[str], *, readahead: bool = False) -> lmdb.Environment:
    """This process's environment for ``path``, opened on first use.

    After ``fork()`` the parent's environment must not be used (LMDB's rule)
    and still blocks a new open of the same path (py-lmdb's rule): it is
    closed in the child (which leaves the parent's untouched) and reopened.
    """
    key = os.path.realpath(path)
    entry = _SHARED.get(key)
    if entry is not None:
        pid, env = entry
        if pid == os.getpid():
            return env
        env.close()  # inherited through fork: drop the child's copy
    env = open_env(path, readahead=readahead)
    _SHARED[key] = (os.getpid(), env)
    return env


@contextmanager
def _env_for_reading(path: str | os.PathLike[str]) -> Iterator[lmdb.Environment]:
    """The shared environment if this process has one, else a short-lived one."""
    entry = _SHARED.get(os.path.realpath(path))
    if entry is not None and entry[0] == os.getpid():
        yield entry[1]
        return
    env = open_env(path)
    try:
        yield env
    finally:
        env.close()


def read_index(path: str | os.PathLike[str], *, columns: Sequence[str] = ()) -> LMDBIndex:
    """Read the index of the database at ``path``, closing the environment afterwards.

    Raises:
        FileNotFoundError: no such path.
        LMDBFormatError: not an LMDB, no ddpkit index (the message says how to
            convert a folder2lmdb database), or an unreadable or newer index.
    """
    path = os.fspath(path)
    with _env_for_reading(path) as env, env.begin(buffers=True) as txn:
        record = txn.get(INDEX_KEY)
        if record is None:
            raise LMDBFormatError(_no_index_message(path, txn))
        return decode_index(record, source=path, columns=columns)


def _no_index_message(path: str, txn: lmdb.Transaction) -> str:
    if all(txn.get(key) is not None for key in LEGACY_KEYS):
        return (
            f"{path}: this is a folder2lmdb-style database (pickled __keys__/__len__ records), "
            "not a ddpkit one. Rebuild it from the images with `ddpkit lmdb build`, or read "
            "it once with LazyLMDBDataset.from_legacy(path, allow_pickle=True) - only for "
            "files you trust, since unpickling can run code."
        )
    return (
        f"{path}: an LMDB database without a ddpkit index record ({INDEX_KEY!r}); build it "
        "with `ddpkit lmdb build SOURCE OUTPUT` (ImageFolder tree, list file or Parquet)."
    )
