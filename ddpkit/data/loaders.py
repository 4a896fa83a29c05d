"""``build_loader``: a DataLoader with the right sampler, per-process batch, workers and seeds."""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import multiprocessing.context
import numbers
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    SequentialSampler,
)

from ddpkit import _graveyard
from ddpkit._docs import see
from ddpkit.data import gpu_decode, samplers
from ddpkit.data._forkserver_group import keep_forkserver_apart
from ddpkit.data.balanced import WeightedDistributedSampler, class_weights
from ddpkit.data.samplers import EpochIndexSampler, EpochRandomSampler, SeededSamples
from ddpkit.distributed import comm
from ddpkit.distributed.devices import cpu_share
from ddpkit.distributed.job import DistInfo
from ddpkit.distributed.launchers import local_world_size
from ddpkit.distributed.membership import elastic_worlds

__all__ = ["build_loader"]


def _job_shape(info: DistInfo | None) -> tuple[int, int, int]:
    """Return (world_size, rank, local_world_size) from ``info``, else the group and launcher."""
    if info is not None:
        return info.world_size, info.rank, info.local_world_size
    return comm.get_world_size(), comm.get_rank(), local_world_size()


def _per_process_batch(
    batch_size: int | None,
    global_batch_size: int | None,
    world: int,
    local_world: int = 1,
    train: bool = False,
) -> int:
    if (batch_size is None) == (global_batch_size is None):
        raise ValueError(
            "pass exactly one of batch_size (per process) and global_batch_size "
            f"(over all {world} processes), got batch_size={batch_size}, "
            f"global_batch_size={global_batch_size}"
        )
    if batch_size is not None:  # both checked by _check_arguments: whole numbers, 1 or more
        return batch_size
    assert global_batch_size is not None
    per, rest = divmod(global_batch_size, world)
    if rest:
        nearest = [v for v in (per * world, (per + 1) * world) if v > 0]
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide over {world} processes; "
            f"use {' or '.join(map(str, nearest))}, or pass batch_size={max(per, 1)} per process"
        )
    # Servers may leave and join (torchrun --nnodes MIN:MAX): a training batch must divide over
    # every world the job can have, or the first leave or join would stop it.
    worlds = elastic_worlds(local_world) if train else []
    odd = [w for w in worlds if global_batch_size % w]
    if odd:
        every = math.lcm(*worlds)
        low = global_batch_size // every * every
        nearest = [v for v in (low, low + every) if v > 0]
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide over {odd[0]} processes, a "
            f"world this job can have as servers leave and join (world sizes {worlds}): use a "
            f"multiple of {every}, such as {' or '.join(map(str, nearest))}"
        )
    return per


# A worker is a process holding a dataset copy and prefetched batches: more than
# this is a typo, and would exhaust the machine before the first batch.
MAX_LOADER_WORKERS = 1024
_SEED_RANGE = (0, 2**63 - 1)  # torch.Generator.manual_seed(seed + epoch) must accept it


def _check_arguments(**given: Any) -> None:
    """Refuse a wrongly typed or out-of-range ``build_loader`` argument, naming it.

    Runs before anything is built: DataLoader's own errors name neither the
    argument nor the value ("Overflow when unpacking long long"), and some
    (a bare AssertionError) leave a half-made loader behind.
    """
    for name in ("batch_size", "global_batch_size", "workers", "prefetch_factor", "seed"):
        value = given[name]
        if value is None and name != "seed":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(_bad(name, value, "a whole number"))
    for name, low, high in [
        ("batch_size", 1, None),
        ("global_batch_size", 1, None),
        ("workers", 0, MAX_LOADER_WORKERS),
        ("prefetch_factor", 1, None),
        ("seed", *_SEED_RANGE),
    ]:
        value = given[name]
        if value is not None and (value < low or (high is not None and value > high)):
            span = f"{low}..{high}" if high is not None else f"at least {low}"
            raise ValueError(_bad(name, value, span))
    if not isinstance(given["train"], bool):
        raise TypeError(_bad("train", given["train"], "True or False"))
    for name in ("drop_last", "pin_memory", "persistent_workers"):
        if given[name] is not None and not isinstance(given[name], bool):
            raise TypeError(_bad(name, given[name], "True, False or None"))
    if given["info"] is not None and not isinstance(given["info"], DistInfo):
        raise TypeError(_bad("info", given["info"], "a ddpkit.DistInfo or None"))
    if given["collate_fn"] is not None and not callable(given["collate_fn"]):
        raise TypeError(_bad("collate_fn", given["collate_fn"], "a function or None"))
    if not isinstance(given["dataset"], Sized):
        raise TypeError(_bad("dataset", given["dataset"], "a map-style dataset with __len__"))
    context = given["multiprocessing_context"]
    methods = multiprocessing.get_all_start_methods()
    if not (
        context is None
        or (isinstance(context, str) and context in methods)
        or isinstance(context, multiprocessing.context.BaseContext)
    ):
        raise ValueError(
            _bad("multiprocessing_context", context, f"None, one of {methods} or a context")
        )


