"""Training-loader throughput: ddpkit's LMDB dataset against the classic folder2lmdb recipe.

One run, the same JPEGs, the same batch size and worker count for every
contender:

(a) seed: the recipe's ImageFolderLMDB (pickled records) + the torchvision PIL pipeline
(b) torchvision ImageFolder on the files + the same PIL pipeline
(c) LazyLMDBDataset(decode="pil") + train_transform(224, decode="pil")
(d) LazyLMDBDataset(decode="tensor") + train_transform(224): uint8 batches, ready to
    move to the GPU, where normalize_batch runs in the training step
(n) (d) with normalize_batch run on the CPU in the consuming loop: what the same
    step costs where there is no GPU (information; the targets use (d))
(e) the ceiling: (d)'s dataset read in this process, no DataLoader
(r) (t) (x) (z) (d) with a preset after the crop: RandAugment (magnitude 9,
    2 ops), TrivialAugmentWide, AugMix (severity 3), Random Erasing (p=0.25);
    their cost per image is the time over (d)'s, per worker

and, in this process, what reading an item adds to decoding it:

(j) the bare decoder the library decodes JPEG with, TorchCodec's ``decode_jpeg``,
    on the bytes of each record, read beforehand
(i) ``LazyLMDBDataset(decode="tensor")[i]`` with no transform, from a dataset
    that has read every record once (a training run's epochs after the
    first): the record read, its size checked, the same decoder; each record
    decoded by (j) and read by (i) one right after the other, in
    8 x ``--rounds`` rounds of 300 records
(f) the same, each record's first read by a new dataset (the first epoch):
    its header walked and its data checked for a short end too; in as many
    rounds, interleaved with those of (i), each paired with (j) again (jf)

Every process computes with one thread, so the figures are per worker core.
Warm-up (worker start, first epoch, page cache) is not timed; each timed pass
is one epoch, and the contenders alternate pass by pass, so load from other
work on the machine hits them all alike. Ratios are medians of per-round
ratios. Run ``python benchmarks/loader.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import pickle
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lmdb
import PIL
import torch
import torchvision
from _photos import OUT, folder2lmdb, photo_tree, remove_db
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from torchvision.datasets import ImageFolder

from ddpkit import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    LazyLMDBDataset,
    build_lmdb,
    normalize_batch,
    train_transform,
)

NAMES = {
    "a": "seed: folder2lmdb ImageFolderLMDB + PIL",
    "b": "ImageFolder on files + PIL",
    "c": "LazyLMDBDataset decode=pil + PIL",
    "d": "LazyLMDBDataset decode=tensor + uint8",
    "n": "(d) + normalize_batch on the CPU",
    "e": "ceiling: (d) in-process, no DataLoader",
    "r": "(d) + RandAugment m9 n2",
    "t": "(d) + TrivialAugmentWide",
    "x": "(d) + AugMix severity 3",
    "z": "(d) + RandomErasing p=0.25",
}
DECODE_NAMES = {
    "j": "bare decoder on the records' bytes",
    "i": "LazyLMDBDataset decode=tensor [i], no transform",
    "jf": "bare decoder, in the rounds of (f)",
    "f": "(i) read the first time (a new dataset)",
}
PRESETS: dict[str, dict[str, Any]] = {
    "r": {"auto_augment": "rand", "magnitude": 9, "num_ops": 2},
    "t": {"auto_augment": "trivial"},
    "x": {"auto_augment": "augmix", "magnitude": 3},
    "z": {"random_erase": 0.25},
}


class ImageFolderLMDB(Dataset[tuple[Any, int]]):
    """The recipe's dataset, in its fork-safe form: the environment opens in ``__getitem__``."""

    def __init__(self, db_path: str, transform: Callable[[Any], Any] | None = None) -> None:
        self.db_path = db_path
        self.transform = transform
        self.env: lmdb.Environment | None = None
        env = self._open()
        with env.begin(write=False) as txn:
            self.length = pickle.loads(txn.get(b"__len__"))
            self.keys = pickle.loads(txn.get(b"__keys__"))
        env.close()

    def _open(self) -> lmdb.Environment:
        return lmdb.open(
            self.db_path,
            subdir=os.path.isdir(self.db_path),
            readonly=True,
            lock=False,
            readahead=False,
            meminit=False,
        )

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if self.env is None:
            self.env = self._open()
        with self.env.begin(write=False) as txn:
            byteflow = txn.get(self.keys[index])
        unpacked = pickle.loads(byteflow)
        buf = io.BytesIO()
        buf.write(unpacked[0])
        buf.seek(0)
        img = Image.open(buf).convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, unpacked[1]

    def __len__(self) -> int:
        return int(self.length)


