"""What helps on imbalanced data: losses, balanced sampling and RandAugment, measured side by side.

The data: scikit-learn's handwritten digits (1,797 real 8 x 8 scans, 10
classes), shown as 32 x 32 RGB uint8 images. Per class, 50 images form a
balanced validation set; of the rest, class k keeps ``128 * ratio ** (-k /
9)`` for training, a long tail from 128 images down to 2 (1:64 by default).

Every configuration is the library's own path: loaders from
``ddpkit.build_loader`` (its seeded samplers; ``balance=`` for square-root
and class-balanced draws, the same ``WeightedDistributedSampler`` a
distributed job uses), ``ddpkit.train_transform`` (a random crop, and
RandAugment when asked), and training and validation by ``ddpkit.fit``. The
same tiny CNN, optimizer, schedule and epochs throughout: cross-entropy,
the recipe's FocalLoss (``FocalLoss(alpha=0.25, gamma=2, num_class=10,
smooth=0.1)``), cross-entropy with square-root or class-balanced draws,
FocalLoss with class-balanced draws; each with and without RandAugment;
each over 3 seeds. It reports ``fit``'s last-epoch top-1, mean per-class
recall and worst class's recall on the balanced validation set, mean +- the
standard deviation over seeds, as a Markdown table, and draws a plot.

    python benchmarks/imbalanced.py                 # the table of docs/imbalanced.md
    python benchmarks/imbalanced.py --plot docs/imbalanced.png
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sklearn.datasets import load_digits  # type: ignore[import-untyped]
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit import (
    FocalLoss,
    ReportConfig,
    TrainConfig,
    build_loader,
    train_transform,
    val_transform,
)

SIZE, CROP = 32, 28
CLASSES = 10
# The settings each row names, printed with the table.
FOCAL = {"alpha": 0.25, "gamma": 2, "num_class": CLASSES, "smooth": 0.1}  # the recipe's call
RANDAUGMENT = {"auto_augment": "rand", "magnitude": 9, "num_ops": 2}  # torchvision's 9 of 30
BATCH, LR, WEIGHT_DECAY = 32, 1e-2, 1e-4


class Digits(Dataset[tuple[torch.Tensor, int]]):
    """uint8 3 x 32 x 32 images of sklearn's digits, with ``targets`` for balanced draws."""

    def __init__(self, images: torch.Tensor, labels: list[int], transform: Any) -> None:
        self.images, self.targets, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[index]), self.targets[index]


def long_tailed_digits(ratio: float, val_per_class: int = 50, head: int = 128) -> dict[str, Any]:
    """The long-tailed training split and the balanced validation split (fixed, seed 0)."""
    digits = load_digits()
    pixels = torch.tensor(digits.images, dtype=torch.float32)[:, None] * (255 / 16)
    images = nn.functional.interpolate(pixels, (SIZE, SIZE), mode="bilinear", align_corners=False)
    images = images.round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    labels = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    train, val = [], []
    for k in range(10):
        members = (labels == k).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=g)]
        keep = max(1, round(head * ratio ** (-k / 9)))
        val += members[:val_per_class].tolist()
        train += members[val_per_class : val_per_class + keep].tolist()
    return {"images": images, "labels": labels, "train": train, "val": val}


def tiny_cnn(classes: int = 10) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 8), nn.MaxPool2d(2), *block(8, 16), nn.MaxPool2d(2), *block(16, 32),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    )  # fmt: skip


@dataclass(frozen=True)
class Config:
    name: str
    loss: str  # "ce" or "focal"
    balance: float | None  # build_loader's power of the class sizes; None: plain shuffle
    randaugment: bool


CONFIGS = [
    Config(f"{base}{' + RandAugment' if ra else ''}", loss, balance, ra)
    for ra in (False, True)
    for base, loss, balance in [
        ("CE", "ce", None),
        ("Focal", "focal", None),
        ("CE + sqrt sampling", "ce", 0.5),
        ("CE + class-balanced", "ce", 1.0),
        ("Focal + class-balanced", "focal", 1.0),
    ]
]


def criterion_of(config: Config) -> nn.Module:
    if config.loss == "focal":
        return FocalLoss(**FOCAL)  # type: ignore[arg-type]
    return nn.CrossEntropyLoss()


