"""LazyLMDBDataset: round trips, decode modes, workers under every start method, errors."""

from __future__ import annotations

import io
import multiprocessing as mp
import pickle
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from lmdb_fixtures import encode, photo, varied_images, write_db, write_legacy_db
from PIL import Image
from torch.utils.data import DataLoader

from ddpkit.data.images import decode_tensor
from ddpkit.data.lmdb_dataset import LazyLMDBDataset
from ddpkit.data.lmdb_format import EnvHandle, open_env, read_index
from ddpkit.data.lmdb_index import INDEX_KEY, LMDBFormatError, encode_index, sample_key
from ddpkit.testing import run_distributed

CLASSES = ["cat", "dog", "eel"]


@pytest.fixture
def db(tmp_path: Path) -> tuple[Path, list[bytes], list[int]]:
    images = [encode(photo(i), quality=85) for i in range(12)]
    labels = [i % 3 for i in range(12)]
    return write_db(tmp_path / "train.lmdb", images, labels, CLASSES), images, labels


def test_round_trip_bytes_labels_and_classes(db: tuple[Path, list[bytes], list[int]]) -> None:
    path, images, labels = db
    ds = LazyLMDBDataset(path, decode="bytes")
    assert len(ds) == 12
    assert ds.classes == CLASSES
    assert ds.class_to_idx == {"cat": 0, "dog": 1, "eel": 2}
    assert ds.targets == labels
    assert ds.labels.dtype == np.int64
    assert [ds[i] for i in range(12)] == list(zip(images, labels, strict=True))
    assert ds[-1] == (images[-1], labels[-1])
    with pytest.raises(IndexError, match="out of range for 12"):
        ds[12]


def test_decode_modes_match_pillow(tmp_path: Path) -> None:
    images = varied_images()
    path = write_db(tmp_path / "v.lmdb", images, [0] * len(images), ["x"])
    tensors = LazyLMDBDataset(path, decode="tensor")
    pils = LazyLMDBDataset(path, decode="pil")
    for i, raw in enumerate(images):
        t, _ = tensors[i]
        p, _ = pils[i]
        assert isinstance(p, Image.Image)
        assert p.mode == "RGB"
        assert t.dtype == torch.uint8
        assert t.shape == (3, 72, 96), f"image {i}"
        expected = torch.from_numpy(np.array(Image.open(io.BytesIO(raw)).convert("RGB")))
        # the same pixels as Pillow gives, up to decoder rounding (CMYK, chroma upsampling)
        diff = (t.permute(1, 2, 0).int() - expected.int()).abs().float().mean().item()
        assert diff < 3.0, f"image {i}: mean abs diff {diff}"
        assert torch.equal(torch.from_numpy(np.array(p)), expected)


def test_transforms_are_applied(db: tuple[Path, list[bytes], list[int]]) -> None:
    path, images, labels = db
    ds = LazyLMDBDataset(path, transform=len, target_transform=lambda y: CLASSES[y], decode="bytes")
    assert ds[3] == (len(images[3]), CLASSES[labels[3]])


def test_shards_concatenate_in_order(tmp_path: Path) -> None:
    a = [encode(photo(i)) for i in range(5)]
    b = [encode(photo(10 + i)) for i in range(3)]
    pa = write_db(tmp_path / "a.lmdb", a, [0, 1, 2, 0, 1], CLASSES)
    pb = write_db(tmp_path / "b.lmdb", b, [2, 2, 0], CLASSES)
    ds = LazyLMDBDataset([pa, pb], decode="bytes")
    assert len(ds) == 8
    assert ds.targets == [0, 1, 2, 0, 1, 2, 2, 0]
    assert [ds[i][0] for i in range(8)] == a + b
    other = write_db(tmp_path / "c.lmdb", b, [0, 0, 0], ["ant", "bee", "cow"])
    with pytest.raises(LMDBFormatError, match="shards disagree on the classes"):
        LazyLMDBDataset([pa, other])


def test_two_datasets_on_one_file_share_the_environment(
    db: tuple[Path, list[bytes], list[int]],
) -> None:
    path, images, _ = db
    first = LazyLMDBDataset(path, decode="bytes")
    assert first[0][0] == images[0]
    # py-lmdb refuses a second open of a path in one process; both must still work.
    second = LazyLMDBDataset(path, decode="bytes")
    assert second[1][0] == images[1]
    assert first[2][0] == images[2]


