"""ddpkit.data.build_output: which outputs a build may take, and swapping a database into place."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lmdb_fixtures import write_db

import ddpkit.data.build_output as build_output
from ddpkit.data.build_output import check_output, move_into_place, temp_output
from ddpkit.data.lmdb_format import read_index
from ddpkit.files import exchange


def _db(path: Path, classes: list[str]) -> Path:
    return write_db(path, [b"img"] * len(classes), list(range(len(classes))), classes)


def _source(tmp_path: Path) -> str:
    source = tmp_path / "images"
    source.mkdir(exist_ok=True)
    return str(source)


def test_a_new_path_or_an_lmdb_with_overwrite_is_accepted(tmp_path: Path) -> None:
    source = _source(tmp_path)
    check_output(source, str(tmp_path / "new.lmdb"), overwrite=False)
    db = _db(tmp_path / "db", ["a"])
    check_output(source, str(db), overwrite=True)
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        check_output(source, str(db), overwrite=False)


@pytest.mark.parametrize("contents", [None, "notes.txt"])
def test_a_directory_without_data_mdb_is_never_replaced(
    tmp_path: Path, contents: str | None
) -> None:
    output = tmp_path / "out"
    output.mkdir()
    if contents is not None:
        (output / contents).write_text("keep")
    with pytest.raises(FileExistsError, match=r"a directory without data\.mdb"):
        check_output(_source(tmp_path), str(output), overwrite=True)


def test_an_empty_data_mdb_is_not_an_lmdb(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    (output / "data.mdb").write_bytes(b"")
    with pytest.raises(FileExistsError, match="has no LMDB header"):
        check_output(_source(tmp_path), str(output), overwrite=True)


def test_the_temporary_output_is_a_fresh_name_beside_the_output(tmp_path: Path) -> None:
    output = str(tmp_path / "db.lmdb")
    first, second = temp_output(output), temp_output(output)
    assert first != second
    assert os.path.dirname(first) == str(tmp_path)
    assert os.path.basename(first).startswith("db.lmdb.tmp-")


def test_a_new_database_takes_the_free_name(tmp_path: Path) -> None:
    output = str(tmp_path / "db")
    tmp = temp_output(output)
    _db(Path(tmp), ["new"])
    move_into_place(tmp, _source(tmp_path), output, overwrite=False)
    assert read_index(output).classes == ("new",)
    assert not os.path.exists(tmp)


def _dead_leftover(output: str) -> Path:
    pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    head, tag = os.path.basename(temp_output(output)).rsplit("-", 1)
    leftover = Path(output).parent / f"{head.rsplit('-', 1)[0]}-{pid}-{tag}"
    _db(leftover, ["killed"])
    return leftover


@pytest.mark.parametrize("atomic", [True, False])
def test_an_old_database_is_replaced_and_leftovers_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    if not atomic:  # a file system without renameat2(RENAME_EXCHANGE): two renames
        monkeypatch.setattr(build_output, "exchange", lambda a, b: False)
    output = str(_db(tmp_path / "db", ["old"]))
    leftover = _dead_leftover(output)
    tmp = temp_output(output)
    _db(Path(tmp), ["new"])
    move_into_place(tmp, _source(tmp_path), output, overwrite=True)
    assert read_index(output).classes == ("new",)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db", "images"]
    assert not leftover.exists()


def test_what_the_swap_took_out_is_put_back_if_it_is_not_a_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = _db(tmp_path / "db", ["old"])
    tmp = temp_output(str(output))
    _db(Path(tmp), ["new"])
    # The check passed, then the user put a file of theirs in the old database.
    monkeypatch.setattr(build_output, "check_output", lambda *args: None)
    (output / "results.csv").write_text("keep me")
    if not exchange(tmp, output) or not exchange(tmp, output):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this file system")
    with pytest.raises(FileExistsError, match="changed during the build"):
        move_into_place(tmp, _source(tmp_path), str(output), overwrite=True)
    assert (output / "results.csv").read_text() == "keep me"
    assert read_index(output).classes == ("old",)
    assert read_index(tmp).classes == ("new",)
