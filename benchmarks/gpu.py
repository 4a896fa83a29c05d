"""On one GPU: SE-ResNeXt-101 at 224 px, images per second of training, three pipelines.

(a) the seed recipe's pipeline: fp32, Pillow decoding and torchvision's
    transforms in the data workers, float batches;
(b) ddpkit's default: bf16 autocast, channels-last, uint8 batches decoded
    on the CPU by the workers (``decode="tensor"``), normalised on the GPU;
(c) (b) decoding on the GPU (``decode="cuda"``: the workers read bytes and
    draw the crops, each batch decodes with nvJPEG);
and the loader alone, with CPU and with GPU decoding: is the GPU data-bound?

Each round runs every pipeline for the same number of steps, in the order
a b c c b a (then reversed), so a drift of the machine falls on all alike;
the ratios per round, their median and spread are printed. The photos are
crops of real photographs at ImageNet sizes (``benchmarks/_photos.py``),
in a ddpkit LMDB database. Without CUDA it says so and exits 0.

    python benchmarks/gpu.py [--images 4096] [--batch-size 128] [--steps 30] [--rounds 4]
                             [--workers N] [--seconds 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

PIPELINES = {
    "a": "seed: fp32, Pillow in workers",
    "b": "ddpkit: bf16, channels-last, CPU decode",
    "c": "ddpkit: bf16, channels-last, GPU decode",
}


def _say_no_gpu() -> None:
    print("benchmarks/gpu.py: no CUDA device here (torch.cuda.is_available() is False): nothing")
    print("measured. On a GPU it trains SE-ResNeXt-101 at 224 px and prints images/s of:")
    for key, name in PIPELINES.items():
        print(f"  ({key}) {name}")
    print("  the loader alone, CPU decode and GPU decode; and the ratios b/a, c/b, loader gpu/cpu")


def _database(images: int) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _photos import OUT, photo_tree

    import ddpkit

    path = OUT / f"gpu-photos-{images}.lmdb"
    if not path.exists():
        ddpkit.build_lmdb(photo_tree(images, 100), path, progress=False)
    return path


def _loaders(db: Path, batch: int, workers: int) -> dict[str, Any]:
    import torchvision.transforms as T

    import ddpkit

    normalize = T.Normalize(ddpkit.IMAGENET_MEAN, ddpkit.IMAGENET_STD)
    seed_tf = T.Compose(
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize]
    )
    common = {"batch_size": batch, "train": True, "workers": workers, "pin_memory": True}
    return {
        "a": ddpkit.build_loader(ddpkit.LazyLMDBDataset(db, seed_tf, decode="pil"), **common),
        "b": ddpkit.build_loader(ddpkit.LazyLMDBDataset(db, ddpkit.train_transform(224)), **common),
        "c": ddpkit.build_loader(
            ddpkit.LazyLMDBDataset(db, ddpkit.train_transform(224), decode="cuda"), **common
        ),
    }


def _batches(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _steps(key: str, model: nn.Module, batches: Iterator[Any], device: torch.device) -> Callable:
    import ddpkit

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()

    def run(steps: int) -> float:
        torch.cuda.synchronize()
        start, seen = time.perf_counter(), 0
        for _ in range(steps):
            images, targets = next(batches)
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            if key == "a":
                logits = model(images)
            else:
                images = ddpkit.normalize_batch(images).contiguous(
                    memory_format=torch.channels_last
                )
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(images)
            loss = criterion(logits.float(), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += targets.shape[0]
        torch.cuda.synchronize()
        return seen / (time.perf_counter() - start)

    return run


def _loader_alone(batches: Iterator[Any], device: torch.device) -> Callable:
    def run(steps: int) -> float:
        torch.cuda.synchronize()
        start, seen = time.perf_counter(), 0
        for _ in range(steps):
            images, targets = next(batches)
            images.to(device, non_blocking=True)
            seen += targets.shape[0]
        torch.cuda.synchronize()
        return seen / (time.perf_counter() - start)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=4096, help="photos in the database (4096)")
    parser.add_argument("--batch-size", type=int, default=128, help="per step (128)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per pipeline (30)")
    parser.add_argument("--rounds", type=int, default=4, help="paired rounds (4)")
    parser.add_argument("--workers", type=int, default=None, help="data workers (CPUs - 2)")
    parser.add_argument("--seconds", type=float, default=300.0, help="stop rounds after (300)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        _say_no_gpu()
        return 0
    import timm

    began = time.monotonic()
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    workers = args.workers if args.workers is not None else max(1, (os.cpu_count() or 4) - 2)
    loaders = _loaders(_database(args.images), args.batch_size, workers)
    streams = {k: _batches(v) for k, v in loaders.items()}
    runs: dict[str, Callable] = {}
    for key in PIPELINES:
        model = timm.create_model("legacy_seresnext101_32x4d", num_classes=100).to(device)
        if key != "a":
            model = model.to(memory_format=torch.channels_last)
        runs[key] = _steps(key, model, streams[key], device)
    runs["loader-cpu"] = _loader_alone(_batches(loaders["b"]), device)
    runs["loader-gpu"] = _loader_alone(_batches(loaders["c"]), device)
    for run in runs.values():
        run(3)  # warm-up: workers, cuDNN's algorithm search, the allocator
    rates: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(args.rounds):
        if time.monotonic() - began > args.seconds and r > 0:
            break
        ordered = order if r % 2 == 0 else order[::-1]
        for key in ordered + ordered[::-1]:
            rates[key].append(runs[key](args.steps // 2 or 1))
    per_round = {
        k: [statistics.mean(v[i : i + 2]) for i in range(0, len(v), 2)] for k, v in rates.items()
    }
    gpu = torch.cuda.get_device_name(device)
    print(f"{gpu}, batch {args.batch_size}, {workers} workers, {len(per_round['a'])} rounds")
    print("pipeline                                      images/s (median)   spread")
    figures: dict[str, Any] = {"gpu": gpu}
    for key in runs:
        values = per_round[key]
        name = PIPELINES.get(key, "the loader alone, " + ("GPU" if "gpu" in key else "CPU"))
        spread = f"{min(values):.0f}-{max(values):.0f}"
        print(f"{key} {name:42s} {statistics.median(values):10.0f}   {spread}")
        figures[key] = statistics.median(values)
    for label, top, bottom in (
        ("b / a", "b", "a"),
        ("c / b", "c", "b"),
        ("loader gpu / cpu", "loader-gpu", "loader-cpu"),
    ):
        ratios = [t / b for t, b in zip(per_round[top], per_round[bottom], strict=True)]
        figures[label] = statistics.median(ratios)
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(f"{label:18s} {statistics.median(ratios):6.2f}   (spread {spread})")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
