"""Damaged databases: every one is caught and named, none kills the process, verify goes on."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import lmdb
import pyarrow as pa
import pytest
import torch
from corpus import image_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpkit.cli import main
from ddpkit.data import LazyLMDBDataset, LMDBFormatError, build_lmdb, describe_lmdb, verify_report
from ddpkit.data.images import decode_tensor
from ddpkit.data.lmdb_index import FORMAT_NAME, INDEX_KEY, decode_index, encode_index
from ddpkit.testing import DistributedTestError, run_distributed


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("db")
    db = root / "db"
    build_lmdb(image_tree(root / "imgs", per_class=20), db, progress=False)
    return db


def _open_every_way(rank: int, world_size: int, path: str) -> dict[str, str]:
    """What each reader of a database says of ``path``: its error, or "ok" (in a child)."""
    readers = {
        "dataset": lambda: LazyLMDBDataset(path)[0],
        "info": lambda: describe_lmdb(path),
        "verify": lambda: verify_report(path),
    }
    seen = {}
    for name, read in readers.items():
        try:
            read()
            seen[name] = "ok"
        except (LMDBFormatError, FileNotFoundError) as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
    return seen


def _copy(database: Path, target: Path, size: int | None, garbage: bool = False) -> Path:
    target.mkdir()
    data = (database / "data.mdb").read_bytes()
    body = data[:size] if size is not None else data
    if garbage:
        body = bytes((b * 7 + 13) % 256 for b in body)
    (target / "data.mdb").write_bytes(body)
    return target


@pytest.mark.parametrize("cut", [0, 100, 4096, 8192 + 10, 0.5, -4096, -1])
def test_a_truncated_data_file_is_named_not_a_crash(
    database: Path, tmp_path: Path, cut: float
) -> None:
    full = (database / "data.mdb").stat().st_size
    size = int(full * cut) if isinstance(cut, float) else (full + cut if cut < 0 else cut)
    copy = _copy(database, tmp_path / "copy", size)
    try:
        seen = run_distributed(_open_every_way, 1, args=(str(copy),), init=None, timeout=120)[0]
    except DistributedTestError as exc:  # a signal: the regression this test exists for
        pytest.fail(f"opening a database truncated to {size} bytes killed the process: {exc}")
    for reader, message in seen.items():
        assert message.startswith("LMDBFormatError"), (reader, message)
        assert str(copy / "data.mdb") in message
        assert "Copy it again" in message
        if size >= 8192:  # both meta pages are there: the sizes are known
            assert f"the file has {size}" in message
            assert str(full) in message  # the size the header says


def test_garbage_in_place_of_a_data_file(database: Path, tmp_path: Path) -> None:
    copy = _copy(database, tmp_path / "copy", None, garbage=True)
    seen = run_distributed(_open_every_way, 1, args=(str(copy),), init=None, timeout=120)[0]
    assert all(m.startswith("LMDBFormatError") for m in seen.values()), seen


def test_cli_names_a_truncated_copy_without_a_traceback(
    database: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = _copy(database, tmp_path / "copy", 8192 + 100)
    for command in ("info", "verify"):
        assert main(["lmdb", command, str(copy)]) == 1
        err = capsys.readouterr().err
        assert "is truncated" in err
        assert "Traceback" not in err


def _damage_pages(database: Path, target: Path) -> Path:
    """A copy whose first leaf page after the meta pages has a garbled header."""
    shutil.copytree(database, target)
    data = bytearray((target / "data.mdb").read_bytes())
    for j in range(16):
        data[2 * 4096 + j] ^= 0xA5
    (target / "data.mdb").write_bytes(bytes(data))
    return target


def _dataset_failures(rank: int, world_size: int, path: str) -> list[tuple[int, str]]:
    dataset, failed = LazyLMDBDataset(path), []
    for i in range(len(dataset)):
        try:
            dataset[i]
        except LMDBFormatError as exc:
            failed.append((i, str(exc)))
    return failed


def test_a_corrupt_page_is_reported_and_verify_goes_on(
    database: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = _damage_pages(database, tmp_path / "damaged")
    found = run_distributed(_dataset_failures, 1, args=(str(damaged),), init=None, timeout=120)[0]
    assert found  # the damage is real
    failed = [i for i, _ in found]
    for _, message in found:
        assert str(damaged) in message
        assert "ddpkit lmdb verify" in message
    report = verify_report(damaged)
    assert report.samples == 40
    assert [b.index for b in report.bad] == failed  # verify and the dataset agree
    assert all("damaged" in b.reason for b in report.bad)
    assert main(["lmdb", "verify", str(damaged)]) == 1
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == len(failed)
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("decode", ["bytes", "tensor"])
def test_rebuilding_in_place_is_seen_by_this_process(tmp_path: Path, decode: str) -> None:
    tree = image_tree(tmp_path / "imgs", per_class=2)
    db = tmp_path / "db"
    build_lmdb(tree, db, progress=False)
    old = LazyLMDBDataset(db, decode=decode)  # type: ignore[arg-type]
    old[0]  # this process now holds the database open, and the dataset its environment
    assert describe_lmdb(db)["samples"] == 4
    image_tree(tree, per_class=5)  # more images, then a rebuild over the old database
    build_lmdb(tree, db, overwrite=True, progress=False)
    assert describe_lmdb(db)["samples"] == 10
    fresh = LazyLMDBDataset(db, decode=decode)  # type: ignore[arg-type]
    assert len(fresh) == 10
    last = (tree / "c1" / "4.jpg").read_bytes()
    if decode == "bytes":
        assert fresh[9][0] == last
    else:
        assert torch.equal(fresh[9][0], decode_tensor(last))
    # At once, within the dataset's 10 ms of trust: the environment it held was closed
    # when the new file was opened, so it asks again and hears why.
    with pytest.raises(LMDBFormatError, match="was replaced"):
        old[0]  # its index is the old database's: reading the new one would mix them


def _index(**meta: str) -> dict[str, str]:
    base = {"format": FORMAT_NAME, "version": "1", "classes": json.dumps(["a", "b"])}
    base["num_samples"] = "3"
    base.update(meta)
    return {k: v for k, v in base.items() if v is not None}


def _record(columns: dict[str, Any], meta: dict[str, str]) -> bytes:
    table = pa.table(columns).replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


@pytest.mark.parametrize(
    ("columns", "meta", "field"),
    [
        ({"label": pa.array([0, 1, 5])}, {}, "label 5, outside the 2 classes"),
        ({"label": pa.array([0, -1, 1])}, {}, "label -1"),
        ({"label": pa.array([0, None, 1], pa.int64())}, {}, "1 empty value"),
        ({"label": pa.array([0.0, 1.0, 1.0])}, {}, "holds double, not integers"),
        ({"labels": pa.array([0, 1, 1])}, {}, "no 'label' column"),
        ({"label": pa.array([0, 1, 1])}, {"classes": None}, "no 'classes' field"),
        ({"label": pa.array([0, 1, 1])}, {"classes": "not json"}, "'classes' field is not JSON"),
        ({"label": pa.array([0, 1, 1])}, {"classes": '{"a": 1}'}, "is a dict, not a list"),
        ({"label": pa.array([0, 1, 1])}, {"classes": "[1, 2]"}, "not a list of names"),
        ({"label": pa.array([0, 1, 1])}, {"classes": '["a", "a"]'}, "names a class twice"),
        ({"label": pa.array([0, 1, 1])}, {"num_samples": "4"}, "says num_samples=4"),
        ({"label": pa.array([0, 1, 1])}, {"num_samples": None}, "says num_samples=None"),
    ],
)
def test_each_index_field_is_checked(
    columns: dict[str, Any], meta: dict[str, str | None], field: str
) -> None:
    record = _record(columns, _index(**meta))  # type: ignore[arg-type]
    with pytest.raises(LMDBFormatError, match="the index record is damaged") as info:
        decode_index(record, source="db")
    assert field in str(info.value)


def test_verify_refuses_a_database_with_a_damaged_index(
    database: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(database, copy)
    env = lmdb.open(str(copy), map_size=64 << 20)
    with env.begin(write=True) as txn:
        txn.put(INDEX_KEY, _record({"label": pa.array([0, 7] * 20)}, _index(num_samples="40")))
    env.close()
    assert main(["lmdb", "verify", str(copy)]) == 1
    assert "label 7, outside the 2 classes" in capsys.readouterr().err


_metadata = st.dictionaries(
    st.sampled_from(["format", "version", "classes", "num_samples", "ddpkit_version", "x"]),
    st.one_of(st.text(max_size=20), st.sampled_from([FORMAT_NAME, "1", '["a","b"]', "3", "[]"])),
)
_labels = st.one_of(
    st.lists(st.integers(-(2**40), 2**40), max_size=5).map(lambda v: pa.array(v, pa.int64())),
    st.lists(st.one_of(st.none(), st.integers(0, 3)), max_size=5).map(pa.array),
    st.lists(st.floats(allow_nan=True), max_size=5).map(pa.array),
    st.lists(st.text(max_size=3), max_size=5).map(pa.array),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(meta=_metadata, labels=_labels, column=st.sampled_from(["label", "other"]))
def test_any_index_either_decodes_whole_or_is_refused(
    meta: dict[str, str], labels: pa.Array, column: str
) -> None:
    record = _record({column: labels}, meta)
    try:
        index = decode_index(record, source="db")
    except LMDBFormatError:
        return
    # Whatever decodes keeps every promise encode_index makes.
    assert all(isinstance(c, str) for c in index.classes)
    assert len(set(index.classes)) == len(index.classes)
    assert ((index.labels >= 0) & (index.labels < len(index.classes))).all()
    assert encode_index(index.labels, index.classes)  # it round-trips


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_as_an_index_are_refused(data: bytes) -> None:
    with pytest.raises(LMDBFormatError):
        decode_index(data, source="db")


def test_old_pickles_of_every_protocol_are_read_by_from_legacy(tmp_path: Path) -> None:
    from lmdb_fixtures import encode, photo, write_legacy_db

    image = encode(photo(1))
    db = write_legacy_db(tmp_path / "legacy", [image, image], [0, 1])
    env = lmdb.open(str(db), map_size=64 << 20)
    with env.begin(write=True) as txn:  # rewrite as protocol 0 pickles, as Python 2 wrote them
        keys = pickle.loads(txn.get(b"__keys__"))
        for k, key in enumerate(keys):
            txn.put(key, pickle.dumps((image, k), protocol=0))
        txn.put(b"__keys__", pickle.dumps(keys, protocol=0))
    env.close()
    dataset = LazyLMDBDataset.from_legacy(db, allow_pickle=True, decode="bytes")
    assert [dataset[i][1] for i in range(2)] == [0, 1]


def _read_after_fork(rank: int, world_size: int, path: str) -> list[int]:
    import os

    parent = LazyLMDBDataset(path, decode="bytes")
    parent[0]  # the parent holds the database open
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that builds its own dataset, as a lazy DataLoader worker does
        try:
            child = LazyLMDBDataset(path, decode="bytes")
            os.write(write, str(len(child[3][0])).encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    return [int(os.read(read, 100) or b"-1"), len(parent[3][0])]


def test_a_forked_child_opens_what_its_parent_holds(database: Path) -> None:
    sizes = run_distributed(_read_after_fork, 1, args=(str(database),), init=None, timeout=120)[0]
    assert sizes[0] == sizes[1] > 0


def test_many_threads_reading_first_at_once(database: Path) -> None:
    import threading

    from ddpkit.data import lmdb_format

    for key in [k for k in lmdb_format._SHARED if "db" in k]:  # a fresh start in this process
        lmdb_format._SHARED.pop(key).env.close()
    dataset = LazyLMDBDataset(database, decode="bytes")
    barrier, errors = threading.Barrier(8), []

    def first_read(i: int) -> None:
        barrier.wait()
        try:
            dataset[i]
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_read, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_database_replaced_while_its_index_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ddpkit.data.lmdb_dataset as dataset_module

    small, big = tmp_path / "small", tmp_path / "big"
    build_lmdb(image_tree(tmp_path / "a", per_class=1), small, progress=False)
    build_lmdb(image_tree(tmp_path / "b", per_class=3), big, progress=False)
    read = dataset_module.read_index

    def swap_after_reading(path: object, **kwargs: object) -> object:
        index = read(path, **kwargs)  # type: ignore[arg-type]
        shutil.rmtree(small)
        shutil.copytree(big, small)  # a build with --overwrite lands now
        return index

    monkeypatch.setattr(dataset_module, "read_index", swap_after_reading)
    with pytest.raises(LMDBFormatError, match="was replaced while its index was read"):
        LazyLMDBDataset(small)


def _record_of(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _twice(names: list[str]) -> pa.Table:
    arrays = [pa.array([0, 1, 1]) if n == "label" else pa.array(["x", "y", "z"]) for n in names]
    return pa.Table.from_arrays(arrays, names=names).replace_schema_metadata(_index())


@pytest.mark.parametrize(
    "names",
    [["label", "label"], ["label", "path", "path"], ["path", "label", "label", "path"]],
)
def test_a_column_name_given_twice_is_refused(names: list[str]) -> None:
    with pytest.raises(LMDBFormatError, match="the index record is damaged") as info:
        decode_index(_record_of(_twice(names)), source="db", columns=("path",))
    assert "more than one column named" in str(info.value)


def _with_index(database: Path, target: Path, record: bytes) -> Path:
    shutil.copytree(database, target)
    env = lmdb.open(str(target), map_size=64 << 20)
    with env.begin(write=True) as txn:
        txn.put(INDEX_KEY, record)
    env.close()
    return target


def _every_reader(path: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What info, verify and the dataset say about ``path``: each an LMDBFormatError."""
    said = []
    for command in ("info", "verify"):
        assert main(["lmdb", command, str(path)]) == 1
        said.append(capsys.readouterr().err)
    with pytest.raises(LMDBFormatError) as info:
        LazyLMDBDataset(path)
    said.append(str(info.value))
    with pytest.raises(LMDBFormatError):
        describe_lmdb(path)
    return said


