"""What a user with ImageNet-sized data meets: builder memory and speed, index cost, open time.

Many tiny synthetic images stand in for a large dataset, so this runs on a
laptop. Each measurement runs in a fresh process (its peak memory is its own):

(i) The builder on a list file of N tiny PNGs, N = 100,000 and 1,000,000,
    alternating round by round: peak RSS and images per second. Targets:
    peak(1M) / peak(100k) <= 1.2, and images/s at 1M no lower than at 100k
    (ratio >= 0.9, the spread of the rounds is printed).
(ii) The index a dataset keeps, per sample, over the 1M database against a
    1,000-sample one (so fixed costs cancel): the RSS ``LazyLMDBDataset`` adds
    to its process (target <= 16 bytes), and the anonymous proportional set
    size (``Pss_Anon`` of /proc/<pid>/smaps_rollup) of 2 DataLoader workers
    started by fork, per worker (target <= 16): a copy of the index made on
    write would show there. The database pages the workers' reads map
    (``Pss_File``, the page cache) are printed apart.
(iii) Opening a 10,000,000-sample database (one byte per record):
    ``LazyLMDBDataset(path)`` in a fresh process, median of the rounds
    (target < 0.5 s).

    python benchmarks/scale.py [--rounds 2] [--small 100000] [--large 1000000] [--open 10000000]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np
from _photos import OUT

from ddpkit.data.lmdb_index import INDEX_KEY, encode_index, sample_key

WORK = OUT / "scale"
CLASSES = 10


def _tiny_pngs(folder: Path, count: int = 256) -> list[Path]:
    """``count`` distinct 8x8 PNGs (about 100-200 bytes each)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for k in range(count):
        path = folder / f"{k}.png"
        if not path.exists():
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, "PNG")
            path.write_bytes(buffer.getvalue())
        paths.append(path)
    return paths


def _list_file(n: int, images: list[Path]) -> Path:
    path = WORK / f"list-{n}.txt"
    if not path.exists():
        with open(path, "w") as f:
            for i in range(n):
                f.write(f"{images[i % len(images)].name},{i % CLASSES}\n")
    return path


def _child(code: str, *args: str) -> dict[str, float]:
    """Run ``code`` in a fresh interpreter; it prints one JSON line of figures."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"a measurement failed:\n{done.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


_BUILD = """
import json, resource, sys, time
from ddpkit.data import build_lmdb
start = time.perf_counter()
summary = build_lmdb(sys.argv[1], sys.argv[2], root=sys.argv[3], workers=2, progress=False)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"samples": summary.samples, "seconds": seconds, "peak": peak}))
"""


def builder(small: int, large: int, rounds: int) -> dict[int, list[dict[str, float]]]:
    images = _tiny_pngs(WORK / "pngs")
    runs: dict[int, list[dict[str, float]]] = {small: [], large: []}
    for r in range(rounds):
        for n in (small, large) if r % 2 == 0 else (large, small):
            out = WORK / f"db-{n}"
            shutil.rmtree(out, ignore_errors=True)
            runs[n].append(
                _child(_BUILD, str(_list_file(n, images)), str(out), str(images[0].parent))
            )
    return runs


_INDEX = """
import gc, json, os, sys
from torch.utils.data import DataLoader
from ddpkit.data import LazyLMDBDataset

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def rollup(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line and "-" not in line)
    return {k.strip(): int(v.split()[0]) * 1024 for k, v in fields.items()}

gc.collect()
before = rss()
dataset = LazyLMDBDataset(sys.argv[1], decode="bytes")
gc.collect()
added = rss() - before
loader = DataLoader(dataset, batch_size=64, num_workers=2, shuffle=True,
                    multiprocessing_context="fork", persistent_workers=True, collate_fn=list)
batches = iter(loader)
for _ in range(min(50, len(loader))):
    next(batches)
seen = [rollup(w.pid) for w in batches._workers]
print(json.dumps({"samples": len(dataset), "added": added,
                  "workers_anon": sum(r["Pss_Anon"] for r in seen),
                  "workers_file": sum(r["Pss_File"] for r in seen)}))
