"""Open ddpkit LMDB files safely and read their index (the format itself: ``lmdb_index``).

Every open checks the data file against its own header first, so a truncated
copy is an error naming the file instead of a SIGBUS; each process keeps one
read-only environment per database file, reopened after ``fork`` or when the
file was replaced.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lmdb

from ddpkit import _graveyard
from ddpkit.data.lmdb_index import (
    INDEX_KEY,
    LEGACY_KEYS,
    LMDBFormatError,
    LMDBIndex,
    decode_index,
)

__all__ = [
    "EnvHandle",
    "Identity",
    "check_data_file",
    "data_file",
    "env_for_reading",
    "identity",
    "is_lmdb",
    "open_env",
    "read_index",
    "shared_env",
    "shared_handle",
]


def open_env(path: str | os.PathLike[str], *, readahead: bool = False) -> lmdb.Environment:
    """Open a database read-only, without locks, as many processes may at once.

    ``lock=False`` keeps readers out of LMDB's reader table, so any number of
    ranks x DataLoader workers can read without ``MDB_READERS_FULL``; it is
    safe because a finished database is never written again. The data file
    is checked first (:func:`check_data_file`): LMDB trusts it, and a
    truncated copy would kill the process with SIGBUS on the first read.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message says where an
            interrupted ``--overwrite`` left the database, if it did).
        LMDBFormatError: ``path`` is not an LMDB database, or is truncated.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such LMDB database. {_left_behind(path)}")
    subdir = os.path.isdir(path)
    if subdir and not os.path.exists(os.path.join(path, "data.mdb")):
        raise LMDBFormatError(
            f"{path}: a directory without data.mdb is not an LMDB database (an interrupted "
            "build never takes the final name, so this is something else)"
        )
    check_data_file(path)
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
    except lmdb.Error as exc:
        raise LMDBFormatError(f"{path}: not a readable LMDB database ({exc})") from exc


def data_file(path: str | os.PathLike[str]) -> str:
    """The file that holds a database's pages: ``path/data.mdb``, or ``path`` itself."""
    path = os.fspath(path)
    return os.path.join(path, "data.mdb") if os.path.isdir(path) else path


def check_data_file(path: str | os.PathLike[str]) -> None:
    """Refuse a file that is not an LMDB data file, or is shorter than its own header says.

    LMDB keeps two meta pages at the start of the file; the newer one names
    the last page in use. A file shorter than that page's end is a truncated
    copy, and reading it through the memory map would kill the process with
    SIGBUS: this raises first.

    Raises:
        LMDBFormatError: no LMDB header, or truncated; the message names the
            file, the expected and the actual size, and the fix.
    """
    data = data_file(path)
    size = os.path.getsize(data)
    fix = f"Copy it again, then check it with `ddpkit lmdb verify {os.fspath(path)}`."
    with open(data, "rb") as f:
        first = _meta(f.read(_META_END))
        if first is None:
            what = "an empty file" if size == 0 else f"{size} bytes without an LMDB header"
            raise LMDBFormatError(f"{data}: {what}, not an LMDB database file. {fix}")
        psize = first[0]
        f.seek(psize)
        metas = [m for m in (first, _meta(f.read(_META_END))) if m is not None]
    _, last_page, _ = max(metas, key=lambda m: m[2])  # the newer transaction's meta
    expected = (last_page + 1) * psize
    if size < expected:
        raise LMDBFormatError(
            f"{data} is truncated: its header says the database fills {expected} bytes "
            f"({expected / 2**20:.1f} MiB), but the file has {size} ({size / 2**20:.1f} MiB); "
            f"a partial copy? {fix}"
        )


# An LMDB meta page: a 16-byte page header, then magic and version (uint32),
# the map address and size (8 + 8), two 48-byte database records (the page
# size sits in the first one's 4-byte pad), the last page number and txn id.
_META_END = 16 + 136
_LMDB_MAGIC = 0xBEEFC0DE


def _meta(page: bytes) -> tuple[int, int, int] | None:
    """``(page size, last page, txn id)`` of a meta page, or None if it is not one."""
    if len(page) < _META_END:
        return None
    magic, _version, psize = struct.unpack_from("<II16xI", page, 16)
    last_page, txnid = struct.unpack_from("<QQ", page, 16 + 120)
    if magic != _LMDB_MAGIC or psize < 512 or psize & (psize - 1):
        return None
    return psize, last_page, txnid