def _bad(name: str, value: Any, wanted: str) -> str:
    shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
    return f"build_loader: {name} must be {wanted}, got {shown} ({type(value).__name__}). " + see(
        "data-lmdb-databases-datasets-loaders"
    )


def _default_workers(local_world_size: int) -> int:
    # Shared among this node's processes; at most 8, as each worker holds its
    # own dataset copy and prefetched batches in memory.
    return min(8, cpu_share(local_world_size))


def _worker_start(trainer: int, worker_id: int) -> None:
    # Ctrl-C, torchrun and a container runtime signal a whole process group; the
    # training process stops cleanly at the next step and needs its workers until
    # then. A group of their own keeps those signals from them, while a SIGTERM
    # sent to the worker itself (how DataLoader and multiprocessing end them)
    # still works (a forkserver, whose children they are then, is kept apart by
    # _forkserver_group). They end with the training process: torch's workers
    # watch their parent, which a forkserver's workers watch here instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if os.getppid() != trainer:
        _exit_with(trainer)


def _exit_with(trainer: int) -> None:
    """End this worker when the training process ``trainer`` ends, even by SIGKILL.

    A forkserver's worker is the server's child, so torch's check (its parent
    is gone) never fires; and it holds the server's liveness pipe open, so the
    server never ends either: a killed trainer would leave both for ever.
    """
    try:  # Linux 5.3+: readable once the process has ended, and never a reused pid
        handle: int | None = os.pidfd_open(trainer)
    except (AttributeError, OSError):
        handle = None
    threading.Thread(
        target=_watch, args=(trainer, handle), name="ddpkit-worker-exit", daemon=True
    ).start()


def _watch(trainer: int, handle: int | None) -> None:
    if handle is not None:
        select.select([handle], [], [])
    else:
        while _alive(trainer):
            time.sleep(1.0)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a reused pid)
        return True
    return True


def _loader_seed(seed: int, rank: int) -> int:
    # SeedSequence mixes (seed, rank) into an unrelated 64-bit value, so no two
    # (seed, rank) pairs share a seed, as seed * 1000 + rank would past rank 999.
    state = np.random.SeedSequence([seed % 2**64, rank]).generate_state(1, np.uint64)
    return int(state[0])