@pytest.mark.parametrize("decode", ["bytes", "tensor"])
def test_pickling_drops_the_environment(
    db: tuple[Path, list[bytes], list[int]], decode: str
) -> None:
    path, images, labels = db
    ds = LazyLMDBDataset(path, decode=decode)  # type: ignore[arg-type]
    ds[0]  # the environment is open in this process now, and held by the dataset
    state = ds.__getstate__()
    values = [x for v in state.values() for x in (v if isinstance(v, list) else [v])]
    assert not any(isinstance(v, lmdb.Environment | memoryview | EnvHandle) for v in values)
    assert state["_held"] == [None]
    copy = pickle.loads(pickle.dumps(ds))
    image, label = copy[4]
    assert label == labels[4]
    assert type(label) is int
    if decode == "bytes":
        assert image == images[4]
    else:
        assert torch.equal(image, decode_tensor(images[4]))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("method", "parent_reads_first"),
    # After fork the parent's open environment is inherited (the hard case);
    # spawn and forkserver workers receive a pickled dataset.
    [("fork", False), ("fork", True), ("spawn", True), ("forkserver", True)],
)
def test_dataloader_workers_under_every_start_method(
    db: tuple[Path, list[bytes], list[int]], method: str, parent_reads_first: bool
) -> None:
    path, images, labels = db
    ds = LazyLMDBDataset(path, decode="bytes")
    if parent_reads_first:
        assert ds[0][0] == images[0]  # the environment is open in the parent now
    loader = DataLoader(
        ds,
        batch_size=3,
        num_workers=2,
        collate_fn=list,
        multiprocessing_context=mp.get_context(method),
    )
    seen = [item for batch in loader for item in batch]
    assert seen == list(zip(images, labels, strict=True))


