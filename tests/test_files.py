"""ddpkit.files: temporary names, dead writers' leftovers, no-replace renames, full disks."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.files import (
    exchange,
    is_no_space,
    is_quota,
    no_space,
    remove_stale,
    rename_new,
    temp_path,
)


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True)  # fmt: skip
    return int(done.stdout)


def _as_pid(path: Path, pid: int) -> Path:
    """``path`` (a :func:`temp_path` name) as process ``pid`` of this host would have named it."""
    head, tag = path.name.rsplit("-", 1)
    return path.parent / f"{head.rsplit('-', 1)[0]}-{pid}-{tag}"


def test_temp_names_are_fresh_beside_the_target_and_say_who_made_them(tmp_path: Path) -> None:
    target = tmp_path / "db"
    first, second = temp_path(target), temp_path(target)
    assert first != second
    assert first.parent == second.parent == tmp_path
    assert first.name.startswith("db.tmp-")
    assert f"-{os.getpid()}-" in first.name
    hidden = temp_path(target, "old", hidden=True)
    assert hidden.name.startswith(".db.old-")


def test_only_dead_writers_leftovers_of_this_target_are_removed(tmp_path: Path) -> None:
    target, pid = tmp_path / "db", _dead_pid()
    dead = _as_pid(temp_path(target), pid)
    dead.mkdir()
    (dead / "data.mdb").write_bytes(b"x")
    dead_old = _as_pid(temp_path(target, "old"), pid)
    dead_old.write_bytes(b"x")
    mine = temp_path(target)  # this process: a write in progress
    mine.write_bytes(b"x")
    other_target = _as_pid(temp_path(tmp_path / "db2"), pid)
    other_target.write_bytes(b"x")
    hidden = _as_pid(temp_path(target, hidden=True), pid)
    hidden.write_bytes(b"x")
    foreign = tmp_path / f"db.tmp-otherhost.00000000-{pid}-0123abcd"
    foreign.write_bytes(b"x")  # another node sharing the directory: never ours to judge
    unrelated = tmp_path / "db.tmp-notes"
    unrelated.write_bytes(b"x")

    assert sorted(remove_stale(target)) == sorted([dead, dead_old])
    assert not dead.exists()
    assert not dead_old.exists()
    for kept in (mine, other_target, hidden, foreign, unrelated):
        assert kept.exists(), kept
    assert remove_stale(target, hidden=True) == [hidden]
    assert remove_stale(target) == []


def test_remove_stale_in_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert remove_stale(tmp_path / "nowhere" / "db") == []


def test_rename_new_never_replaces_what_is_there(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("new")
    rename_new(a, b)
    assert b.read_text() == "new"
    assert not a.exists()
    a.write_text("newer")
    with pytest.raises(FileExistsError):
        rename_new(a, b)
    assert (a.read_text(), b.read_text()) == ("newer", "new")
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "missing")  # a dangling link is something too
    with pytest.raises(FileExistsError):
        rename_new(a, link)
    with pytest.raises(FileNotFoundError):
        rename_new(tmp_path / "missing", tmp_path / "c")


def test_exchange_swaps_two_files_or_says_it_cannot(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("a")
    b.write_text("b")
    if not exchange(a, b):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this file system")
    assert (a.read_text(), b.read_text()) == ("b", "a")


def test_full_disks_and_quotas_are_recognised_even_wrapped() -> None:
    assert is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert is_no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_no_space(RuntimeError("lmdb: mdb_put: No space left on device"))
    assert not is_no_space(OSError(errno.EACCES, "Permission denied"))
    assert not is_no_space(ValueError(""))
    assert is_quota(OSError(errno.EDQUOT, "x"))
    assert is_quota(RuntimeError("Disk quota exceeded"))
    assert not is_quota(OSError(errno.ENOSPC, "No space left on device"))


def test_no_space_names_the_file_the_room_needed_and_free(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.pth"
    error = no_space(target, 3 * 2**20)
    assert error.errno == errno.ENOSPC
    text = str(error)
    assert str(target) in text
    assert "about 3.0 MiB needed" in text
    assert " free. Free some space" in text
    assert is_no_space(error)
    assert not is_quota(error)
    small = str(no_space(target, 512))
    assert "about 0.5 KiB needed" in small
    unknown = str(no_space(target, None))
    assert "needed" not in unknown
    quota = no_space(target, 2**20, quota=True)
    assert quota.errno == errno.EDQUOT
    assert "quota is full" in str(quota)
    assert is_quota(quota)
    # A directory that does not exist (gone since): no free figure, still an answer.
    assert "0.0 KiB free" in str(no_space(tmp_path / "gone" / "x.pth", 10))
