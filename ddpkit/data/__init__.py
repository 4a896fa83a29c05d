"""Data: the LMDB format, its builder and dataset, transforms, samplers and loaders.

Build a database once from an ImageFolder tree, a list file or a Parquet
table (``lmdb_build``; the ``ddpkit lmdb build`` command), check it
(``lmdb_inspect``; ``ddpkit lmdb verify``), then read it in every DataLoader
worker with :class:`LazyLMDBDataset`, which opens the file lazily in each
process (``lmdb_format``) and decodes with the one decoder the builder checked
with (``images``)::

    from ddpkit.data import LazyLMDBDataset, build_loader, train_transform

    train = LazyLMDBDataset("data/train", transform=train_transform(224))
    loader = build_loader(train, batch_size=256, train=True, workers=8)

:func:`build_loader` picks the sampler (``samplers``): a seeded shuffle on
each rank, or :class:`DistributedEvalSampler` (every sample once) for
validation, and gives back the rest of an interrupted epoch (``resume``);
``balanced`` draws class-balanced, weighted and repeated epochs as exactly.
``transforms`` works on uint8 tensors and normalises on the device;
``mixing`` holds MixUp / CutMix on a batch.

This package imports ``ddpkit.distributed`` and nothing of
``ddpkit.checkpoint`` or ``ddpkit.training``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_names

if TYPE_CHECKING:
    from ddpkit.data.balanced import WeightedDistributedSampler, class_weights
    from ddpkit.data.images import ImageTooLargeError
    from ddpkit.data.lmdb_build import BuildSummary, ImageError, build_lmdb
    from ddpkit.data.lmdb_dataset import LazyLMDBDataset
    from ddpkit.data.lmdb_format import LMDBFormatError, read_index
    from ddpkit.data.lmdb_inspect import VerifyReport, describe_lmdb, verify_lmdb, verify_report
    from ddpkit.data.loaders import build_loader
    from ddpkit.data.mixing import mixup_cutmix
    from ddpkit.data.samplers import DistributedEvalSampler, set_epoch
    from ddpkit.data.shapes import SHAPE_CLASSES, make_shapes_dataset
    from ddpkit.data.transforms import (
        IMAGENET_MEAN,
        IMAGENET_STD,
        normalize_batch,
        train_transform,
        val_transform,
    )

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "SHAPE_CLASSES",
    "BuildSummary",
    "DistributedEvalSampler",
    "ImageError",
    "ImageTooLargeError",
    "LMDBFormatError",
    "LazyLMDBDataset",
    "VerifyReport",
    "WeightedDistributedSampler",
    "build_lmdb",
    "build_loader",
    "class_weights",
    "describe_lmdb",
    "make_shapes_dataset",
    "mixup_cutmix",
    "normalize_batch",
    "read_index",
    "set_epoch",
    "train_transform",
    "val_transform",
    "verify_lmdb",
    "verify_report",
]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "ddpkit.data.balanced": ("WeightedDistributedSampler", "class_weights"),
        "ddpkit.data.images": ("ImageTooLargeError",),
        "ddpkit.data.lmdb_build": ("BuildSummary", "ImageError", "build_lmdb"),
        "ddpkit.data.lmdb_dataset": ("LazyLMDBDataset",),
        "ddpkit.data.lmdb_format": ("LMDBFormatError", "read_index"),
        "ddpkit.data.lmdb_inspect": (
            "VerifyReport",
            "describe_lmdb",
            "verify_lmdb",
            "verify_report",
        ),
        "ddpkit.data.loaders": ("build_loader",),
        "ddpkit.data.mixing": ("mixup_cutmix",),
        "ddpkit.data.samplers": ("DistributedEvalSampler", "set_epoch"),
        "ddpkit.data.shapes": ("SHAPE_CLASSES", "make_shapes_dataset"),
        "ddpkit.data.transforms": (
            "IMAGENET_MEAN",
            "IMAGENET_STD",
            "normalize_batch",
            "train_transform",
            "val_transform",
        ),
    },
)
