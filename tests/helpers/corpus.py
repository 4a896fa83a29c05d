"""Shared makers for the adversarial tests: small trees, databases, dead pids, small disks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from lmdb_fixtures import encode, photo

from ddpkit.files import temp_path


def image_tree(root: Path, per_class: int = 3, classes: int = 2) -> Path:
    """An ImageFolder tree of small real JPEGs: ``root/c<k>/<i>.jpg``."""
    for k in range(classes):
        for i in range(per_class):
            path = root / f"c{k}" / f"{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encode(photo(10 * k + i, (40, 32))))
    return root


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or ``path`` itself) with its bytes: to prove nothing changed."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    return int(done.stdout)


def leftover_name(target: Path, kind: str, pid: int, *, hidden: bool = False) -> Path:
    """What ddpkit names a temporary of ``target``, but for process ``pid`` of this host."""
    fresh = temp_path(target, kind, hidden=hidden).name  # <name>.<kind>-<host>-<pid>-<tag>
    head, tag = fresh.rsplit("-", 1)
    stem = head.rsplit("-", 1)[0]  # without this process's pid
    return target.parent / f"{stem}-{pid}-{tag}"


@contextlib.contextmanager
def small_disk(tmp_path: Path, size: str = "1m") -> Iterator[Path | None]:
    """A tmpfs of ``size`` mounted in ``tmp_path``; None where this machine cannot mount one."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        yield None
        return
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True)  # fmt: skip
    if made.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
