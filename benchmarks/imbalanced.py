"""What helps on imbalanced data: losses, balanced sampling and RandAugment, measured side by side.

The data: scikit-learn's handwritten digits (1,797 real 8 x 8 scans, 10
classes), shown as 32 x 32 RGB uint8 images. Per class, 50 images form a
balanced validation set; of the rest, class k keeps ``128 * ratio ** (-k /
9)`` for training, a long tail from 128 images down to 2 (1:64 by default).

Each configuration trains the same tiny CNN for the same number of epochs
through ``ddpkit.build_loader`` (one process, its seeded samplers) and
``ddpkit.train_transform`` (a random crop, and RandAugment when asked):
cross-entropy, FocalLoss, cross-entropy with square-root or class-balanced
draws, FocalLoss with class-balanced draws; each with and without
RandAugment; each over 3 seeds. It reports top-1, mean per-class recall
and the worst class's recall on the balanced validation set, mean +- the
standard deviation over seeds, as a Markdown table, and draws a plot.

    python benchmarks/imbalanced.py                 # the table of docs/imbalanced.md
    python benchmarks/imbalanced.py --plot docs/imbalanced.png
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sklearn.datasets import load_digits  # type: ignore[import-untyped]
from torch import nn
from torch.utils.data import Dataset

from ddpkit import FocalLoss, build_loader, set_epoch, train_transform, val_transform

SIZE, CROP = 32, 28


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


def train_and_measure(
    config: Config, split: dict[str, Any], seed: int, epochs: int
) -> dict[str, float]:
    torch.manual_seed(seed)
    images, labels = split["images"], split["labels"]
    aug = {"auto_augment": "rand", "magnitude": 9, "num_ops": 2} if config.randaugment else {}
    train_tf = train_transform(CROP, scale=(0.6, 1.0), hflip=False, **aug)  # type: ignore[arg-type]
    train_set = Digits(images[split["train"]], labels[split["train"]].tolist(), train_tf)
    val_set = Digits(images[split["val"]], labels[split["val"]].tolist(), val_transform(CROP, CROP))
    loader = build_loader(train_set, batch_size=32, train=True, workers=0, seed=seed,
                          balance=config.balance, drop_last=False)  # fmt: skip
    model = tiny_cnn()
    criterion: nn.Module = FocalLoss(gamma=2.0) if config.loss == "focal" else nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=1e-2, total_steps=epochs * len(loader)
    )
    for epoch in range(epochs):
        set_epoch(loader, epoch)
        model.train()
        for x, y in loader:
            loss = criterion(model(x.float() / 255 - 0.5), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    model.eval()
    x = torch.stack([val_set[i][0] for i in range(len(val_set))])
    y = torch.tensor(val_set.targets)
    with torch.no_grad():
        predicted = model(x.float() / 255 - 0.5).argmax(1)
    recall = torch.stack([(predicted[y == k] == k).float().mean() for k in range(10)])
    return {
        "top1": 100 * float((predicted == y).float().mean()),
        "mean_recall": 100 * float(recall.mean()),
        "worst_recall": 100 * float(recall.min()),
    }


def _cell(values: list[float]) -> str:
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratio", type=float, default=64.0, help="head : tail images (64)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs per run (20)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration (3)")
    parser.add_argument("--plot", type=Path, help="write the plot to this PNG")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    split = long_tailed_digits(args.ratio)
    counts = torch.bincount(split["labels"][split["train"]], minlength=10).tolist()
    print(
        f"train: {len(split['train'])} images, per class {counts} (1:{counts[0] / counts[-1]:.0f});"
        f" val: {len(split['val'])} (50 per class); {args.epochs} epochs, {args.seeds} seeds\n"
        f"Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs",
        flush=True,
    )
    start = time.perf_counter()
    results: dict[str, list[dict[str, float]]] = {}
    for config in CONFIGS:
        runs = [train_and_measure(config, split, s, args.epochs) for s in range(args.seeds)]
        results[config.name] = runs
        print(f"  {config.name}: " + ", ".join(f"{r['mean_recall']:.1f}" for r in runs), flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s\n")
    print("| configuration | top-1 % | mean per-class recall % | worst-class recall % |")
    print("| --- | --- | --- | --- |")
    for name, runs in results.items():
        cells = [_cell([r[m] for r in runs]) for m in ("top1", "mean_recall", "worst_recall")]
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
    ax.set_title("Long-tailed digits (1:64): mean ± sd over 3 seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