def seed_transform() -> Callable[[Any], torch.Tensor]:
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def _one_thread(worker_id: int) -> None:
    torch.set_num_threads(1)


def _loader(dataset: Dataset[Any], batch_size: int, workers: int) -> DataLoader[Any]:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,
        worker_init_fn=_one_thread,
        generator=torch.Generator().manual_seed(0),
    )


def _loader_pass(loader: DataLoader[Any], normalize: bool) -> tuple[int, float]:
    n = 0
    start = time.perf_counter()
    for images, _ in loader:
        if normalize:
            images = normalize_batch(images)  # in training this runs on the GPU
        n += len(images)
    return n, time.perf_counter() - start


def _inprocess_pass(dataset: Dataset[Any], n: int) -> tuple[int, float]:
    order = torch.randperm(n).tolist()
    start = time.perf_counter()
    for i in order:
        dataset[i]
    return n, time.perf_counter() - start


def _decode_rounds(db: str, rounds: int) -> dict[str, list[float]]:
    """(j), (i) and (f) of the docstring, paired record by record: img/s of each, per round.

    Each round draws 300 records at random; each record is decoded bare and
    read as an item one right after the other (which goes first alternates),
    each call timed alone. Pairing by record, not by pass, keeps the machine's
    drift and each photo's size out of the ratio: a bare decoder against
    itself reads 1.000 with a quartile spread of 0.003 here. (i) is read from
    a dataset that has read every record before (a training run's epochs
    after the first); (f) from a new dataset each round, 300 different records
    (its first epoch): the bare decoder's rates of each half are kept apart.
    """
    from torchcodec.decoders import decode_jpeg

    dataset = LazyLMDBDataset(db)
    records = [dataset._record(i)[0] for i in range(len(dataset))]
    generator = torch.Generator().manual_seed(0)

    def bare(i: int) -> object:  # TorchCodec's own decoder, on bytes read beforehand
        return decode_jpeg(torch.frombuffer(records[i], dtype=torch.uint8), mode="RGB")

    for i in range(len(dataset)):  # warm-up: the page cache, the decoder's first calls
        bare(i)
        dataset[i]
    clock = time.perf_counter
    rates: dict[str, list[float]] = {"j": [], "i": [], "jf": [], "f": []}
    for r in range(2 * rounds):
        first_reads = r % 2 == 1  # the halves interleaved: the machine's hour hits both
        if first_reads:
            item: Callable[[int], object] = LazyLMDBDataset(db).__getitem__
            order = torch.randperm(len(dataset), generator=generator)[:300].tolist()
            names = ("jf", "f")
        else:
            item = dataset.__getitem__
            order = torch.randint(len(dataset), (300,), generator=generator).tolist()
            names = ("j", "i")
        spent = dict.fromkeys(names, 0.0)
        for n, i in enumerate(order):
            first, second = (names[0], bare), (names[1], item)
            if n % 2:
                first, second = second, first
            start = clock()
            first[1](i)
            middle = clock()
            second[1](i)
            end = clock()
            spent[first[0]] += middle - start
            spent[second[0]] += end - middle
        for k in names:
            rates[k].append(len(order) / spent[k])
    return rates


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    tree = photo_tree(args.images, args.classes)
    work = OUT / "loader"
    work.mkdir(parents=True, exist_ok=True)
    seed_db, ddpkit_db = str(work / "seed.lmdb"), str(work / "ddpkit.lmdb")
    remove_db(seed_db)
    folder2lmdb(tree, seed_db, workers=2)
    build_lmdb(tree, ddpkit_db, check="header", workers=2, progress=False, overwrite=True)
    _describe(tree, args)
    decoding = _decode_rounds(ddpkit_db, 8 * args.rounds)
    print(
        f"  in this process, {8 * args.rounds} rounds of each: "
        + "  ".join(f"({k}) {statistics.median(v):.0f}" for k, v in decoding.items()),
        flush=True,
    )
    if args.decode_only:
        _report({}, decoding, args)
        return

    tensor_set = LazyLMDBDataset(ddpkit_db, train_transform(224))
    datasets: dict[str, Dataset[Any]] = {
        "a": ImageFolderLMDB(seed_db, seed_transform()),
        "b": ImageFolder(str(tree), transform=seed_transform()),
        "c": LazyLMDBDataset(ddpkit_db, train_transform(224, decode="pil"), decode="pil"),
        "d": tensor_set,
        "n": tensor_set,
        **{k: LazyLMDBDataset(ddpkit_db, train_transform(224, **kw)) for k, kw in PRESETS.items()},
    }
    rates: dict[int, dict[str, list[float]]] = {}
    for workers in args.workers:
        loaders = {k: _loader(ds, args.batch_size, workers) for k, ds in datasets.items()}
        passes: dict[str, Callable[[], tuple[int, float]]] = {
            k: partial(_loader_pass, loader, normalize=k == "n") for k, loader in loaders.items()
        }
        passes["e"] = partial(_inprocess_pass, tensor_set, len(tensor_set))
        for run_pass in passes.values():  # warm-up: worker start, page cache, first epoch
            run_pass()
        rates[workers] = {k: [] for k in passes}
        order = list(passes)
        for r in range(args.rounds):
            for k in order if r % 2 == 0 else order[::-1]:
                images, seconds = passes[k]()
                rates[workers][k].append(images / seconds)
            print(
                f"  {workers} worker(s), round {r + 1}/{args.rounds}: "
                + "  ".join(f"({k}) {rates[workers][k][-1]:.0f}" for k in order),
                flush=True,
            )
        del loaders, passes
        gc.collect()  # shuts the persistent workers down before the next worker count
    _report(rates, decoding, args)


