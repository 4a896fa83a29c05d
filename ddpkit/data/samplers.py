"""DDP samplers: every sample once in evaluation; training epochs that repeat exactly.

:class:`DistributedEvalSampler` gives each rank a strided share without
padding. For training, :class:`EpochIndexSampler` and :class:`SeededSamples`
carry the epoch to the worker and seed each sample's augmentation from
``(seed, epoch, index)`` (``ddpkit.rng``), so a resumed run sees exactly the
crops an uninterrupted one would.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    get_worker_info,
)

from ddpkit.distributed import comm
from ddpkit.rng import sample_seed, seeded

__all__ = [
    "DistributedEvalSampler",
    "EpochIndexSampler",
    "EpochRandomSampler",
    "SeededSamples",
    "set_epoch",
]


SEED_RANGE = (0, 2**63 - 1)  # torch.Generator.manual_seed(seed + epoch) must accept it


def check_whole(name: str, value: Any, low: int | None, high: int | None = None) -> int:
    """``value`` as an int, or a ValueError naming ``name``, the value and the range wanted.

    A whole number is an int or a NumPy integer, never a bool or a float (``2.0``).
    """
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    number = int(value) if whole else None
    if number is None or (low is not None and number < low) or (high is not None and number > high):
        span = "" if low is None else f"{low}..{high}" if high is not None else f"{low} or more"
        shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
        raise ValueError(
            f"{name} must be a whole number{', ' + span if span else ''}, got {shown} "
            f"({type(value).__name__})"
        )
    return number


class DistributedEvalSampler(Sampler[int]):
    """Give each rank a strided share of the dataset, every index exactly once.

    Rank ``r`` of ``R`` gets ``range(r, n, R)``, in order, unpadded: lengths
    differ by at most one. ``DistributedSampler(shuffle=False)`` instead repeats
    samples to even the ranks out, and counts them twice in validation metrics.
    As one rank may run one batch more than another, run no collective per
    evaluation batch: sum on each rank and reduce once at the end.

    Args:
        dataset_or_len: the dataset (anything with ``len()``) or its length.
        num_replicas: number of ranks; defaults to ``ddpkit.get_world_size()``.
        rank: this rank; defaults to ``ddpkit.get_rank()``.

    Raises:
        ValueError: ``num_replicas`` is below 1, ``rank`` is outside
            ``0..num_replicas - 1``, the length is negative, or one of them is
            not a whole number (a bool or a float).

    Example:
        >>> sampler = DistributedEvalSampler(val_set)
        >>> loader = DataLoader(val_set, batch_size=256, sampler=sampler)
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(dataset_or_len, Sized):
            n = len(dataset_or_len)
        else:
            n = check_whole("the dataset length", dataset_or_len, None)
        if n < 0:
            raise ValueError(f"the dataset length must be >= 0, got {n}")
        self.num_replicas = comm.get_world_size() if num_replicas is None else num_replicas
        self.rank = comm.get_rank() if rank is None else rank
        self.num_replicas = check_whole("num_replicas", self.num_replicas, None)
        self.rank = check_whole("rank", self.rank, None)
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"rank {self.rank} is outside 0..{self.num_replicas - 1} for "
                f"num_replicas={self.num_replicas}; pass the rank and world size of this job"
            )
        self._indices = range(self.rank, n, self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)

    def set_epoch(self, epoch: int) -> None:
        """Do nothing: the order never changes. Here so any sampler takes ``set_epoch``."""


class EpochRandomSampler(RandomSampler):
    """A RandomSampler whose order is a function of ``(seed, epoch)`` after set_epoch.

    Raises:
        ValueError: ``seed`` is not a whole number in 0..2**63-1, or (in
            ``set_epoch``) an epoch that is not a whole number, 0 or more.
    """

    def __init__(self, data_source: Sized, seed: int) -> None:
        seed = check_whole("seed", seed, *SEED_RANGE)
        super().__init__(data_source, generator=torch.Generator().manual_seed(seed))
        self.seed = seed

    def set_epoch(self, epoch: int) -> None:
        assert self.generator is not None
        epoch = check_whole("epoch", epoch, 0, SEED_RANGE[1] - self.seed)
        self.generator.manual_seed(self.seed + epoch)


