"""Writing files so nothing half-done looks complete: temporary names, stale leftovers, full disks.

Checkpoints and databases are written under a temporary name beside their
target and renamed into place when complete. The temporary name carries the
host and process id, so a later write into the same directory can remove
what a killed process left behind, and only that; a full disk becomes an
``OSError`` that says how much room was needed and how much there is.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import sys
from pathlib import Path

__all__ = [
    "exchange",
    "is_no_space",
    "is_quota",
    "no_space",
    "remove_stale",
    "rename_new",
    "temp_path",
]


def _host_tag() -> str:
    """This host's name, plus a digest of its boot and PID namespace.

    Two containers can share a host name (host networking) while their
    processes live in different PID namespaces: a pid seen dead from one may
    be a live writer in the other. The digest tells them apart.
    """
    name = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    parts = []
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(
                os.readlink(source) if source.endswith("pid") else Path(source).read_text()
            )
        except OSError:
            parts.append("")
    return f"{name}.{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:8]}"


_HOST = _host_tag()
_LEFTOVER = re.compile(r"^(?P<target>.+)\.(?:tmp|old)-(?P<host>[^-]+)-(?P<pid>\d+)-[0-9a-f]{8}$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def temp_path(target: str | os.PathLike[str], kind: str = "tmp", *, hidden: bool = False) -> Path:
    """A fresh name beside ``target``: ``[.]<name>.<kind>-<host>-<pid>-<random>``."""
    target = Path(target)
    dot = "." if hidden else ""
    tag = f"{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    return target.parent / f"{dot}{target.name}.{tag}"


def remove_stale(target: str | os.PathLike[str], *, hidden: bool = False) -> list[Path]:
    """Remove what killed writers of ``target`` on this host left beside it; return what went.

    Only names that :func:`temp_path` makes for ``target`` count, and only
    those of processes of this host that no longer run: a write in progress,
    here or on another node sharing the directory, is never touched.
    """
    target = Path(target)
    prefix = ("." if hidden else "") + target.name
    removed: list[Path] = []
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _LEFTOVER.match(entry.name)
        if match is None or match["target"] != prefix or match["host"] != _HOST:
            continue
        if _alive(int(match["pid"])):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def rename_new(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
    """Rename ``a`` to ``b`` only if nothing is at ``b``, in one step where Linux allows.

    Raises:
        FileExistsError: something is at ``b`` (it is left as it was).
    """
    if _renameat2(a, b, _RENAME_NOREPLACE):
        return
    if os.path.lexists(b):  # without renameat2: a short window remains between check and rename
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(b))
    os.rename(a, b)


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Swap two existing paths in one atomic step; False where the system cannot.

    Linux's ``renameat2(RENAME_EXCHANGE)``: at every moment each name holds
    one of the two, so a kill in the middle of a swap loses nothing. Other
    systems, and file systems without it (NFS), return False: the caller
    renames in two steps instead.
    """
    return _renameat2(a, b, _RENAME_EXCHANGE)


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(a: str | os.PathLike[str], b: str | os.PathLike[str], flags: int) -> bool:
    """``renameat2(a, b, flags)``: True when done, False where unsupported, else ``OSError``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc before 2.28, musl
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    error = FileExistsError if code == errno.EEXIST else OSError
    raise error(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (an ``OSError``, or a library's error wrapping one) means a full disk."""
    if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
        return True
    text = str(exc).lower()
    return "no space left" in text or "disk quota exceeded" in text


def is_quota(exc: BaseException) -> bool:
    """Whether ``exc`` means a full quota rather than a full disk."""
    if isinstance(exc, OSError) and exc.errno == errno.EDQUOT:
        return True
    return "quota" in str(exc).lower()


def no_space(path: str | os.PathLike[str], needed: int | None, *, quota: bool = False) -> OSError:
    """The ``OSError(ENOSPC)`` for ``path``: the file system, the room needed, the room free."""
    directory = Path(path).parent
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = 0
    need = f"about {_size(needed, up=True)} needed, " if needed else ""
    if quota:
        return OSError(
            errno.EDQUOT,
            f"Disk quota exceeded on {_mount_point(directory)} for {os.fspath(path)}: {need}"
            "your quota is full (`quota -s` shows it). Free some of it, or write somewhere "
            "else; the previous file, if any, is unchanged",
        )
    return OSError(
        errno.ENOSPC,
        f"No space left on {_mount_point(directory)} for {os.fspath(path)}: {need}"
        f"{_size(free)} free. Free some space, or write somewhere else; the previous "
        "file, if any, is unchanged",
    )


def _size(n: int, *, up: bool = False) -> str:
    """``n`` bytes in MiB or KiB to one decimal; ``up``: never less than ``n`` (room needed)."""
    unit, name = (2**20, "MiB") if n >= 2**20 else (2**10, "KiB")
    tenths = -(-n * 10 // unit) if up else round(n * 10 / unit)
    return f"{tenths / 10:.1f} {name}"


def _mount_point(directory: Path) -> str:
    path = directory.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return os.fspath(path)