@pytest.mark.timeout(180)
def test_forked_workers_examine_each_record_once_per_run(
    db: tuple[Path, list[bytes], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a record's first decode found (decode_tensor_known) is kept in memory the
    # workers share with this process: the next epoch's workers, whichever records
    # they draw, only decode.
    from ddpkit.data import images

    path, images_, _ = db
    ds = LazyLMDBDataset(path)
    assert set(ds._known) == {0}
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context=mp.get_context("fork")
    )
    first = [x for batch, _ in loader for x in batch]
    assert all(torch.equal(a, decode_tensor(b)) for a, b in zip(first, images_, strict=True))
    assert all(ds._known[i] == 96 << 16 | 72 for i in range(len(ds)))  # found by the workers

    def looked(raw: object) -> None:
        raise AssertionError("a header walked twice")

    monkeypatch.setattr(images, "_jpeg_header", looked)  # the next epoch's workers inherit it
    again = [x for batch, _ in loader for x in batch]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    with pytest.raises(LMDBFormatError, match="walked twice"):
        LazyLMDBDataset(path)[0]  # another dataset: its own first reads
    copy = pickle.loads(pickle.dumps(ds))  # a spawned worker's copy: a table of its own
    assert set(copy._known) == {0}


def test_without_memory_for_the_table_every_read_is_a_first_read(
    db: tuple[Path, list[bytes], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import mmap

    path, images_, labels = db

    def refused(*args: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refused)
    ds = LazyLMDBDataset(path)
    for _ in range(2):
        image, label = ds[5]
        assert torch.equal(image, decode_tensor(images_[5]))
        assert label == labels[5]
    assert ds._known[5] == 0


def test_a_bad_record_is_refused_at_every_read(tmp_path: Path) -> None:
    good = encode(photo(1), quality=90)
    path = write_db(tmp_path / "db", [good, good[: len(good) // 2]], [0, 1], CLASSES)
    ds = LazyLMDBDataset(path)
    for _ in range(2):
        assert ds[0][0].shape == (3, 72, 96)
        with pytest.raises(LMDBFormatError, match="sample 1"):
            ds[1]
    assert ds._known[1] == 0


def _ranks_with_workers(rank: int, world_size: int, path: str) -> list[int]:
    from train_jobs import worker_start  # type: ignore[import-not-found]

    ds = LazyLMDBDataset(path, decode="tensor")
    # From the suite's forkserver: how the workers start is not what this tests.
    start, sampler = worker_start(ds), range(rank, len(ds), world_size)
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, sampler=sampler, multiprocessing_context=start
    )
    return [int(y) for _, ys in loader for y in ys]


@pytest.mark.timeout(180)
def test_many_ranks_and_workers_read_one_database(
    db: tuple[Path, list[bytes], list[int]],
) -> None:
    path, _, labels = db
    out = run_distributed(_ranks_with_workers, 2, args=(str(path),), timeout=150)
    assert out == [labels[r::2] for r in range(2)]


def test_more_readers_than_lmdb_reader_slots(db: tuple[Path, list[bytes], list[int]]) -> None:
    path, images, _ = db
    env = open_env(path)
    # LMDB's default table has 126 reader slots; lock-free readers use none.
    txns = [env.begin() for _ in range(300)]
    assert all(t.get(sample_key(0)) == images[0] for t in txns)
    for t in txns:
        t.abort()
    env.close()


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="ddpkit lmdb build"):
        LazyLMDBDataset(tmp_path / "nope.lmdb")


def test_not_an_lmdb(tmp_path: Path) -> None:
    junk = tmp_path / "junk.lmdb"
    junk.write_bytes(b"this is not a database" * 1000)
    with pytest.raises(LMDBFormatError, match="not an LMDB database"):
        LazyLMDBDataset(junk)
    (tmp_path / "empty.lmdb").mkdir()
    with pytest.raises(LMDBFormatError, match=r"without data\.mdb"):
        LazyLMDBDataset(tmp_path / "empty.lmdb")


def test_lmdb_without_index(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "plain.lmdb"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    with pytest.raises(LMDBFormatError, match="without a ddpkit index record"):
        LazyLMDBDataset(tmp_path / "plain.lmdb")


def test_corrupt_record_names_index_and_shard(db: tuple[Path, list[bytes], list[int]]) -> None:
    path, _, _ = db
    env = lmdb.open(str(path), map_size=64 << 20)
    with env.begin(write=True) as txn:
        txn.put(sample_key(5), b"\xff\xd8 not really a jpeg")
    env.close()
    ds = LazyLMDBDataset(path, decode="tensor")
    with pytest.raises(LMDBFormatError, match=r"sample 5 \(record 5 of .*train.lmdb\)"):
        ds[5]
    with pytest.raises(LMDBFormatError, match="sample 5"):
        LazyLMDBDataset(path, decode="pil")[5]


def test_newer_and_unknown_versions(tmp_path: Path) -> None:
    import pyarrow as pa

    def index_with(version: str) -> bytes:
        table = pa.ipc.open_stream(pa.py_buffer(encode_index([0], ["a"]))).read_all()
        meta = dict(table.schema.metadata)
        meta[b"version"] = version.encode()
        sink = pa.BufferOutputStream()
        table = table.replace_schema_metadata(meta)
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        return bytes(sink.getvalue().to_pybytes())

    img = [encode(photo(0))]
    newer = write_db(tmp_path / "v2.lmdb", img, [0], ["a"], index=index_with("2"))
    with pytest.raises(LMDBFormatError, match=r"newer than this ddpkit .* upgrade ddpkit"):
        read_index(newer)
    odd = write_db(tmp_path / "vx.lmdb", img, [0], ["a"], index=index_with("banana"))
    with pytest.raises(LMDBFormatError, match="is unknown"):
        LazyLMDBDataset(odd)
    broken = write_db(tmp_path / "bad.lmdb", img, [0], ["a"], index=b"garbage")
    with pytest.raises(LMDBFormatError, match="not readable Arrow data"):
        LazyLMDBDataset(broken)


def test_legacy_layout_only_with_opt_in(tmp_path: Path) -> None:
    images = [encode(photo(i)) for i in range(4)]
    path = write_legacy_db(tmp_path / "old.lmdb", images, [1, 0, 1, 1])
    with pytest.raises(LMDBFormatError, match="folder2lmdb-style database"):
        LazyLMDBDataset(path)
    with pytest.raises(ValueError, match="allow_pickle=True"):
        LazyLMDBDataset.from_legacy(path)
    ds = LazyLMDBDataset.from_legacy(path, allow_pickle=True, decode="bytes")
    assert len(ds) == 4
    assert [ds[i] for i in range(4)] == list(zip(images, [1, 0, 1, 1], strict=True))
    assert ds.targets == [1, 0, 1, 1]
    img, label = LazyLMDBDataset.from_legacy(path, allow_pickle=True)[2]
    assert isinstance(img, Image.Image)
    assert label == 1


def test_pyarrow_serialized_legacy_is_explained(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "arrow.lmdb"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        # What pyarrow.serialize wrote: an Arrow message, not a pickle.
        txn.put(b"__keys__", b"\xff\xff\xff\xff\x10\x00\x00\x00arrow-ish")
        txn.put(b"__len__", b"\xff\xff\xff\xff\x10\x00\x00\x00arrow-ish")
    env.close()
    with pytest.raises(LMDBFormatError, match="pyarrow removed"):
        LazyLMDBDataset.from_legacy(tmp_path / "arrow.lmdb", allow_pickle=True)


def test_index_record_is_not_a_pickle(db: tuple[Path, list[bytes], list[int]]) -> None:
    path, _, _ = db
    env = open_env(path)
    with env.begin() as txn:
        record = txn.get(INDEX_KEY)
    env.close()
    assert not record.startswith(b"\x80")
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(record)