def test_two_label_columns_are_named_by_every_reader(
    database: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labels = pa.array([0, 1] * 3)
    table = pa.Table.from_arrays([labels, labels], names=["label", "label"])
    record = _record_of(table.replace_schema_metadata(_index(num_samples="6")))
    for said in _every_reader(_with_index(database, tmp_path / "copy", record), capsys):
        assert "more than one column named 'label'" in said, said


@pytest.mark.parametrize("value", [2**63 + 1, 2**64 - 1, 2**63])
def test_a_uint64_label_beyond_int64_is_reported_as_stored(
    database: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: int
) -> None:
    labels = pa.array([0, 1, value, 1, 0, 1], pa.uint64())
    record = _record({"label": labels}, _index(num_samples="6"))
    for said in _every_reader(_with_index(database, tmp_path / "copy", record), capsys):
        assert f"sample 2 has label {value}, outside the 2 classes" in said, said
        assert f"label -{2**64 - value}" not in said


def test_a_uint64_label_in_range_reads_as_its_value() -> None:
    index = decode_index(
        _record({"label": pa.array([0, 1, 1], pa.uint64())}, _index()), source="db"
    )
    assert index.labels.tolist() == [0, 1, 1]
    assert index.labels.dtype.name == "int64"


@pytest.mark.parametrize("value", [2**63 + 1, 2**70])
def test_encode_index_reports_a_huge_label_as_given(value: int) -> None:
    import numpy as np

    given: list[Any] = [[0, value], np.array([0, value], dtype=np.uint64)] if value < 2**64 else []
    for labels in [*given, [0, value]]:
        with pytest.raises(ValueError, match=f"got 0..{value}"):
            encode_index(labels, ["a", "b"])


def test_a_parquet_uint64_label_beyond_int64_is_named(tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    from lmdb_fixtures import encode, photo

    images = [encode(photo(i, (16, 16))) for i in range(3)]
    labels = pa.array([0, 2**63 + 1, 1], pa.uint64())
    pq.write_table(pa.table({"image": images, "label": labels}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=f"a label is {2**63 + 1}"):
        build_lmdb(tmp_path / "d.parquet", tmp_path / "db", progress=False)
