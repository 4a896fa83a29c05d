"""What the documentation tests change, and why, before a block runs.

``SUBSTITUTIONS`` scale the docs' real figures down to the small world
(``epochs=90`` becomes 2, 224 px becomes 32, ``/data/...`` becomes a path in
the world) without touching what the code does; each must still match its
file, so one that no longer applies fails the test instead of rotting.
``ARRANGE`` sets up what a block needs beyond the world: a database's place
made free, an input that is absent by default, the error an
``except ddpkit.X`` example catches. ``NOT_RAISED`` names the error examples
a single process cannot show, with the test that covers each.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from doc_blocks import Block

# (file, old, new): applied to every runnable block of the file, in order.
SUBSTITUTIONS: list[tuple[str, str, str]] = [
    # Absolute example paths live under the world.
    ("docs/data.md", "/data/", "data/"),
    ("docs/quickstart.md", "/data/", "data/"),
    ("docs/training.md", '"/local/ckpt"', '"local/ckpt"'),
    # Two epochs stand for ninety.
    ("docs/training.md", "epochs=90", "epochs=2"),
    ("docs/quickstart.md", "epochs=90", "epochs=2"),
    ("docs/training.md", "warmup_epochs=5", "warmup_epochs=1"),
    # The quickstart's script on 32 px shapes: a small timm model, no download.
    (
        "docs/quickstart.md",
        '"seresnext50_32x4d", pretrained=True',
        '"test_resnet", pretrained=False',
    ),
    ("docs/quickstart.md", "train_transform(224)", "train_transform(32)"),
    ("docs/quickstart.md", "val_transform(224, 256)", "val_transform(32, 37)"),
    ("docs/quickstart.md", "--epochs 30", "--epochs 1"),
    ("docs/quickstart.md", "--data data   #", "--data data --epochs 1   #"),
    ("docs/quickstart.md", "--warmup-epochs 5", "--warmup-epochs 1 --epochs 2"),
    # Two processes stand for a server's four GPUs (each process a fresh interpreter).
    ("docs/quickstart.md", "--nproc-per-node 4", "--nproc-per-node 2"),
    ("docs/quickstart.md", "--data data", "--data data --arch test_resnet --image-size 32"),
    # The recipe file on the same scale: one epoch of the small model at 32 px.
    ("docs/quickstart.md", "arch: legacy_seresnext50_32x4d", "arch: test_resnet\nimage_size: 32"),
    ("docs/quickstart.md", "epochs: 30", "epochs: 1"),
]


def substitute(block: Block) -> str:
    code = block.code
    for doc, old, new in SUBSTITUTIONS:
        if doc == block.doc:
            code = code.replace(old, new)
    return code


def unused_substitutions(blocks: list[Block]) -> list[tuple[str, str, str]]:
    runnable = [b for b in blocks if b.kind in ("run", "file")]
    return [s for s in SUBSTITUTIONS if not any(b.doc == s[0] and s[1] in b.code for b in runnable)]


def _remove(*paths: str) -> Callable[[Path], dict[str, Any]]:
    def arrange(world: Path) -> dict[str, Any]:
        for path in paths:
            target = world / path
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        return {}

    return arrange


def _pretrained_file(world: Path) -> dict[str, Any]:
    """Cadene's se_resnext101_32x4d file stands in as timm's ImageNet model (the same keys)."""
    import timm
    import torch

    model = timm.create_model("legacy_seresnext101_32x4d", num_classes=1000)
    torch.save(model.state_dict(), world / "se_resnext101_32x4d-3b2fe3d8.pth")
    return {}


ARRANGE: dict[str, Callable[[Path], dict[str, Any]]] = {
    # Blocks that build a database need its place free.
    "data.md#Build a database": _remove("data/lmdb/train.lmdb", "data/lmdb/val.lmdb"),
    "quickstart.md#Build the databases": _remove("data/train.lmdb", "data/val.lmdb", "checkpoints"),
    # Inputs a block names.
    "training.md#Pretrained weights and a frozen backbone": _pretrained_file,
}

NOT_RAISED: dict[str, str] = {}
