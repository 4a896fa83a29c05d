"""DataLoaders for DDP: the right sampler, the per-process batch, workers and seeds."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from ddpkit import comm
from ddpkit.dist import DistInfo

__all__ = ["DistributedEvalSampler", "build_loader", "set_epoch"]


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
            ``0..num_replicas - 1``, or the length is negative.

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
        n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        self.num_replicas = comm.get_world_size() if num_replicas is None else num_replicas
        self.rank = comm.get_rank() if rank is None else rank
        if n < 0:
            raise ValueError(f"the dataset length must be >= 0, got {n}")
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


class _EpochRandomSampler(RandomSampler):
    """A RandomSampler whose order is a function of ``(seed, epoch)`` after set_epoch."""

    def __init__(self, data_source: Sized, seed: int) -> None:
        super().__init__(data_source, generator=torch.Generator().manual_seed(seed))
        self.seed = seed

    def set_epoch(self, epoch: int) -> None:
        assert self.generator is not None
        self.generator.manual_seed(self.seed + epoch)


class _EpochIndexSampler(Sampler[tuple[int, int]]):
    """Yield ``(epoch, index)`` pairs, so a worker knows which epoch a sample belongs to.

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

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self._started and not self._epoch_given:
            self.set_epoch(self.epoch + 1)
        self._started, self._epoch_given = True, False
        epoch = self.epoch
        return ((epoch, index) for index in self.inner)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


class _SeededSamples(Dataset[Any]):
    """Draw each sample's augmentation from RNGs seeded by ``(seed, epoch, index)``.

    A sample's random crop is then the same whichever worker loads it, however
    many workers there are, whether they persist between epochs, and whether
    the run was resumed from a checkpoint: that is what makes a resumed run
    bit-identical to an uninterrupted one. The rank is not part of the seed, so
    the augmentations do not depend on the world size either.
    """

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        with _seeded(_sample_seed(self.seed, epoch, index)):
            return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        # .classes, .targets ... of the wrapped dataset; guard against lookups
        # before __init__ ran (unpickling), which would recurse.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


_MASK64 = (1 << 64) - 1


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    # splitmix64 over a combination that is unique for (seed, epoch, index)
    # within any realistic range: 2**32 samples, 2**24 epochs.
    x = ((seed & 0xFFFFFFFF) << 88 | (epoch & 0xFFFFFF) << 64 | index) & ((1 << 120) - 1)
    z = (x ^ (x >> 64)) & _MASK64
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    # In a worker the RNGs are the worker's own; in this process (workers=0)
    # they are the training loop's, so they are put back afterwards.
    in_worker = get_worker_info() is not None
    saved = None if in_worker else (random.getstate(), np.random.get_state(), torch.get_rng_state())
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.default_generator.manual_seed(seed)  # the CPU generator only, not CUDA's
    try:
        yield
    finally:
        if saved is not None:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.set_rng_state(saved[2])