def _draws(
    dataset: Any,
    train: bool,
    balance: float | None,
    weights: Any,
    num_samples: int | None,
    repeats: int,
    job: tuple[int, int, int, bool],
) -> WeightedDistributedSampler | None:
    """The weighted or repeated sampler the arguments ask for; None: the plain shuffle."""
    if balance is None and weights is None and num_samples is None and repeats == 1:
        return None
    where = see("weighted-balanced-and-repeated-sampling")
    if not train:
        raise ValueError(
            "build_loader: balance, weights, num_samples and repeats apply to training "
            f"(train=True); evaluation reads every sample once. {where}"
        )
    if balance is not None and weights is not None:
        raise ValueError(
            f"build_loader: pass balance (a power of the class sizes) or weights (one per "
            f"sample), not both. {where}"
        )
    drawn: Any = len(dataset)
    if balance is not None:
        targets = getattr(dataset, "targets", None)
        if targets is None:
            raise ValueError(
                f"build_loader: balance needs the labels as dataset.targets, and "
                f"{type(dataset).__name__} has none; pass weights=class_weights(labels, "
                f"power) instead. {where}"
            )
        drawn = class_weights(targets, balance)
    elif weights is not None:
        drawn = weights
    if not isinstance(drawn, int) and len(drawn) != len(dataset):
        raise ValueError(
            f"build_loader: {len(drawn)} weights (or targets) for a dataset of {len(dataset)} "
            f"samples; give one per sample. {where}"
        )
    world, rank, seed, drop_last = job
    return WeightedDistributedSampler(
        drawn,
        num_samples,
        repeats=repeats,
        num_replicas=world,
        rank=rank,
        seed=seed,
        drop_last=drop_last,
    )


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
    balance: float | None = None,
    weights: Sequence[float] | torch.Tensor | None = None,
    num_samples: int | None = None,
    repeats: int = 1,
) -> DataLoader[Any]:
    """Return a DataLoader that gives this rank its share of ``dataset``.

    Training shuffles with ``DistributedSampler(seed=seed)`` (the same on every
    rank) or, on one process, a ``RandomSampler`` seeded with ``seed``. Call
    :func:`set_epoch` (or ``loader.sampler.set_epoch``) before each epoch:
    without it ``DistributedSampler`` repeats the first epoch's order; with it
    an epoch's order depends only on ``(seed, epoch)``, so a resumed run
    continues as it would have. Evaluation reads in order with
    :class:`DistributedEvalSampler`: every sample exactly once over all ranks.
    ``balance``, ``weights``, ``num_samples`` or ``repeats`` make training
    draw with a :class:`~ddpkit.data.balanced.WeightedDistributedSampler`
    instead: as deterministic, the same number of batches on every rank, and
    as exact on resume, on the same or another number of ranks.

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
        multiprocessing_context: how workers start; default: Python's (``fork``
            on Linux before 3.14). ``"forkserver"`` never copies this process,
            whose other threads (Gloo's, NCCL's) make a ``fork`` able to hang
            a worker on CPython 3.11; it costs about 2 s once per process and
            needs a picklable dataset.
        balance: draw classes by the power of their size (training only): 1
            balances the classes, 0.5 draws by the square root of their size,
            0 as they are (with replacement); ``dataset.targets`` gives the
            labels (see :func:`ddpkit.data.balanced.class_weights`).
        weights: one weight per sample instead (training only), drawn with replacement.
        num_samples: draws per epoch with ``balance`` or ``weights``, before
            repeats; default: the dataset's length.
        repeats: copies of each drawn sample per epoch, on different ranks,
            each augmented apart (repeated augmentation, as timm's
            ``--aug-repeats``; an epoch is ``repeats`` times longer).

    Returns:
        A plain ``torch.utils.data.DataLoader``.

    Raises:
        ValueError: both or neither batch size, one below 1, a global batch
            size that does not divide over the ranks, ``workers`` outside
            0..1024, ``prefetch_factor`` below 1, ``seed`` outside 0..2**63-1,
            an unknown start method, or a batch larger than the dataset with
            ``drop_last`` (0 batches an epoch); ``balance`` with ``weights``,
            either (or ``repeats`` above 1) for evaluation, a dataset without
            ``targets`` for ``balance``, bad weights. Checked before anything is built.
        TypeError: ``dataset`` is an ``IterableDataset`` (no sampler applies)
            or has no ``__len__``; a count or seed that is not a whole number
            (``bool`` included), a flag that is not a ``bool``, ``info`` that is
            not a ``DistInfo``, ``collate_fn`` that is not callable.

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
    _check_arguments(
        dataset=dataset,
        batch_size=batch_size,
        global_batch_size=global_batch_size,
        train=train,
        workers=workers,
        seed=seed,
        drop_last=drop_last,
        info=info,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
        collate_fn=collate_fn,
        multiprocessing_context=multiprocessing_context,
    )
    # NumPy integers pass the checks; DataLoader takes only Python ints.
    batch_size, global_batch_size, prefetch_factor = (
        None if v is None else int(v) for v in (batch_size, global_batch_size, prefetch_factor)
    )
    world, rank, local_world = _job_shape(info)
    per_process = _per_process_batch(batch_size, global_batch_size, world, local_world, train)
    workers = _default_workers(local_world) if workers is None else int(workers)
    seed = int(seed)
    drop_last = train if drop_last is None else drop_last
    if pin_memory is None:
        pin_memory = torch.cuda.is_available() and (info is None or info.device.type == "cuda")

    sized: Any = dataset  # map-style: checked above, samplers need len()
    job = (world, rank, seed, drop_last)
    draws = _draws(sized, train, balance, weights, num_samples, repeats, job)
    epoch_length = len(sized) if draws is None else draws.total
    if drop_last and epoch_length // world < per_process:
        # Decided from numbers every rank shares, so every rank raises, none hangs.
        raise ValueError(
            f"build_loader: the dataset has {epoch_length} samples and a batch takes {per_process} "
            f"per process x {world} process(es) = {per_process * world}; with drop_last=True "
            "every epoch would have 0 batches. Lower the batch size (at most "
            f"{max(epoch_length // world, 1)} per process), use more data, or pass drop_last=False"
        )
    sampler: Sampler[Any]
    if draws is not None:
        sampler = draws
    elif train and world > 1:
        sampler = DistributedSampler(
            sized, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
        )
    elif train:
        sampler = EpochRandomSampler(sized, seed)
    elif world > 1:
        sampler = samplers.DistributedEvalSampler(sized, num_replicas=world, rank=rank)
    else:
        sampler = SequentialSampler(sized)

    loaded: Dataset[Any] = dataset
    if train:
        # Augmentations seeded per (seed, epoch, sample): reproducible and resumable.
        loaded, sampler = SeededSamples(dataset, seed), EpochIndexSampler(sampler)

    # DataLoader refuses worker options without workers; dropping them lets a
    # script switch to workers=0 for debugging and change nothing else.
    in_workers = workers > 0
    if in_workers:
        keep_forkserver_apart(multiprocessing_context)
    if collate_fn is None and getattr(dataset, "decode", None) == "cuda":
        collate_fn = gpu_decode.collate  # encoded images: a batch the GPU decodes
    return DataLoader(
        loaded,
        batch_size=per_process,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(_loader_seed(seed, rank)),
        worker_init_fn=functools.partial(_worker_start, os.getpid()) if in_workers else None,
        persistent_workers=in_workers and persistent_workers is not False,
        prefetch_factor=prefetch_factor if in_workers else None,
        multiprocessing_context=multiprocessing_context if in_workers else None,
    )


def __getattr__(name: str) -> Any:
    return _graveyard.moved_name(__name__, name)
