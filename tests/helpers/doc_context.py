"""The small world the documentation's code blocks run in.

``make_world`` writes the files the docs name (``data/train`` and
``data/val`` ImageFolder trees of 6 shape classes at 32 px, their LMDB files
under ``data/`` and ``data/lmdb/``, a checkpoint, a folder2lmdb-style
database); ``names`` builds, on demand, the objects a snippet takes
as given (``model``, ``train_loader``, ``criterion`` ...). Everything is small
so the whole documentation runs in a few minutes on two CPU cores.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

CLASSES = 6
TRAIN_PER_CLASS = 50  # 300 training images: more than the docs' global batch of 256
VAL_PER_CLASS = 10


def make_world(root: Path) -> Path:
    """Write the template every documentation file starts from."""
    import torch
    from lmdb_fixtures import write_legacy_db  # type: ignore[import-not-found]

    import ddpkit
    from ddpkit.checkpoint import TrainingState
    from ddpkit.data import make_shapes_dataset

    data = root / "data"
    train_dir, val_dir = make_shapes_dataset(
        data / "shapes",
        classes=CLASSES,
        train_per_class=TRAIN_PER_CLASS,
        val_per_class=VAL_PER_CLASS,
        size=32,
    )
    # The docs name these folders: an ImageFolder tree as data/train, a
    # "/data/imagenet/train" and "/data/images/train" (absolute paths in the docs
    # become paths under the world, /data -> data).
    for parent in (data, data / "imagenet", data / "images"):
        parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(train_dir, parent / "train", dirs_exist_ok=True)
        shutil.copytree(val_dir, parent / "val", dirs_exist_ok=True)
    shutil.rmtree(data / "shapes")
    for split in ("train", "val"):
        ddpkit.build_lmdb(data / split, data / f"{split}.lmdb", progress=False)
        (data / "lmdb").mkdir(exist_ok=True)
        _copy(data / f"{split}.lmdb", data / "lmdb" / f"{split}.lmdb")
    _copy(data / "train.lmdb", root / "train.lmdb")
    for part in ("part-0.lmdb", "part-1.lmdb"):
        _copy(data / "val.lmdb", root / part)
    first = sorted((data / "train").rglob("*.jpg"))[:4]
    write_legacy_db(root / "old-folder2lmdb.lmdb", [p.read_bytes() for p in first], [0, 1, 2, 3])
    model = small_model()
    optimizer = optimizer_for(model)
    state = TrainingState(model, optimizer, torch.optim.lr_scheduler.MultiStepLR(optimizer, [1]))
    ddpkit.CheckpointManager(root / "checkpoints", prefix="doc", state=state).save(0)
    os.symlink(ROOT / "examples", root / "examples")
    return root


ROOT = Path(__file__).resolve().parents[2]


def _copy(source: Path, target: Path) -> None:
    """An LMDB environment is a directory or, built with subdir=False, a file."""
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy(source, target)


def small_model(num_classes: int = CLASSES) -> Any:
    import timm

    return timm.create_model("test_resnet", num_classes=num_classes)


def optimizer_for(model: Any) -> Any:
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def main(info: Any) -> None:
    """What the docs' ``main(info)`` stands for: one collective, then return."""
    import ddpkit

    ddpkit.barrier()


class MyNet:  # the README's user model; a class so that ``MyNet()`` reads as in the docs
    def __new__(cls) -> Any:
        return small_model()