def set_epoch(loader: DataLoader[Any], epoch: int) -> None:
    """Tell the loader's sampler which epoch starts, so each epoch has its own order.

    ``DistributedSampler`` shuffles with ``seed + epoch``; without this call
    every epoch repeats the first one's order. Call it before each epoch on
    every rank. Samplers without ``set_epoch`` are left alone.

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
    for sampler in samplers.values():
        setter = getattr(sampler, "set_epoch", None)
        if callable(setter):
            setter(epoch)


def _job_shape(info: DistInfo | None) -> tuple[int, int, int]:
    """Return (world_size, rank, local_world_size) from ``info`` or the process group."""
    if info is not None:
        return info.world_size, info.rank, info.local_world_size
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return comm.get_world_size(), comm.get_rank(), int(local) if local.isdigit() else 1


def _per_process_batch(batch_size: int | None, global_batch_size: int | None, world: int) -> int:
    if (batch_size is None) == (global_batch_size is None):
        raise ValueError(
            "pass exactly one of batch_size (per process) and global_batch_size "
            f"(over all {world} processes), got batch_size={batch_size}, "
            f"global_batch_size={global_batch_size}"
        )
    if batch_size is not None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        return batch_size
    assert global_batch_size is not None
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}")
    per, rest = divmod(global_batch_size, world)
    if rest:
        nearest = [v for v in (per * world, (per + 1) * world) if v > 0]
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide over {world} processes; "
            f"use {' or '.join(map(str, nearest))}, or pass batch_size={max(per, 1)} per process"
        )
    return per


def usable_cpus() -> int:
    """The CPUs this process may run on: a cgroup or taskset can give fewer than the machine has."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _default_workers(local_world_size: int) -> int:
    # Shared among this node's processes; at most 8, as each worker holds its
    # own dataset copy and prefetched batches in memory.
    return max(1, min(8, usable_cpus() // max(local_world_size, 1)))


def _loader_seed(seed: int, rank: int) -> int:
    # SeedSequence mixes (seed, rank) into an unrelated 64-bit value, so no two
    # (seed, rank) pairs share a seed, as seed * 1000 + rank would past rank 999.
    state = np.random.SeedSequence([seed % 2**64, rank]).generate_state(1, np.uint64)
    return int(state[0])


def build_loader(
    dataset: Dataset[Any],
    batch_size: int | None = None,
    *,
    global_batch_size: int | None = None,
    train: bool,
    workers: int | None = None,
    seed: int = 0,
    drop_last: bool | None = None,
    info: DistInfo | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    multiprocessing_context: Any = None,
) -> DataLoader[Any]:
    """Return a DataLoader that gives this rank its share of ``dataset``.

    Training shuffles with ``DistributedSampler(seed=seed)`` (the same on every
    rank) or, on one process, a ``RandomSampler`` seeded with ``seed``. Call
    :func:`set_epoch` (or ``loader.sampler.set_epoch``) before each epoch:
    without it ``DistributedSampler`` repeats the first epoch's order; with it
    an epoch's order depends only on ``(seed, epoch)``, so a resumed run
    continues as it would have. Evaluation reads in order with
    :class:`DistributedEvalSampler`: every sample exactly once over all ranks.

    Worker randomness (augmentations) is reproducible: the loader's generator
    is seeded from ``(seed, rank)``, and DataLoader seeds each worker's torch,
    Python ``random`` and numpy RNGs from it. So ranks augment differently and
    a rerun repeats itself. With ``workers=0`` augmentations draw from this
    process's own RNGs (seed them yourself).

    Args:
        dataset: a map-style dataset (with ``__len__``).
        batch_size: samples per batch on this process.
        global_batch_size: samples per step over all processes, divided by the
            world size; pass this or ``batch_size``, not both.
        train: shuffle for training, or read everything once for evaluation.
        workers: worker processes; 0 loads in this process. Default: the CPUs
            this process may use over ``LOCAL_WORLD_SIZE``, between 1 and 8.
        seed: seed for the shuffling and the workers' RNGs.
        drop_last: drop the last incomplete batch (and, in training, the tail
            that does not divide over the ranks). Default: ``train``.
        info: the job's :class:`ddpkit.DistInfo`; default: the current process group.
        pin_memory: page-locked batches for fast copies to the GPU. Default:
            True when CUDA is available and ``info`` (if given) is on a GPU.
        persistent_workers: keep workers between epochs. Default: True.
            Ignored with ``workers=0``, as are the two worker options below.
        prefetch_factor: batches each worker loads ahead; DataLoader's default if None.
        collate_fn: how samples become a batch; DataLoader's default if None.
        multiprocessing_context: how workers start, e.g. ``"forkserver"``.

    Returns:
        A plain ``torch.utils.data.DataLoader``.

    Raises:
        ValueError: both or neither batch size, one below 1, a global batch
            size that does not divide over the ranks, or ``workers < 0``.
        TypeError: ``dataset`` is an ``IterableDataset`` (no sampler applies).

    Example:
        >>> info = ddpkit.init_distributed()
        >>> train_loader = build_loader(train_set, global_batch_size=256, train=True, info=info)
        >>> val_loader = build_loader(val_set, batch_size=128, train=False, info=info)
    """
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"build_loader needs a map-style dataset (with __len__), got the IterableDataset "
            f"{type(dataset).__name__}; shard it over ranks and workers yourself instead"
        )
    world, rank, local_world = _job_shape(info)
    per_process = _per_process_batch(batch_size, global_batch_size, world)
    workers = _default_workers(local_world) if workers is None else workers
    if workers < 0:
        raise ValueError(f"workers must be >= 0 (0 loads in this process), got {workers}")
    drop_last = train if drop_last is None else drop_last
    if pin_memory is None:
        pin_memory = torch.cuda.is_available() and (info is None or info.device.type == "cuda")

    sized: Any = dataset  # map-style: checked above, samplers need len()
    sampler: Sampler[int]
    if train and world > 1:
        sampler = DistributedSampler(
            sized, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
        )
    elif train:
        sampler = _EpochRandomSampler(sized, seed)
    elif world > 1:
        sampler = DistributedEvalSampler(sized, num_replicas=world, rank=rank)
    else:
        sampler = SequentialSampler(sized)

    loaded: Dataset[Any] = dataset
    if train:
        # Augmentations seeded per (seed, epoch, sample): reproducible and resumable.
        loaded, sampler = _SeededSamples(dataset, seed), _EpochIndexSampler(sampler)  # type: ignore[assignment]

    # DataLoader refuses worker options without workers; dropping them lets a
    # script switch to workers=0 for debugging and change nothing else.
    in_workers = workers > 0
    return DataLoader(
        loaded,
        batch_size=per_process,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(_loader_seed(seed, rank)),
        persistent_workers=in_workers and persistent_workers is not False,
        prefetch_factor=prefetch_factor if in_workers else None,
        multiprocessing_context=multiprocessing_context if in_workers else None,
    )