def is_lmdb(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is recognisably an LMDB database (a data file with an LMDB header)."""
    data = data_file(path)
    try:
        with open(data, "rb") as f:
            return _meta(f.read(_META_END)) is not None
    except OSError:
        return False


def _left_behind(path: str) -> str:
    """Where an interrupted ``--overwrite`` swap left a complete database, if it did."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        entries = sorted(os.listdir(parent or "."))
    except OSError:
        entries = []
    for entry in entries:
        if entry.startswith((f"{name}.tmp-", f"{name}.old-")):
            candidate = os.path.join(parent, entry)
            if os.path.isdir(candidate) and _complete(candidate):
                return (
                    f"An interrupted `ddpkit lmdb build --overwrite` left a database at "
                    f"{candidate}: move it back (`mv {candidate} {path}`) or build again."
                )
    return f"Build one with `ddpkit lmdb build SOURCE {path}`."


def _complete(path: str) -> bool:
    """A whole database (its index record written last is there), not a build cut short."""
    try:
        env = open_env(path)
    except (OSError, LMDBFormatError):
        return False
    try:
        with env.begin(buffers=True) as txn:
            return txn.get(INDEX_KEY) is not None
    except lmdb.Error:
        return False
    finally:
        env.close()


Identity = tuple[int, int, int, int]


def identity(path: str | os.PathLike[str], data: str | None = None) -> Identity:
    """What tells one data file from another at the same path: device, inode, size, mtime.

    ``data`` is ``data_file(path)`` when the caller has it (one ``stat`` instead of two).
    """
    st = os.stat(data or data_file(path))
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


# One environment per database file per process: py-lmdb refuses to open a path
# twice in one process, and datasets over the same file must share it. One inherited
# through fork(), or whose file was replaced (a rebuild with --overwrite), is closed
# and opened again.
@dataclass(slots=True, eq=False)
class EnvHandle:
    """This process's environment for one database file, from :func:`shared_handle`.

    A holder may keep using ``env`` while :meth:`usable` says so, without
    asking :func:`shared_handle` again: the handle stops being usable in a
    forked child, once its environment is closed (its file was replaced), and
    ``recheck`` seconds after its file was last looked at.
    """

    pid: int  # the process that opened it; 0 once closed
    identity: Identity  # its file's, when last looked at
    env: lmdb.Environment
    checked: float  # time.monotonic() of that look

    def usable(self, recheck: float) -> bool:
        return self.pid == _PID and time.monotonic() - self.checked < recheck


_SHARED: dict[str, EnvHandle] = {}
_SHARED_LOCK = threading.Lock()
# This process's id, kept up to date across fork: os.getpid() is a system call, and
# right after a decode one costs about 1 % of it.
_PID = os.getpid()


def _after_fork() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def shared_env(path: str | os.PathLike[str], **options: Any) -> lmdb.Environment:
    """Deprecated: ``shared_handle(path, ...).env``, which this returns (with a warning)."""
    _graveyard.deprecated(
        "ddpkit.data.lmdb_format.shared_env", "ddpkit.data.lmdb_format.shared_handle(...).env"
    )
    return shared_handle(path, **options).env


def shared_handle(
    path: str | os.PathLike[str],
    *,
    readahead: bool = False,
    key: str | None = None,
    expect: Identity | None = None,
    data: str | None = None,
    recheck: float = 0.0,
) -> EnvHandle:
    """This process's environment for ``path`` (:class:`EnvHandle`), opened on first use; safe
    from any thread.

    After ``fork()`` the parent's environment must not be used (LMDB's rule)
    and still blocks a new open of the same path (py-lmdb's rule): it is
    closed in the child (which leaves the parent's untouched) and reopened.

    Args:
        path: the database.
        readahead: for a new environment, as in :func:`open_env`.
        key: ``os.path.realpath(path)``, if the caller has it already.
        expect: the file's :func:`identity` when the caller read its index;
            a different file now is an ``LMDBFormatError``.
        data: ``data_file(path)``, if the caller has it already.
        recheck: trust the file's identity read less than this many seconds
            ago instead of a ``stat`` now (0: look every call; the dataset
            passes 0.01).
    """
    key = key or os.path.realpath(path)
    entry = _SHARED.get(key)
    if entry is not None and entry.pid == _PID:
        if time.monotonic() - entry.checked < recheck and expect in (None, entry.identity):
            return entry  # its file looked at a moment ago: trusted
    else:
        entry = None  # none yet, or inherited through fork (closed below, under the lock)
    looked, now = time.monotonic(), identity(path, data)
    if expect is not None and now != expect:
        raise LMDBFormatError(
            f"{os.fspath(path)} was replaced (rebuilt or copied over) after this dataset read "
            "its index; create the dataset again to read the new database"
        )
    if entry is not None and entry.identity == now:
        entry.checked = looked
        return entry  # the common case, without the lock
    with _SHARED_LOCK:  # threads reading first at once must not open the file twice
        entry = _SHARED.get(key)
        if entry is not None:
            if entry.pid == _PID and entry.identity == now:
                return entry
            entry.env.close()  # inherited through fork, or its file was replaced
            entry.pid = 0  # no holder uses it again
            del _SHARED[key]
        entry = _SHARED[key] = EnvHandle(_PID, now, open_env(path, readahead=readahead), looked)
        return entry


@contextmanager
def env_for_reading(path: str | os.PathLike[str]) -> Iterator[lmdb.Environment]:
    """The shared environment if this process has one for this path, else a short-lived one.

    An environment inherited through ``fork``, or one whose file was replaced,
    still blocks a new open of the path: it is closed and the shared one
    reopened.
    """
    key = os.path.realpath(path)
    if key in _SHARED:
        yield shared_handle(path, key=key).env
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
    with env_for_reading(path) as env, env.begin(buffers=True) as txn:
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


def __getattr__(name: str) -> Any:
    return _graveyard.moved_name(__name__, name)
