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

if TYPE_CHECKING:  # the public names, each listed once (ddpkit._lazy)
    from ddpkit.data.balanced import WeightedDistributedSampler as WeightedDistributedSampler
    from ddpkit.data.balanced import class_weights as class_weights
    from ddpkit.data.images import ImageTooLargeError as ImageTooLargeError
    from ddpkit.data.lmdb_build import BuildSummary as BuildSummary
    from ddpkit.data.lmdb_build import ImageError as ImageError
    from ddpkit.data.lmdb_build import build_lmdb as build_lmdb
    from ddpkit.data.lmdb_dataset import LazyLMDBDataset as LazyLMDBDataset
    from ddpkit.data.lmdb_format import read_index as read_index
    from ddpkit.data.lmdb_index import LMDBFormatError as LMDBFormatError
    from ddpkit.data.lmdb_inspect import VerifyReport as VerifyReport
    from ddpkit.data.lmdb_inspect import describe_lmdb as describe_lmdb
    from ddpkit.data.lmdb_inspect import verify_lmdb as verify_lmdb
    from ddpkit.data.lmdb_inspect import verify_report as verify_report
    from ddpkit.data.loaders import build_loader as build_loader
    from ddpkit.data.mixing import mixup_cutmix as mixup_cutmix
    from ddpkit.data.resume import EpochBatches as EpochBatches
    from ddpkit.data.resume import data_identity as data_identity
    from ddpkit.data.resume import epoch_batches as epoch_batches
    from ddpkit.data.samplers import DistributedEvalSampler as DistributedEvalSampler
    from ddpkit.data.samplers import set_epoch as set_epoch
    from ddpkit.data.shapes import SHAPE_CLASSES as SHAPE_CLASSES
    from ddpkit.data.shapes import make_shapes_dataset as make_shapes_dataset
    from ddpkit.data.transforms import AUTO_AUGMENTS as AUTO_AUGMENTS
    from ddpkit.data.transforms import IMAGENET_MEAN as IMAGENET_MEAN
    from ddpkit.data.transforms import IMAGENET_STD as IMAGENET_STD
    from ddpkit.data.transforms import normalize_batch as normalize_batch
    from ddpkit.data.transforms import train_transform as train_transform
    from ddpkit.data.transforms import val_transform as val_transform

if not TYPE_CHECKING:  # see ddpkit._lazy: mypy must not see an __all__ it cannot read
    __getattr__, __dir__, __all__ = lazy_names(__name__, __file__)