"""


def index_cost(large_db: Path, small_db: Path) -> dict[str, float]:
    large = _child(_INDEX, str(large_db))
    small = _child(_INDEX, str(small_db))
    extra_samples = large["samples"] - small["samples"]
    return {
        "main_bytes_per_sample": (large["added"] - small["added"]) / extra_samples,
        "worker_bytes_per_sample": (large["workers_anon"] - small["workers_anon"])
        / 2
        / extra_samples,
        "worker_file_mib": (large["workers_file"] - small["workers_file"]) / 2 / 2**20,
    }


def _index_only_db(path: Path, n: int) -> Path:
    """A database of ``n`` one-byte records and their index, written with the format primitives."""
    if (path / "data.mdb").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    env = lmdb.open(str(path), map_size=8 << 30, writemap=False, sync=False, lock=False)
    step = 200_000
    for start in range(0, n, step):
        with env.begin(write=True) as txn:
            for i in range(start, min(n, start + step)):
                txn.put(sample_key(i), b"x", append=True)
    labels = np.arange(n, dtype=np.int64) % CLASSES
    with env.begin(write=True) as txn:
        txn.put(INDEX_KEY, encode_index(labels, [str(k) for k in range(CLASSES)]))
    env.sync(True)
    env.close()
    return path


_OPEN = """
import json, sys, time
start = time.perf_counter()
from ddpkit.data import LazyLMDBDataset
imported = time.perf_counter()
dataset = LazyLMDBDataset(sys.argv[1])
opened = time.perf_counter()
print(json.dumps({"samples": len(dataset), "seconds": opened - imported}))
"""


def open_time(n: int, rounds: int) -> list[float]:
    db = _index_only_db(WORK / f"open-{n}", n)
    return [_child(_OPEN, str(db))["seconds"] for _ in range(rounds)]


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each build (2)")
    parser.add_argument("--small", type=int, default=100_000, help="images of the small build")
    parser.add_argument("--large", type=int, default=1_000_000, help="images of the large build")
    parser.add_argument("--open", type=int, default=10_000_000, help="samples of the opened db")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)

    runs = builder(args.small, args.large, args.rounds)
    small, large = runs[args.small], runs[args.large]
    peaks = [b["peak"] / a["peak"] for a, b in zip(small, large, strict=True)]
    speeds = [
        (b["samples"] / b["seconds"]) / (a["samples"] / a["seconds"])
        for a, b in zip(small, large, strict=True)
    ]
    print(f"(i) builder, list file of tiny PNGs, 2 threads, {args.rounds} paired rounds")
    for n, rows in runs.items():
        print(
            f"  {n:>9,} images: peak RSS {statistics.median(r['peak'] for r in rows) / 2**20:7.1f} "
            f"MiB, {statistics.median(r['samples'] / r['seconds'] for r in rows):8.0f} img/s"
        )
    print(f"  peak RSS {args.large:,} / {args.small:,}: {_spread(peaks)}   target <= 1.2: "
          f"{'PASS' if statistics.median(peaks) <= 1.2 else 'FAIL'}")  # fmt: skip
    print(f"  img/s {args.large:,} / {args.small:,}:    {_spread(speeds)}   target >= 0.9: "
          f"{'PASS' if statistics.median(speeds) >= 0.9 else 'FAIL'}")  # fmt: skip

    tiny = WORK / "db-1000"
    if not (tiny / "data.mdb").exists():
        images = _tiny_pngs(WORK / "pngs")
        _child(_BUILD, str(_list_file(1000, images)), str(tiny), str(images[0].parent))
    cost = index_cost(WORK / f"db-{args.large}", tiny)
    print(f"(ii) dataset index over {args.large:,} samples")
    print(f"  main process: {cost['main_bytes_per_sample']:.1f} bytes/sample   target <= 16: "
          f"{'PASS' if cost['main_bytes_per_sample'] <= 16 else 'FAIL'}")  # fmt: skip
    print(
        f"  2 fork workers, anonymous PSS over a 1,000-sample db: "
        f"{cost['worker_bytes_per_sample']:.2f} bytes/sample/worker   target <= 16: "
        f"{'PASS' if cost['worker_bytes_per_sample'] <= 16 else 'FAIL'}"
    )
    print(
        f"  (database pages the workers' reads mapped, page cache: "
        f"{cost['worker_file_mib']:.1f} MiB/worker more; not a copy of the index)"
    )

    times = open_time(args.open, max(args.rounds, 5))
    print(f"(iii) LazyLMDBDataset(path) over {args.open:,} samples, fresh processes")
    print(f"  seconds: {_spread(times)}   target < 0.5: "
          f"{'PASS' if statistics.median(times) < 0.5 else 'FAIL'}")  # fmt: skip
    stamp = time.strftime("%Y-%m-%d")
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, {stamp}")


if __name__ == "__main__":
    main()