def _describe(tree: Path, args: argparse.Namespace) -> None:
    files = sorted(tree.glob("*/*.jpg"))
    sizes = []
    for f in files:
        with Image.open(f) as image:
            sizes.append(image.size)
    mean_w = statistics.fmean(s[0] for s in sizes)
    mean_h = statistics.fmean(s[1] for s in sizes)
    kib = statistics.fmean(f.stat().st_size for f in files) / 1024
    print(
        f"{len(files)} JPEGs in {args.classes} classes, mean {mean_w:.0f}x{mean_h:.0f} px, "
        f"{kib:.1f} KiB; batch {args.batch_size}; {args.rounds} timed rounds; 1 torch thread "
        f"per process; {os.cpu_count()} CPUs\nPython {platform.python_version()}, torch "
        f"{torch.__version__}, torchvision {torchvision.__version__}, Pillow {PIL.__version__}",
        flush=True,
    )


def _ratio(rates: dict[str, list[float]], top: str, bottom: str, scale: float = 1.0) -> float:
    return statistics.median(t * scale / b for t, b in zip(rates[top], rates[bottom], strict=True))


def _report(
    rates: dict[int, dict[str, list[float]]],
    decoding: dict[str, list[float]],
    args: argparse.Namespace,
) -> None:
    counts = list(rates)
    if counts:
        _report_loaders(rates, args)
    print(f"\nin this process: img/s, median of {len(decoding['j'])} rounds (min-max)")
    for k, name in DECODE_NAMES.items():
        v = decoding[k]
        print(f"({k}) {name:46} {statistics.median(v):6.0f} ({min(v):.0f}-{max(v):.0f})")
    for top, bottom in (("i", "j"), ("f", "jf")):
        each = sorted(t / b for t, b in zip(decoding[top], decoding[bottom], strict=True))
        print(f"({top})/({bottom}) per round, sorted: {', '.join(f'{r:.3f}' for r in each)}")

    print("\ntargets")
    _target("(i)/(j) >= 0.95: an item costs its decode", _ratio(decoding, "i", "j"), 0.95)
    first = _ratio(decoding, "f", "jf")
    print(f"  {'(f)/(jf): the same, its first read':44} {first:6.3f}  (information)")
    for w in counts:
        _target(f"(d)/(a) >= 2.0, {w} worker(s)", _ratio(rates[w], "d", "a"), 2.0)
    for w in counts:
        _target(f"(c)/(a) >= 1.0, {w} worker(s)", _ratio(rates[w], "c", "a"), 1.0)
    for w in counts:
        _target(
            f"(d) per worker >= 0.85 x (e), {w} worker(s)", _ratio(rates[w], "d", "e", 1 / w), 0.85
        )


