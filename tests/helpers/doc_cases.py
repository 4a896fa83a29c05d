"""What the documentation tests change, and why, before a block runs.

``SUBSTITUTIONS`` scale the docs' real figures down to the small world
(``epochs=90`` becomes 2, 224 px becomes 32, ``/data/...`` becomes a path in
the world) without touching what the code does; each must still match its
file, so one that no longer applies fails the test instead of rotting.
``ARRANGE`` sets up what a block needs beyond the world: the error an
``except ddpkit.X`` example catches, an input that is absent by default.
``NOT_RAISED`` names the error examples a single process cannot show, with
the test that covers each.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from doc_blocks import Block

# (file, old, new): applied to every runnable block of the file, in order.
SUBSTITUTIONS: list[tuple[str, str, str]] = [
    # Absolute example paths live under the world.
    ("docs/api.md", "/data/", "data/"),
    ("docs/data.md", "/data/", "data/"),
    ("docs/quickstart.md", "/data/", "data/"),
    ("docs/training.md", '"/local/ckpt"', '"local/ckpt"'),
    # Two epochs stand for ninety.
    ("docs/api.md", "epochs=90", "epochs=2"),
    ("docs/training.md", "epochs=90", "epochs=2"),
    ("docs/quickstart.md", "epochs=90", "epochs=2"),
    ("docs/api.md", "warmup_epochs=5", "warmup_epochs=1"),
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


def _occupied_master_port(world: Path) -> dict[str, Any]:
    """Another program holds the master port: rank 0 cannot open the store."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    os.environ.update(
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return {"_port_holder": holder}


def _failing_main(world: Path) -> dict[str, Any]:
    import doc_context

    return {"main": doc_context.failing_main}


def _broken_image(world: Path) -> dict[str, Any]:
    _remove("data/train.lmdb")(world)
    victim = sorted((world / "data" / "train").rglob("*.jpg"))[7]
    victim.write_bytes(victim.read_bytes()[:200])  # a JPEG cut off after its header
    return {}


def _truncated_checkpoint(world: Path) -> dict[str, Any]:
    latest = world / "checkpoints" / "latest.pth"
    target = latest.resolve()
    target.write_bytes(target.read_bytes()[:1000])
    return {}


def _diverging_model(world: Path) -> dict[str, Any]:
    import doc_context
    import torch

    model = doc_context.small_model()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    return {"model": model, "optimizer": doc_context.optimizer_for(model)}


class _SignalAt:
    """A dataset that delivers SIGTERM to this process when sample ``at`` is read."""

    def __init__(self, dataset: Any, at: int) -> None:
        self.dataset, self.at, self.classes = dataset, at, dataset.classes

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        self.at -= 1
        if self.at == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.dataset[index]


def _preempted_mid_epoch(world: Path) -> dict[str, Any]:
    import ddpkit

    train = ddpkit.LazyLMDBDataset(world / "data" / "train.lmdb", ddpkit.train_transform(32))
    loader = ddpkit.build_loader(_SignalAt(train, 100), global_batch_size=32, train=True, workers=0)
    return {"train_loader": loader}


def _a_run_to_plot(world: Path) -> dict[str, Any]:
    import doc_context

    import ddpkit

    model = doc_context.small_model()
    train = ddpkit.LazyLMDBDataset(world / "data" / "train.lmdb", ddpkit.train_transform(32))
    val = ddpkit.LazyLMDBDataset(world / "data" / "val.lmdb", ddpkit.val_transform(32))
    ddpkit.fit(
        model,
        ddpkit.build_loader(train, global_batch_size=32, train=True, workers=0),
        doc_context.optimizer_for(model),
        criterion=ddpkit.FocalLoss(),
        epochs=2,
        val_loader=ddpkit.build_loader(val, batch_size=32, train=False, workers=0),
        report=ddpkit.ReportConfig(progress=False, verbose=False, log_dir=world / "runs" / "exp1"),
    )
    return {}


ARRANGE: dict[str, Callable[[Path], dict[str, Any]]] = {
    # Blocks that build a database need its place free.
    "api.md#build_lmdb/2": _remove("data/train.lmdb"),
    "api.md#BuildSummary/2": _remove("data/val.lmdb"),
    "api.md#ddpkit lmdb build": _remove("data/lmdb/train.lmdb"),
    "data.md#Build a database": _remove("data/lmdb/train.lmdb", "data/lmdb/val.lmdb"),
    "quickstart.md#Build the databases": _remove("data/train.lmdb", "data/val.lmdb", "checkpoints"),
    # Inputs a block names.
    "api.md#load_pretrained/2": _pretrained_file,
    "training.md#Pretrained weights and a frozen backbone": _pretrained_file,
    "api.md#ddpkit plot": _a_run_to_plot,
    # The errors the except-examples catch.
    "api.md#RendezvousError/2": _occupied_master_port,
    "api.md#RankFailedError/2": _failing_main,
    "api.md#ImageError/2": _broken_image,
    "api.md#CheckpointError/2": _truncated_checkpoint,
    "api.md#TrainingError/2": _diverging_model,
    "api.md#Preempted/2": _preempted_mid_epoch,
}

NOT_RAISED: dict[str, str] = {
    "api.md#Rank0Error/2": "raised on the ranks other than 0 (tests/distributed/test_rank0.py)",
}