def train_and_measure(
    config: Config, split: dict[str, Any], seed: int, epochs: int
) -> dict[str, float]:
    """Train with ``ddpkit.fit`` on ``build_loader``'s loaders; its last epoch's validation."""
    torch.manual_seed(seed)  # the model's initial weights
    images, labels = split["images"], split["labels"]
    aug = RANDAUGMENT if config.randaugment else {}
    train_tf = train_transform(CROP, scale=(0.6, 1.0), hflip=False, **aug)  # type: ignore[arg-type]
    train_set = Digits(images[split["train"]], labels[split["train"]].tolist(), train_tf)
    val_set = Digits(images[split["val"]], labels[split["val"]].tolist(), val_transform(CROP, CROP))
    train_loader = build_loader(train_set, batch_size=BATCH, train=True, workers=0, seed=seed,
                                balance=config.balance, drop_last=False)  # fmt: skip
    val_loader = build_loader(val_set, batch_size=250, train=False, workers=0)
    model = tiny_cnn(CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=LR, total_steps=epochs * len(train_loader)
    )
    history = ddpkit.fit(
        model, train_loader, optimizer, criterion=criterion_of(config), epochs=epochs,
        val_loader=val_loader, scheduler=scheduler,
        config=TrainConfig(scheduler_per_step=True),  # uint8 batches: ImageNet normalisation
        report=ReportConfig(progress=False, verbose=False),
    )  # fmt: skip
    last = history.last
    recall = [float(r) for r in last["val_recall"]]  # every class has 50 validation images
    return {
        "top1": float(last["val_acc1"]),
        "mean_recall": statistics.fmean(recall),
        "worst_recall": min(recall),
    }


def _one_thread() -> None:
    torch.set_num_threads(1)  # a tiny model: more threads only contend


def _run(job: tuple[Config, int], split: dict[str, Any], epochs: int) -> dict[str, float]:
    config, seed = job
    return train_and_measure(config, split, seed, epochs)


def _kwargs(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in settings.items())


def _cell(values: list[float]) -> str:
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratio", type=float, default=64.0, help="head : tail images (64)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs per run (20)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration (3)")
    parser.add_argument("--plot", type=Path, help="write the plot to this PNG")
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at once (2)"
    )
    args = parser.parse_args()
    split = long_tailed_digits(args.ratio)
    counts = torch.bincount(split["labels"][split["train"]], minlength=10).tolist()
    print(
        f"train: {len(split['train'])} images, per class {counts} (1:{counts[0] / counts[-1]:.0f});"
        f" val: {len(split['val'])} (50 per class); {args.epochs} epochs, {args.seeds} seeds\n"
        f"ddpkit.fit on ddpkit.build_loader loaders (workers=0), batch {BATCH}, AdamW lr {LR} "
        f"wd {WEIGHT_DECAY}, one-cycle per step\n"
        f"CE: nn.CrossEntropyLoss(); Focal: ddpkit.FocalLoss({_kwargs(FOCAL)})\n"
        f"sampling: build_loader(balance=None | 0.5 | 1.0); RandAugment: "
        f"train_transform({_kwargs(RANDAUGMENT)})\n"
        f"Python {platform.python_version()}, torch {torch.__version__}, ddpkit "
        f"{ddpkit.__version__}, {os.cpu_count()} CPUs ({platform.machine()}), {args.jobs} runs at "
        f"once, one thread each; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    start = time.perf_counter()
    results: dict[str, list[dict[str, float]]] = {}
    jobs = [(c, s) for c in CONFIGS for s in range(args.seeds)]
    # One process a run at a time, each on one thread: a run's figures do not depend on --jobs.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_one_thread) as pool:
        done = pool.map(_run, jobs, [split] * len(jobs), [args.epochs] * len(jobs))
        for (config, _), figures in zip(jobs, done, strict=True):
            results.setdefault(config.name, []).append(figures)
            if len(results[config.name]) == args.seeds:
                recalls = ", ".join(f"{r['mean_recall']:.1f}" for r in results[config.name])
                print(f"  {config.name}: {recalls}", flush=True)
    print(
        f"\n{time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f} at the end\n"
    )
    print("| configuration | top-1 % | mean per-class recall % | worst-class recall % |")
    print("| --- | --- | --- | --- |")
    for name, measured in results.items():
        cells = [_cell([r[m] for r in measured]) for m in ("top1", "mean_recall", "worst_recall")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.plot is not None:
        _plot(results, args.plot)


def _plot(results: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.4
    for j, (metric, label) in enumerate([("mean_recall", "mean per-class recall"),
                                         ("worst_recall", "worst-class recall")]):  # fmt: skip
        means = [statistics.fmean(r[metric] for r in results[n]) for n in names]
        spread = [statistics.stdev(r[metric] for r in results[n]) for n in names]
        xs = [i + (j - 0.5) * width for i in range(len(names))]
        ax.bar(xs, means, width, yerr=spread, capsize=3, label=label)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% on the balanced validation set")
    seeds = len(next(iter(results.values())))
    ax.set_title(f"Long-tailed digits, ddpkit.fit: mean ± sd over {seeds} seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