def _report_loaders(rates: dict[int, dict[str, list[float]]], args: argparse.Namespace) -> None:
    counts = list(rates)
    print(f"\nimg/s, median of {args.rounds} passes (min-max)")
    print(f"{'contender':46}" + "".join(f"{f'{w} worker(s)':>22}" for w in counts))
    for k, name in NAMES.items():
        cells = []
        for w in counts:
            v = rates[w][k]
            cells.append(f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})")
        print(f"({k}) {name:42}" + "".join(f"{c:>22}" for c in cells))
    print(f"\n{'ratio (median of per-round ratios)':46}" + "".join(f"{w:>22}" for w in counts))
    pairs = [
        ("(c)/(a)", "c", "a"),
        ("(d)/(a)", "d", "a"),
        ("(d)/(b)", "d", "b"),
        ("(n)/(a)", "n", "a"),
    ]
    for label, top, bottom in pairs:
        print(f"{label:46}" + "".join(f"{_ratio(rates[w], top, bottom):>22.2f}" for w in counts))
    per_worker = "(d) per worker / (e)"
    print(
        f"{per_worker:46}" + "".join(f"{_ratio(rates[w], 'd', 'e', 1 / w):>22.2f}" for w in counts)
    )

    print(
        f"\n{'preset: ms per image over (d), per worker':46}" + "".join(f"{w:>22}" for w in counts)
    )
    for k in PRESETS:
        cells = []
        for w in counts:
            extra = [
                w * (1 / p - 1 / d) * 1e3 for p, d in zip(rates[w][k], rates[w]["d"], strict=True)
            ]
            cells.append(f"{statistics.median(extra):.2f}")
        print(f"({k}) {NAMES[k]:42}" + "".join(f"{c:>22}" for c in cells))


def _target(what: str, value: float, low: float) -> None:
    print(f"  {what:44} {value:6.3f}  {'PASS' if value >= low else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="JPEGs in the tree (2000)")
    parser.add_argument("--classes", type=int, default=10, help="class directories (10)")
    parser.add_argument("--batch-size", type=int, default=64, help="per batch (64)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="(1 2)")
    parser.add_argument("--rounds", type=int, default=5, help="timed passes per contender (5)")
    parser.add_argument("--quick", action="store_true", help="300 images, 2 rounds: a smoke run")
    parser.add_argument(
        "--decode-only", action="store_true", help="only (i) against (j), in this process"
    )
    args = parser.parse_args()
    if args.quick:
        args.images, args.rounds = min(args.images, 300), min(args.rounds, 2)
    run(args)


if __name__ == "__main__":
    main()