def names() -> dict[str, Callable[[dict[str, Any]], Any]]:
    """Builders of the names a snippet takes as given, each from the names before it."""
    import socket
    import sys
    from dataclasses import dataclass, field
    from datetime import timedelta

    import timm
    import torch
    import torch.nn.functional as F

    import ddpkit
    from ddpkit.checkpoint import TrainingState
    from ddpkit.distributed.parallel import no_sync
    from ddpkit.training.losses import FocalLoss

    def continuing_manager(ns: dict[str, Any]) -> Any:
        """The manager of the world's run in ``checkpoints``, bound to the docs' ``model`` and
        ``optimizer`` and resumed: the docs' loops continue it (a fresh manager refuses a
        directory that holds another run)."""
        state = TrainingState(ns["model"], ns["optimizer"])
        manager = ddpkit.CheckpointManager("checkpoints", prefix="doc", state=state)
        manager.resume()
        return manager

    def first_batch(ns: dict[str, Any]) -> Any:
        return next(iter(ns["train_loader"]))

    def history(ns: dict[str, Any]) -> Any:
        return ddpkit.fit(
            ns["model"],
            ns["train_loader"],
            ns["optimizer"],
            criterion=ns["criterion"],
            epochs=1,
            val_loader=ns["val_loader"],
            report=ddpkit.ReportConfig(progress=False, verbose=False),
        )

    def weights(ns: dict[str, Any]) -> str:
        torch.save(small_model().state_dict(), "weights.pth")
        return "weights.pth"

    def build_or_open_cache(path: str) -> Path:
        cache = Path(path + ".cache")
        cache.mkdir(exist_ok=True)
        return cache

    constant = {
        "ddpkit": ddpkit,
        "torch": torch,
        "timm": timm,
        "socket": socket,
        "sys": sys,
        "F": F,
        "FocalLoss": FocalLoss,
        "no_sync": no_sync,
        "dataclass": dataclass,
        "field": field,
        "timedelta": timedelta,
        "MyNet": MyNet,
        "main": main,
        "build_model": small_model,
        "build_or_open_cache": build_or_open_cache,
        "n": CLASSES,
        "epoch": 0,
        "epochs": 2,
        "acc1": 50.0,
        "last_micro_step": True,
        "obj": {"host": socket.gethostname()},
        "w": [1.0, 2.0, 0.5, 1.0, 1.0, 3.0],
        "s": 0.1,
        "k": 2,
        "r": "mean",
    }
    built: dict[str, Callable[[dict[str, Any]], Any]] = {
        name: (lambda ns, value=value: value) for name, value in constant.items()
    }
    built.update(
        {
            "info": lambda ns: ddpkit.init_distributed(),
            "train": lambda ns: ddpkit.LazyLMDBDataset(
                "data/train.lmdb", ddpkit.train_transform(32)
            ),
            "val": lambda ns: ddpkit.LazyLMDBDataset("data/val.lmdb", ddpkit.val_transform(32)),
            "train_loader": lambda ns: ddpkit.build_loader(
                ns["train"], global_batch_size=32, train=True, info=ns["info"], workers=0
            ),
            "loader": lambda ns: ns["train_loader"],
            "val_loader": lambda ns: ddpkit.build_loader(
                ns["val"], batch_size=32, train=False, info=ns["info"], workers=0
            ),
            "model": lambda ns: small_model(),
            "optimizer": lambda ns: optimizer_for(ns["model"]),
            "scheduler": lambda ns: torch.optim.lr_scheduler.MultiStepLR(ns["optimizer"], [1]),
            "scaler": lambda ns: torch.amp.GradScaler("cpu", enabled=False),
            "criterion": lambda ns: FocalLoss(num_class=CLASSES, gamma=2.0, smooth=0.1),
            "manager": continuing_manager,
            "images": lambda ns: first_batch(ns)[0],
            "batch": lambda ns: first_batch(ns)[0],
            "targets": lambda ns: first_batch(ns)[1],
            "target": lambda ns: first_batch(ns)[1],
            "x": lambda ns: torch.ones(3),
            "y": lambda ns: torch.tensor([0, 1, 2, 3, 4, 5, 2, 1]),
            # With the docs' y (8 targets) random logits; else the model's on a batch.
            "logits": lambda ns: (
                torch.randn(8, CLASSES)
                if "y" in ns.needs
                else ns["model"](ddpkit.normalize_batch(ns["images"]))
            ),
            "pred": lambda ns: ns["logits"].argmax(1),
            "loss": lambda ns: ns["criterion"](ns["logits"], ns["targets"]),
            "history": history,
            "path": weights,
        }
    )
    return built
