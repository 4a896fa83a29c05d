"""Database build throughput against folder2lmdb.py, and index load time at ImageNet scale.

(i) ``ddpkit.build_lmdb(tree, out, check="header", workers=2)`` against the
folder2lmdb.py build of the same JPEG tree (a DataLoader with 2 workers), each
timed end to end into a fresh output, alternating round by round after one
untimed build of each.

(ii) A database holding only the index record of 1,000,000 samples over 1000
classes, with an ImageNet-like ``path`` column: how long ``read_index`` and
``LazyLMDBDataset`` construction take (the index is all they read).

Run ``python benchmarks/build.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
from _photos import OUT, folder2lmdb, photo_tree, remove_db

from ddpkit import LazyLMDBDataset, build_lmdb
from ddpkit.data import read_index
from ddpkit.data.lmdb_index import INDEX_KEY, encode_index


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_throughput(tree: Path, rounds: int) -> tuple[list[float], list[float]]:
    """Images per second of each build, per round: (ddpkit, folder2lmdb)."""
    work = OUT / "build"
    work.mkdir(parents=True, exist_ok=True)
    images = sum(1 for _ in tree.glob("*/*.jpg"))

    def ddpkit_build() -> float:
        out = work / "ddpkit.lmdb"
        remove_db(out)
        seconds = _timed(lambda: build_lmdb(tree, out, check="header", workers=2, progress=False))
        remove_db(out)
        return images / seconds

    def seed_build() -> float:
        out = str(work / "seed.lmdb")
        remove_db(out)
        seconds = _timed(lambda: folder2lmdb(tree, out, workers=2))
        remove_db(out)
        return images / seconds

    ddpkit_build(), seed_build()  # warm-up: page cache, imports
    ours: list[float] = []
    seed: list[float] = []
    for r in range(rounds):
        for build, rates in [(ddpkit_build, ours), (seed_build, seed)][:: 1 if r % 2 == 0 else -1]:
            rates.append(build())
        print(f"  round {r + 1}/{rounds}: ddpkit {ours[-1]:.0f}, folder2lmdb {seed[-1]:.0f} img/s")
    return ours, seed


def index_database(path: Path, samples: int, classes: int) -> int:
    """Write a database with only an index record; returns the record's size in bytes."""
    rng = np.random.default_rng(0)
    # WordNet-id-like class names, sorted as ImageFolder sorts its directories.
    wnids = sorted({f"n{v:08d}" for v in rng.choice(10**7, size=classes, replace=False)})
    labels = np.sort(rng.integers(0, classes, size=samples))
    numbers = rng.integers(1, 50_000, size=samples)
    paths = [f"{wnids[k]}/{wnids[k]}_{i}.JPEG" for k, i in zip(labels, numbers, strict=True)]
    record = encode_index(labels, wnids, columns={"path": paths})
    remove_db(path)
    env = lmdb.open(str(path), map_size=max(4 * len(record), 1 << 24))
    with env.begin(write=True) as txn:
        txn.put(INDEX_KEY, record)
    env.close()
    return len(record)


def index_load(path: Path, repeats: int) -> dict[str, list[float]]:
    cases: dict[str, Callable[[], Any]] = {
        "read_index(path)": lambda: read_index(path),
        "LazyLMDBDataset(path)": lambda: LazyLMDBDataset(path),
        "read_index(path, columns=('path',))": lambda: read_index(path, columns=("path",)),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(_timed(fn))
    return times


def _target(what: str, value: float, unit: str, passed: bool) -> None:
    print(f"  {what:52} {value:8.3f}{unit}  {'PASS' if passed else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="JPEGs in the tree (2000)")
    parser.add_argument("--classes", type=int, default=10, help="class directories (10)")
    parser.add_argument("--rounds", type=int, default=5, help="timed builds of each (5)")
    parser.add_argument(
        "--index-samples", type=int, default=1_000_000, help="samples in the index (1000000)"
    )
    parser.add_argument("--quick", action="store_true", help="300 images, 2 rounds: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.images, args.rounds = min(args.images, 300), min(args.rounds, 2)

    tree = photo_tree(args.images, args.classes)
    print(f"(i) build of {args.images} JPEGs in {args.classes} classes, 2 workers each")
    ours, seed = build_throughput(tree, args.rounds)
    ratio = statistics.median(o / s for o, s in zip(ours, seed, strict=True))
    print(f"img/s, median of {args.rounds} builds (min-max)")
    for name, v in [("ddpkit build_lmdb (check=header)", ours), ("folder2lmdb.py", seed)]:
        print(f"  {name:34} {statistics.median(v):6.0f} ({min(v):.0f}-{max(v):.0f})")
    _target("build_lmdb / folder2lmdb (median per-round) >= 1.5", ratio, "x", ratio >= 1.5)

    n = args.index_samples
    path = OUT / "index-only.lmdb"
    size = index_database(path, n, 1000)
    print(f"\n(ii) index of {n} samples, 1000 classes, with a path column")
    print(f"  index record: {size / 2**20:.1f} MiB ({size / n:.1f} bytes per sample)")
    times = index_load(path, repeats=5)
    print("seconds, median of 5 (min-max)")
    for name, v in times.items():
        print(f"  {name:38} {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})")
    for name in ("read_index(path)", "LazyLMDBDataset(path)"):
        value = statistics.median(times[name])
        _target(f"{name} < 0.5 s", value, " s", value < 0.5)
    remove_db(path)


if __name__ == "__main__":
    main()
