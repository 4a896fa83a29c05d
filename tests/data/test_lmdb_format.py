"""ddpkit.data.lmdb_format: checking data files, opening and sharing environments, the index."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
from pathlib import Path
from typing import Any

import lmdb
import pytest
from lmdb_fixtures import write_db

from ddpkit._graveyard import DdpkitDeprecationWarning
from ddpkit.data.lmdb_format import (
    EnvHandle,
    check_data_file,
    data_file,
    env_for_reading,
    identity,
    is_lmdb,
    open_env,
    read_index,
    shared_env,
    shared_handle,
)
from ddpkit.data.lmdb_index import INDEX_KEY, LMDBFormatError, encode_index, sample_key


def _db(path: Path, n: int = 3) -> Path:
    return write_db(
        path, [bytes([i]) * 64 for i in range(n)], [i % 2 for i in range(n)], ["a", "b"]
    )


def _single_file_db(path: Path) -> Path:
    env = lmdb.open(str(path), subdir=False, map_size=8 << 20)
    with env.begin(write=True) as txn:
        txn.put(sample_key(0), b"img")
        txn.put(INDEX_KEY, encode_index([1], ["a", "b"]))
    env.close()
    return path


def test_data_file_is_inside_a_directory_or_the_file_itself(tmp_path: Path) -> None:
    directory = _db(tmp_path / "db")
    single = _single_file_db(tmp_path / "one.lmdb")
    assert data_file(directory) == os.path.join(directory, "data.mdb")
    assert data_file(single) == str(single)
    assert is_lmdb(directory)
    assert is_lmdb(single)
    assert read_index(single).classes == ("a", "b")
    assert list(read_index(single).labels) == [1]


@pytest.mark.parametrize("content", [b"", b"\0" * 4096, b"not an lmdb" * 100])
def test_files_without_an_lmdb_header_are_told_apart(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "data.mdb"
    path.write_bytes(content)
    assert not is_lmdb(path)
    what = "an empty file" if not content else f"{len(content)} bytes without an LMDB header"
    with pytest.raises(LMDBFormatError, match=re.escape(what)):
        check_data_file(path)
    assert not is_lmdb(tmp_path / "missing")  # no exception for a missing path either


def test_a_copy_short_by_one_page_is_refused_with_both_sizes(tmp_path: Path) -> None:
    db = _db(tmp_path / "db", n=40)
    check_data_file(db)  # whole: fine
    data = Path(data_file(db))
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 4096)
    with pytest.raises(LMDBFormatError, match="is truncated") as info:
        check_data_file(db)
    message = str(info.value)
    fills = int(re.search(r"fills (\d+) bytes", message).group(1))  # type: ignore[union-attr]
    assert size - 4096 < fills <= size
    assert f"the file has {size - 4096}" in message
    assert f"ddpkit lmdb verify {db}" in message


def test_open_env_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no such LMDB database\. Build one with"):
        open_env(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LMDBFormatError, match=r"a directory without data\.mdb"):
        open_env(tmp_path / "empty")


def test_open_env_is_read_only(tmp_path: Path) -> None:
    env = open_env(_db(tmp_path / "db"))
    try:
        with pytest.raises(lmdb.ReadonlyError), env.begin(write=True) as txn:
            txn.put(b"k", b"v")
    finally:
        env.close()


def test_identity_tells_a_replaced_file_from_the_same_one(tmp_path: Path) -> None:
    db = _db(tmp_path / "db")
    first = identity(db)
    assert identity(db, data_file(db)) == first
    aside = _db(tmp_path / "other", n=5)
    os.replace(data_file(aside), data_file(db))
    assert identity(db) != first


def test_an_environment_is_one_per_file_and_refuses_a_replaced_one(tmp_path: Path) -> None:
    db = _db(tmp_path / "shared")
    before = identity(db)
    env = shared_handle(db).env
    assert shared_handle(db).env is env
    same_file = str(db) + "/"  # the same file by another spelling
    assert shared_handle(same_file, expect=before).env is env
    with env_for_reading(db) as reading:
        assert reading is env  # the shared one, not a second open of the path
    os.replace(data_file(_db(tmp_path / "new", n=7)), data_file(db))
    with pytest.raises(
        LMDBFormatError,
        match=r"was replaced \(rebuilt or copied over\) after this dataset read its index",
    ):
        shared_handle(db, expect=before)
    fresh = shared_handle(db).env  # without an expectation: the new file, opened again
    assert fresh is not env
    assert len(read_index(db)) == 7


def test_env_for_reading_closes_a_short_lived_environment(tmp_path: Path) -> None:
    db = _db(tmp_path / "once")
    with env_for_reading(db) as env, env.begin() as txn:
        assert txn.get(sample_key(0)) == b"\0" * 64
    with pytest.raises(lmdb.Error):
        env.stat()  # closed on leaving
    assert len(read_index(db)) == 3  # and the path can be opened again


def test_a_handle_is_given_up_when_its_environment_is_closed(tmp_path: Path) -> None:
    # A dataset holds its handle between looks at the file; once the file is replaced
    # and the environment reopened, the handle it held must never be used again.
    db = _db(tmp_path / "held", n=2)
    handle = shared_handle(db)
    assert shared_handle(db, recheck=60.0) is handle
    assert shared_handle(db).env is handle.env
    assert handle.usable(60.0)
    assert not handle.usable(0.0)  # past its recheck window: looked at again
    os.replace(data_file(_db(tmp_path / "other", n=5)), data_file(db))
    fresh = shared_handle(db)  # sees the new file: the old environment is closed
    assert fresh is not handle
    assert not handle.usable(60.0)
    with pytest.raises(lmdb.Error):
        handle.env.stat()
    with fresh.env.begin() as txn:
        assert txn.get(sample_key(4)) == bytes([4]) * 64


def _usable_in_a_forked_child(handle: EnvHandle) -> bool:
    # The child inherits the handle itself (it does not pickle) and answers on a pipe.
    def answer(conn: Any) -> None:
        conn.send(handle.usable(60.0))

    parent, child = mp.get_context("fork").Pipe()
    process = mp.get_context("fork").Process(target=answer, args=(child,))
    process.start()
    try:
        assert parent.poll(60), "the forked child did not answer"
        return bool(parent.recv())
    finally:
        process.join(10)


def test_a_handle_is_not_usable_after_fork(tmp_path: Path) -> None:
    # LMDB forbids a parent's environment in a forked child: a handle the child inherited
    # (inside a dataset) sends it to shared_handle, which opens its own.
    handle = shared_handle(_db(tmp_path / "forked"))
    assert handle.usable(60.0)
    assert _usable_in_a_forked_child(handle) is False
    assert handle.usable(60.0)  # the parent's is untouched


def test_shared_env_still_works_with_one_warning(tmp_path: Path) -> None:
    db = _db(tmp_path / "old")
    with pytest.warns(DdpkitDeprecationWarning, match=r"shared_env is deprecated") as said:
        env = shared_env(db, recheck=1.0)
    assert len(said) == 1
    assert env is shared_handle(db).env


def test_a_recent_look_is_trusted_and_a_replacement_seen_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dataset looks at its file (a stat) at most every 10 ms: reads in a burst share
    # one look, and a file replaced is refused at the first read after the window.
    import time

    from ddpkit import LazyLMDBDataset
    from ddpkit.data import lmdb_format

    db = _db(tmp_path / "watched", n=4)
    dataset = LazyLMDBDataset(db, decode="bytes")
    looks = []
    real = lmdb_format.identity
    monkeypatch.setattr(lmdb_format, "identity", lambda *a: looks.append(1) or real(*a))
    start = time.monotonic()
    for _ in range(200):
        dataset[1]
    elapsed = time.monotonic() - start
    assert len(looks) <= elapsed / 0.01 + 2  # not one per read
    before = identity(db)
    assert shared_handle(db, recheck=60.0, expect=before).env is shared_handle(db).env
    os.replace(data_file(_db(tmp_path / "new", n=7)), data_file(db))
    time.sleep(0.02)
    with pytest.raises(LMDBFormatError, match="was replaced"):
        dataset[1]
    with pytest.raises(LMDBFormatError, match="was replaced"):  # recheck=0: every call looks
        shared_handle(db, expect=before)
