"""Datasets, transforms and loaders: the LMDB format, its builder and dataset, loaders."""

from ddpkit.data.images import ImageTooLargeError
from ddpkit.data.lmdb_build import BuildSummary, ImageError, build_lmdb
from ddpkit.data.lmdb_dataset import LazyLMDBDataset
from ddpkit.data.lmdb_format import LMDBFormatError, read_index
from ddpkit.data.lmdb_inspect import VerifyReport, describe_lmdb, verify_lmdb, verify_report
from ddpkit.data.loaders import build_loader
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
    "build_lmdb",
    "build_loader",
    "describe_lmdb",
    "make_shapes_dataset",
    "normalize_batch",
    "read_index",
    "set_epoch",
    "train_transform",
    "val_transform",
    "verify_lmdb",
    "verify_report",
]
