"""describe_lmdb and verify: what a database holds, and whether training can read all of it."""

from __future__ import annotations

from pathlib import Path

import lmdb
from lmdb_fixtures import encode, photo

from ddpkit.data import (
    LazyLMDBDataset,
    LMDBFormatError,
    build_lmdb,
    describe_lmdb,
    verify_lmdb,
    verify_report,
)
from ddpkit.data.lmdb_format import read_index
from ddpkit.data.lmdb_index import FORMAT_VERSION, sample_key
from ddpkit.testing import run_distributed


def _tree(root: Path) -> Path:
    for label, count in (("Zebra", 3), ("apple", 5), ("bird", 2)):
        for i in range(count):
            path = root / label / f"{label[0]}{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encode(photo(10 * len(label) + i, (48, 40))))
    return root


def _damage(db: Path, index: int) -> None:
    env = lmdb.open(str(db), subdir=True)
    with env.begin(write=True) as txn:
        txn.put(sample_key(index), b"\xff\xd8 definitely not the rest of a JPEG")
    env.close()


def _dataset_failures(rank: int, world_size: int, db: str) -> list[int]:
    """The indices LazyLMDBDataset cannot read (in a child: a decoder may crash)."""
    dataset, failed = LazyLMDBDataset(db), []
    for i in range(len(dataset)):
        try:
            dataset[i]
        except LMDBFormatError:
            failed.append(i)
    return failed


def test_verify_finds_exactly_what_the_dataset_cannot_read(tmp_path: Path) -> None:
    db = tmp_path / "db"
    build_lmdb(_tree(tmp_path / "tree"), db, progress=False)
    assert verify_lmdb(db, workers=2) == []
    clean = verify_report(db)
    assert (clean.samples, clean.bad, clean.ok) == (10, (), True)

    paths = read_index(db, columns=("path",)).columns["path"]
    target = paths.index("apple/a2.jpg")
    _damage(db, target)
    report = verify_report(db, workers=2)
    assert not report.ok
    assert report.samples == 10
    assert [(b.index, b.path) for b in report.bad] == [(target, "apple/a2.jpg")]
    assert report.bad[0].describe().startswith("apple/a2.jpg: ")
    assert [i for i, _ in verify_lmdb(db)] == [target]
    assert run_distributed(_dataset_failures, 1, args=(str(db),), init=None, timeout=120) == [
        [target]
    ]


def test_describe(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree")
    db = tmp_path / "db"
    build_lmdb(tree, db, progress=False)
    info = describe_lmdb(db)
    assert info["samples"] == 10
    assert info["classes"] == {"Zebra": 3, "apple": 5, "bird": 2}
    assert info["format_version"] == FORMAT_VERSION
    assert info["size_bytes"] == sum(f.stat().st_size for f in db.iterdir())
    assert info["metadata"]["source"] == str(tree)