class EpochIndexSampler(Sampler[tuple[int, ...]]):
    """Yield ``(epoch, index)`` pairs, so a worker knows which epoch a sample belongs to.

    A sampler with ``draws()`` that yield ``(index, draw)`` (one that may draw
    a sample more than once an epoch, ``WeightedDistributedSampler``) gives
    ``(epoch, index, draw)``: each draw then has its own augmentation.

    ``set_epoch`` is passed on to the wrapped sampler. An epoch started without
    it follows the previous one (epoch + 1), so forgetting the call no longer
    repeats the first epoch's order and augmentations.
    """

    def __init__(self, inner: Sampler[int]) -> None:
        super().__init__()
        self.inner = inner
        self.epoch = 0
        self._epoch_given = False
        self._started = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._epoch_given = True
        setter = getattr(self.inner, "set_epoch", None)
        if callable(setter):
            setter(epoch)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        if self._started and not self._epoch_given:
            self.set_epoch(self.epoch + 1)
        self._started, self._epoch_given = True, False
        epoch, draws = self.epoch, getattr(self.inner, "draws", None)
        items: Iterator[Any] = draws() if callable(draws) else iter(self.inner)
        return ((epoch, *i) if isinstance(i, tuple) else (epoch, i) for i in items)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


class SeededSamples(Dataset[Any]):
    """Draw each sample's augmentation from RNGs seeded by ``(seed, epoch, index)``.

    A sample's random crop is then the same whichever worker loads it, however
    many workers there are, whether they persist between epochs, and whether
    the run was resumed from a checkpoint: that is what makes a resumed run
    bit-identical to an uninterrupted one. The rank is not part of the seed, so
    the augmentations do not depend on the world size either.

    It is what ``build_loader(..., train=True).dataset`` is, and it reads like
    the dataset it wraps: ``len()``, attributes such as ``.classes`` and
    ``.targets`` (the wrapped dataset itself is ``.dataset``), and
    ``loader.dataset[i]`` with an int gives sample ``i`` augmented as in epoch
    0 (the caller's RNGs are left as they were). The sampler asks for
    ``(epoch, index)`` pairs, or ``(epoch, index, draw)`` when a sample may be
    drawn more than once an epoch (each draw seeded apart).
    """

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, ...] | int) -> Any:
        draw: int | None = None
        if isinstance(key, tuple):
            epoch, index, *draws = key
            draw = draws[0] if draws else None
        else:
            epoch, index = 0, self._index(key)
        # In a worker the RNGs are the worker's own; in this process (workers=0)
        # they are the training loop's, so they are put back afterwards.
        restore = get_worker_info() is None
        with seeded(sample_seed(self.seed, epoch, index, draw), restore=restore):
            return self.dataset[index]

    def _index(self, key: Any) -> int:
        try:
            index = operator.index(key)
        except TypeError:
            raise TypeError(
                f"a training loader's dataset takes an int index (or an (epoch, index) pair), "
                f"got {type(key).__name__}; index loader.dataset.dataset for anything else"
            ) from None
        # A negative index is the sample it stands for, with that sample's seed.
        return index + len(self) if index < 0 else index

    def __getattr__(self, name: str) -> Any:
        # .classes, .targets ... of the wrapped dataset; guard against lookups
        # before __init__ ran (unpickling), which would recurse.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def set_epoch(loader: DataLoader[Any], epoch: int) -> None:
    """Tell the loader's sampler which epoch starts, so each epoch has its own order.

    ``DistributedSampler`` shuffles with ``seed + epoch``; without this call
    every epoch repeats the first one's order. Call it before each epoch on
    every rank. Samplers without ``set_epoch`` are left alone. A stream (an
    ``IterableDataset``) with a ``set_epoch`` of its own, as Hugging Face's
    streaming datasets have, is told too: it reshuffles its shards per epoch.

    Args:
        loader: a DataLoader, typically from :func:`build_loader`.
        epoch: the epoch about to start (0, 1, ...).

    Example:
        >>> for epoch in range(epochs):
        ...     set_epoch(train_loader, epoch)
        ...     for images, targets in train_loader: ...
    """
    # A custom batch_sampler carries its own sampler; the same object twice is set once.
    samplers = {id(s): s for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None))}
    if isinstance(loader.dataset, IterableDataset):
        samplers[id(loader.dataset)] = loader.dataset
    for sampler in samplers.values():
        setter = getattr(sampler, "set_epoch", None)
        if callable(setter):
            setter(epoch)
