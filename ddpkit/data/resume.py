"""Finishing an interrupted epoch: the batches not yet seen, on any number of ranks, none twice.

A step checkpoint says how far into its epoch the run got (``ddpkit.position``).
On the same number of ranks the rest of the epoch is the rest of each rank's
share, batch for batch, so the run continues bit-exactly; the sampler skips
the indices already used, and no sample is read or decoded to skip it. On
another number of ranks, the samples of the epoch's order not yet consumed
are dealt out again: every one of them once, none of the consumed ones again.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, TypeGuard

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
)

from ddpkit.data.balanced import WeightedDistributedSampler
from ddpkit.data.samplers import EpochIndexSampler, EpochRandomSampler, set_epoch
from ddpkit.data.streams import (
    EPOCH_SEEDS,
    agreed_lengths,
    agreed_with_last,
    agreement_group,
    exact_length,
    state_holder,
)
from ddpkit.distributed import comm
from ddpkit.distributed.membership import refuse_strangers
from ddpkit.position import Position
from ddpkit.rng import capture_rng_state, restore_rng_state

__all__ = [
    "EpochBatches",
    "check_start",
    "data_change",
    "data_identity",
    "epoch_batches",
    "epoch_order",
    "inexact_resume",
    "loader_seed",
    "remainder_batches",
    "resume_verdict",
]

logger = logging.getLogger("ddpkit")


class EpochBatches:
    """What is left of one epoch on this rank, counted as it is read.

    Iterate it once for the remaining batches. After each batch it yields,
    :attr:`done` and :attr:`samples` count it, :attr:`last` says whether it
    is the epoch's last (on every rank: the ranks agree where it ends), and
    :meth:`position` is where training stands once the optimizer step that
    ends with it is taken. A loader without a length is read one batch ahead
    to know which is the last.

    Attributes:
        batches: the batches still to read (replace it with a wrapper of the
            same batches before iterating, to time or watch them).
        epoch: the epoch.
        done: batches of the epoch this rank consumed so far, those before
            the start included.
        first: ``done`` at the start: the epoch's index of the first batch yielded.
        samples: samples of the epoch's order all ranks consumed so far.
        total: batches of the whole epoch on this rank (the fewest any rank
            has); None if unknown.
        exact: whether ``total`` is what the epoch yields (a map-style
            loader's, a sequence's), not a stream's hint; a loader whose
            length is a hint is read one batch ahead like one without.
        step_samples: samples over all ranks that each remaining batch
            consumes; None when every batch takes ``batch_size x world_size``.
        last: the batch just yielded is the epoch's last.
        world_size: the ranks the epoch is dealt out to.
        data: the training set's size, index digest, order's seed (and each
            rank's size where they differ), as a position records them.
        dropped: batches this rank's loader held beyond the agreed end of the
            epoch (another rank's data ended first), known once it is read.
        holder: the object whose ``state_dict()`` is this rank's place in the
            stream (``ddpkit.data.streams.state_holder``), or None.
        seeds: a plain ``DataLoader``'s random state as the epoch's iterator
            started (the global generators' and each ``torch.Generator`` of the
            loader and its samplers), from which its workers' seeds and its
            order are drawn; None for another loader, or before the first batch.
    """

    def __init__(
        self,
        batches: Iterable[Any],
        done: int,
        total: int | None,
        step_samples: Sequence[int] | None = None,
        *,
        epoch: int = 0,
        samples: int = 0,
        batch_size: int | None = None,
        world_size: int = 1,
        data: tuple[Any, ...] = (None, None, None),
    ) -> None:
        self.batches, self.done, self.total, self.first = batches, done, total, done
        self.step_samples, self.epoch, self.samples = step_samples, epoch, samples
        self.world_size, self.data, self.last = world_size, data, False
        self.dropped = 0
        self.exact = True  # total is what the epoch yields, not a hint (see epoch_batches)
        self.holder: Any = None
        self.seeds: dict[str, Any] | None = None
        self._batch_size = batch_size
        self._agree = 1  # ranks that agree batch by batch where the epoch ends (1: none)
        self._own = total or 0  # batches of this rank's own epoch, before the ranks agreed
        self._state: Any = None  # the holder's state after the last batch yielded

    def __iter__(self) -> Iterator[Any]:
        items = iter(self.batches)
        sized = not self._read_ahead
        if sized:
            assert self.total is not None
            taking = itertools.islice(items, max(self.total - self.done, 0))
            pairs: Iterator[tuple[Any, ...]] = _with_last(taking, self.total, self.done)
        else:
            dropped: list[int] = []
            pairs = agreed_with_last(items, self.holder, self._agree, dropped)
        for taken, (item, last, *state) in enumerate(pairs):
            self.done, self.last = self.done + 1, last
            if state:
                self._state = state[0]
            if self.step_samples is not None:
                self.samples += self.step_samples[taken]
            else:
                self.samples += (self._batch_size or _batch_size(item)) * self.world_size
            yield item
        # A stream is read to its end (what lay beyond the agreed end, a longer rank's share, is
        # counted, and the stream ends its epoch); a loader with a length is counted unread,
        # and asked once more when it holds no more (a DataLoader stops its workers there).
        self.dropped = max(self._own - self.done, 0) if sized else sum(dropped)
        if sized and not self.dropped:
            next(items, None)
        elif sized and callable(getattr(items, "close", None)):
            items.close()  # type: ignore[attr-defined]  # its workers stop now, not at collection

    def position(self, step: int) -> Position:
        """Where training stands after optimizer step ``step`` (counted over the run), here."""
        return Position(self.epoch, self.done, self.samples, step, self.world_size, *self.data)

    def loader_state(self) -> Any:
        """The holder's ``state_dict()`` after the last batch yielded; a plain loader's seeds.

        Read one batch ahead, the loader is already past that batch: its state
        was taken before the next one was read. A plain ``DataLoader``'s is
        ``{EPOCH_SEEDS: seeds}``; None for any other loader.
        """
        if self.holder is None:
            return None if self.seeds is None else {EPOCH_SEEDS: self.seeds}
        return self._state if self._read_ahead else self.holder.state_dict()

    @property
    def _read_ahead(self) -> bool:
        """Whether the epoch is read one batch ahead (its end agreed, or its length a hint)."""
        return self.total is None or self._agree > 1 or not self.exact


def _with_last(batches: Iterator[Any], total: int, done: int) -> Iterator[tuple[Any, bool]]:
    """Each batch with whether it is the epoch's ``total``-th."""
    for index, item in enumerate(batches, done + 1):
        yield item, index == total


def _batch_size(batch: Any) -> int:
    """Samples in one batch: the length of its targets (its last part), else of its first."""
    parts = list(batch.values()) if isinstance(batch, Mapping) else batch
    if isinstance(parts, list | tuple) and parts:
        for part in (parts[-1], parts[0]):
            size = getattr(part, "shape", None)
            if size is not None and len(size):
                return int(size[0])
            if isinstance(part, Sized):
                return len(part)
    raise TypeError(
        f"cannot tell how many samples a {type(batch).__name__} batch holds: give the loader a "
        "batch_size (a DataLoader), or batches of (inputs, targets) tensors"
    )


def epoch_batches(
    loader: Iterable[Any],
    epoch: int,
    start: Position | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    data: tuple[int | None, str | None] | None = None,
    loader_state: Any = None,
) -> EpochBatches:
    """The batches of ``epoch`` still to train on this rank, from ``start`` on (all without one).

    Calls :func:`set_epoch` on a DataLoader first. On the number of ranks that
    took ``start``, the rest of this rank's own share, batch for batch
    (``build_loader``'s loaders skip the indices without reading a sample);
    on another, the samples of the epoch's order not yet consumed, dealt out
    again to every rank, each once, the same number of batches everywhere.
    Another loader is read and the done batches dropped, unless it keeps
    its place itself: given ``loader_state`` (this rank's, saved with
    ``start``), its holder (the loader, or in one read in this process its
    sampler or dataset) loads it and the epoch goes on from there. A plain
    ``DataLoader`` keeps the random state its epoch's iterator drew its
    seeds from (:attr:`EpochBatches.seeds`, its ``loader_state()``); given
    back, the done batches are read again from it, so each worker draws
    what it drew (without workers, in a known order, the rest is cut from
    the order). A resumed loader's iterator is made at once, and the global
    generators are left as the checkpoint restored them, so a resumed run
    draws what an unbroken one would; a fresh epoch's starts at its first batch.

    The ranks agree where the epoch ends, so that none leaves it while
    another is still in DDP's all-reduce: when every rank's loader has a
    length, once (the fewest batches any rank has), else batch by batch as
    the result is read (one small all-reduce each). A rank whose data go
    on drops the rest (:attr:`EpochBatches.dropped`, counted unread given a length). So with an
    initialised process group of more than one rank, every rank must call
    this for the same epoch and read the result to its end together, or
    it deadlocks. The result counts what it yields: its
    :meth:`EpochBatches.position` is the position a step checkpoint records.

    Args:
        loader: the training loader.
        epoch: the epoch (0, 1, ...).
        start: where training stood (a resumed checkpoint's position); only a
            position in the middle of ``epoch`` skips anything.
        world_size: ranks now; default: this job's (``ddpkit.get_world_size()``).
        rank: this rank; default: this process's (``ddpkit.get_rank()``).
        data: the training set's size and digest (:func:`data_identity`),
            if the caller has them; default: taken from ``loader.dataset``. The
            sampler's seed (:func:`loader_seed`) is recorded beside them.
        loader_state: this rank's ``TrainingState.loader_state`` of ``start``
            (a stateful loader's place), or None to skip by position.

    Raises:
        ValueError: ``start`` is mid-epoch on another number of ranks (or with
            another batch size) and the loader's order cannot be known: it is
            not a DataLoader with ``build_loader``'s or a ``DistributedSampler``.
    """
    world = comm.get_world_size() if world_size is None else world_size
    me = comm.get_rank() if rank is None else rank
    size, digest = data_identity(getattr(loader, "dataset", None)) if data is None else data
    identity = (size, digest, loader_seed(loader))
    holder = state_holder(loader)
    here = start is not None and start.epoch == epoch
    seeds = loader_state.get(EPOCH_SEEDS) if isinstance(loader_state, Mapping) else None
    if holder is not None and loader_state is not None and start is not None and here:
        if not start.mid_epoch:
            raise ValueError("loader_state is a place in the middle of an epoch; start is not")
        if isinstance(loader, DataLoader):
            set_epoch(loader, epoch)
        holder.load_state_dict(loader_state)
        part = EpochBatches(_skipped(loader, 0), start.batches, _length(loader))
    else:
        part = _rest(loader, epoch, start, world, me, seeds if holder is None else None)
    if holder is None and part.batches is loader and _plain(loader):
        part.batches = _seeded(part, loader)
    part.epoch, part.world_size, part.data, part.holder = epoch, world, identity, holder
    if not exact_length(loader):
        part.exact = False
    part.samples = start.samples if start is not None and here else 0
    if isinstance(loader, DataLoader):
        part._batch_size = loader.batch_size
    # Where the epoch ends, agreed by the ranks of the process group (none alone).
    group = comm.get_world_size()
    if group > 1:
        sized, shortest, sizes = agreed_lengths(part.total if part.exact else None, size)
        if len(set(sizes)) > 1 and all(n is not None for n in sizes):
            part.data = (*identity, sizes)  # each rank's own: a stream split by rank
        if sized:
            part.total = shortest
        else:
            part.total, part._agree = None, group
            agreement_group()  # made here, where every rank is, not at the first batch
    return part


def _seeded(part: EpochBatches, loader: DataLoader[Any]) -> Iterator[Any]:
    """``loader``'s batches, ``part.seeds`` taken just before its iterator starts.

    A plain ``DataLoader``'s iterator draws its workers' seed (and a sampler
    its order) from them: kept, so that a resume mid-epoch can draw the same again.
    """
    part.seeds = _seeds(loader)
    yield from loader


def _seeds(loader: DataLoader[Any]) -> dict[str, Any]:
    """The random state a ``DataLoader``'s iterator draws its seeds and order from, as it is now.

    The global generators' (torch's: the workers' seed, a ``RandomSampler``'s
    order; Python's and NumPy's: a sampler of one's own), and each
    ``torch.Generator`` the loader, its sampler or batch sampler holds.
    """
    return {"rng": capture_rng_state(), "generators": [g.get_state() for g in _generators(loader)]}


def _generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """The ``torch.Generator`` objects of the loader, its sampler and batch sampler, once each."""
    batch_sampler = loader.batch_sampler
    holders = (loader, loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None))
    found = [getattr(h, "generator", None) for h in holders]
    unique = {id(g): g for g in found if isinstance(g, torch.Generator)}
    return list(unique.values())


def _skipped(
    loader: Iterable[Any], done: int, seeds: Mapping[str, Any] | None = None
) -> Iterator[Any]:
    """An iterator of ``loader`` with its first ``done`` batches read and dropped, now.

    Neither the iterator's start nor the batches read draw from the global
    generators (torch's, Python's, NumPy's): in the run that took the
    checkpoint, those draws (a ``DataLoader``'s worker seed, a
    ``RandomSampler``'s seed, the done batches' augmentation) came before it;
    a loader that restores its place brings back those seeds from its state,
    and a plain ``DataLoader`` from ``seeds`` (:attr:`EpochBatches.seeds` of the
    epoch): its order and its workers then draw, batch for batch, what they drew before.
    """
    with _kept_rng():
        if seeds is not None and isinstance(loader, DataLoader):
            restore_rng_state(seeds["rng"])
            for generator, state in zip(_generators(loader), seeds["generators"], strict=False):
                generator.set_state(state)
        batches = iter(loader)
        for _ in itertools.islice(batches, done):
            pass
    return batches


def _rest(
    loader: Iterable[Any],
    epoch: int,
    start: Position | None,
    world_size: int,
    rank: int,
    seeds: Mapping[str, Any] | None = None,
) -> EpochBatches:
    if isinstance(loader, DataLoader):
        set_epoch(loader, epoch)
    if start is None or start.epoch != epoch or not start.mid_epoch:
        return EpochBatches(loader, 0, _length(loader))
    if (
        seeds is not None
        and start.world_size == world_size
        and _plain(loader)
        and _replayed(loader)
    ):
        # Read again with the epoch's seeds: each worker (or the rank) draws what it drew.
        part = EpochBatches(_skipped(loader, start.batches, seeds), start.batches, _length(loader))
        part.seeds = dict(seeds)
        return part
    batch = loader.batch_size if isinstance(loader, DataLoader) else None
    regular = (
        start.world_size == world_size
        and batch is not None
        and start.samples == start.batches * batch * world_size
    )
    # A stream (a DataLoader over an IterableDataset) has no order of indices to skip in.
    stream = isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset)
    if not isinstance(loader, DataLoader) or batch is None or stream:
        data = getattr(loader, "dataset", None)
        what = f"a stream ({type(data).__name__})" if stream else "the loader"
        if start.world_size != world_size:
            fix = (
                f"resume on {start.world_size} rank(s), or from the epoch checkpoint "
                "(latest.pth), which starts the next epoch on any number"
                if stream
                else "build it with ddpkit.build_loader"
            )
            raise ValueError(
                f"cannot continue epoch {epoch} on {world_size} rank(s) from a checkpoint of "
                f"{start.world_size}: {what} ({type(loader).__name__}) has no order of "
                f"samples to deal out again; {fix}"
            )
        logger.warning(
            "resuming mid-epoch: %s (%s) cannot skip without reading, so the %d batches "
            "already done are read again and dropped; %s",
            what,
            type(loader).__name__,
            start.batches,
            "a stateful loader (torchdata's StatefulDataLoader) resumes in place"
            if stream
            else "ddpkit.build_loader skips them",
        )
        return EpochBatches(_skipped(loader, start.batches), start.batches, _length(loader))
    sampler = loader.sampler
    if regular:
        # The rest of this rank's own share, cut as the loader would, no sample read (neither
        # the order nor the iterator drawing from torch's generator: the checkpoint's drew).
        with _kept_rng():
            rest = list(sampler)[start.batches * batch :]
        mine = [list(b) for b in BatchSampler(rest, batch, loader.drop_last)]
        cut = _skipped(_loader_like(loader, mine), 0)
        part = EpochBatches(cut, start.batches, start.batches + len(mine))
        part.seeds = None if seeds is None else dict(seeds)
        return part
    order = epoch_order(loader, epoch)
    if order is None:
        raise ValueError(
            f"cannot continue epoch {epoch} on {world_size} rank(s) with batch size {batch} from "
            f"a checkpoint of {start.world_size} rank(s): the order of the loader's "
            f"{type(sampler).__name__} is unknown; build the loader with ddpkit.build_loader "
            "or a DistributedSampler"
        )
    keys, indices = order
    mine_idx, sizes, dropped = remainder_batches(indices[start.samples :], world_size, rank, batch)
    if dropped:
        logger.warning(
            "the last %d sample(s) of epoch %d are left out: fewer remain than there are ranks",
            dropped,
            epoch,
        )
    mine = [[keys(i) for i in b] for b in mine_idx]
    return EpochBatches(_loader_like(loader, mine), start.batches, start.batches + len(mine), sizes)


def epoch_order(
    loader: DataLoader[Any], epoch: int
) -> tuple[Callable[[int], Any], list[int]] | None:
    """The epoch's order of sample indices over all ranks, and how an index becomes a key.

    ``DistributedSampler`` and :class:`EpochRandomSampler` draw the same
    permutation of ``(seed, epoch)``; rank ``r`` of ``R`` takes its positions
    ``r, r + R, ...``. A :class:`WeightedDistributedSampler`'s order is of
    positions, each key ``(epoch, index, position)``. None for a sampler
    whose order is unknown.
    """
    sampler: Any = loader.sampler
    keys: Callable[[int], Any] = int
    if isinstance(sampler, EpochIndexSampler):
        sampler, keys = sampler.inner, lambda index: (epoch, index)
    if isinstance(sampler, WeightedDistributedSampler):
        drawn = sampler.order(epoch)
        if not isinstance(loader.sampler, EpochIndexSampler):
            return (lambda p: (int(drawn[p]), p)), list(range(sampler.total))
        return (lambda p: (epoch, int(drawn[p]), p)), list(range(sampler.total))
    if isinstance(sampler, DistributedSampler):
        n = len(sampler.dataset)  # type: ignore[arg-type]
        if not sampler.shuffle:
            return keys, list(range(n))
        seed = sampler.seed
    elif isinstance(sampler, EpochRandomSampler):
        n, seed = len(sampler.data_source), sampler.seed
    else:
        return None
    generator = torch.Generator().manual_seed(seed + epoch)
    return keys, torch.randperm(n, generator=generator).tolist()


def remainder_batches(
    rest: Sequence[int], world_size: int, rank: int, batch: int
) -> tuple[list[list[int]], list[int], int]:
    """Deal ``rest`` (the epoch's unconsumed order) out to ``world_size`` ranks, each sample once.

    Steps take ``batch x world_size`` samples in order, rank ``r`` taking
    every ``world_size``-th from ``r``, as a ``DistributedSampler`` does. The
    last step takes what is left; when that is under two per rank it joins the
    step before, so no rank trains on a batch of one when it can be helped.
    Every rank gets the same number of batches, so none waits in a collective.

    Returns:
        This rank's batches, the samples each step takes over all ranks, and
        how many samples were left out (only when fewer remain than ranks).
    """
    m, per_step = len(rest), batch * world_size
    if m < world_size:
        return [], [], m
    steps = math.ceil(m / per_step)
    if steps > 1 and m - (steps - 1) * per_step < 2 * world_size:
        steps -= 1
    bounds = [j * per_step for j in range(steps)] + [m]
    chunks = [rest[bounds[j] : bounds[j + 1]] for j in range(steps)]
    return [list(c[rank::world_size]) for c in chunks], [len(c) for c in chunks], 0


def inexact_resume(loader: Iterable[Any], start: Position, loader_state: Any) -> str | None:
    """Why a resume at ``start`` with ``loader`` will not draw what an unbroken run drew; None.

    A plain ``DataLoader`` whose workers persist between epochs (their random
    state goes on from the first epoch); one resumed mid-epoch from a
    checkpoint without the epoch's seeds (``loader_state``), when the rest
    cannot be cut from a known order in this process.
    """
    if not _plain(loader):
        return None
    seeds = loader_state.get(EPOCH_SEEDS) if isinstance(loader_state, Mapping) else None
    if loader.num_workers and loader.persistent_workers:
        why = (
            f"its {loader.num_workers} workers persist between epochs (persistent_workers="
            "True), so their random state (each sample's augmentation) goes on from the "
            "first epoch and cannot be rebuilt"
        )
    elif start.mid_epoch and seeds is None and _replayed(loader):
        why = (
            "the checkpoint holds no seeds of the epoch's DataLoader iterator (it was saved "
            "by an older ddpkit, or on another number of ranks), from which its workers' "
            "augmentation (or a RandomSampler's order) is drawn"
        )
    elif not start.mid_epoch and any(
        g is not loader.generator or loader.num_workers for g in _generators(loader)
    ):
        why = (
            "the epoch's order or its workers' seeds come from a torch.Generator of the "
            "loader or its sampler (generator=), whose state an epoch's checkpoint does not "
            "hold: the script's fresh generator draws them"
        )
    else:
        return None
    return (
        f"the training loader ({type(loader).__name__}) does not resume bit-exactly: {why}. "
        "The samples are the right ones; for an exact resume build it with "
        "ddpkit.build_loader (or without persistent_workers)"
    )


def _plain(loader: Iterable[Any]) -> TypeGuard[DataLoader[Any]]:
    """A ``DataLoader`` whose place is its position and its iterator's seeds (no state, no keys).

    Not ``build_loader``'s: its samples draw from seeds of ``(seed, epoch, index)``.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.sampler, EpochIndexSampler):
        return False
    with warnings.catch_warnings():  # state_holder's warning is given where it is asked
        warnings.simplefilter("ignore")
        return state_holder(loader) is None


def _replayed(loader: Iterable[Any]) -> bool:
    """Whether a resume reads ``loader``'s done batches again to draw what they drew.

    All but a ``DataLoader`` read in this process in a known order (a
    ``DistributedSampler``'s, a ``SequentialSampler``'s), whose rest is cut
    from its order and draws from the restored RNG: workers draw from seeds
    of the epoch's start, and a ``RandomSampler`` draws its order from torch's.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return True
    known = isinstance(loader.sampler, DistributedSampler | SequentialSampler)
    return loader.num_workers > 0 or not known or not _plain_batches(loader)


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    """The global generators (torch's, Python's, NumPy's) as they were on entry, whatever the
    block draws."""
    before = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(before)


def _plain_batches(loader: DataLoader[Any]) -> bool:
    return (
        type(loader.batch_sampler) is BatchSampler
        and loader.batch_sampler.sampler is loader.sampler
    )


def _loader_like(loader: DataLoader[Any], batches: list[list[Any]]) -> DataLoader[Any]:
    """A one-epoch DataLoader over ``batches`` that reads like ``loader``."""
    workers = loader.num_workers
    return DataLoader(
        loader.dataset,
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
    )


def _length(loader: Iterable[Any]) -> int | None:
    """Batches an epoch of ``loader`` holds; None when it cannot say.

    A ``DataLoader`` is ``Sized`` either way, but asks its dataset: over an
    ``IterableDataset`` without ``__len__`` its ``len()`` raises ``TypeError``.
    """
    if not isinstance(loader, Sized):
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def data_identity(dataset: Any) -> tuple[int | None, str | None]:
    """The training set's size and a digest of its index, as a step checkpoint records them.

    The digest covers the class names and every sample's label (a
    ``LazyLMDBDataset``'s index, read once; ``targets`` of another dataset,
    as ``ImageFolder`` has): cheap, and it changes when samples are added,
    removed or relabelled. None when the dataset has neither.
    """
    size = len(dataset) if isinstance(dataset, Sized) else None
    labels = getattr(dataset, "labels", None)
    if not isinstance(labels, np.ndarray | torch.Tensor):
        labels = getattr(dataset, "targets", None)
    try:
        array = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    except (TypeError, ValueError):
        return size, None
    if labels is None or array.dtype.kind not in "iub" or array.ndim != 1:
        return size, None
    digest = hashlib.sha256(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    classes = getattr(dataset, "classes", None)
    if isinstance(classes, Sequence):
        digest.update("\0".join(map(str, classes)).encode())
    return size, f"sha256:{digest.hexdigest()[:32]}"


def loader_seed(loader: Any) -> int | None:
    """The seed of a loader's training order (its sampler's ``seed``), or None: none to say."""
    sampler = getattr(loader, "sampler", None)
    sampler = getattr(sampler, "inner", sampler)  # build_loader's EpochIndexSampler
    seed = getattr(sampler, "seed", None)
    return seed if type(seed) is int else None


def data_change(
    start: Position, dataset: Any, seed: int | None = None, rank: int | None = None
) -> str | None:
    """How the training set (or ``seed``, its order's) differs from ``start``'s; None: the same.

    Compared with ``rank``'s own size where the ranks' differed (a stream
    split by rank; default: this process's rank). A position that recorded
    no data (before ddpkit recorded them, or an epoch end) is the same for any data.
    """
    if seed is not None and start.data_seed is not None and seed != start.data_seed:
        return f"the training order's seed was {start.data_seed} then and is {seed} now"
    then = start.rank_data_size(comm.get_rank() if rank is None else rank)
    if then is None:
        return None
    size, digest = data_identity(dataset)
    if size is not None and size != then:
        return f"the training set had {then} samples then and has {size} now"
    if digest is not None and start.data_digest is not None and digest != start.data_digest:
        return (
            f"the training set has the same {size} samples but a different index (other "
            f"labels, order or classes: digest {start.data_digest} then, {digest} now)"
        )
    return None


def resume_verdict(
    loader: Iterable[Any], start: Position, world_size: int, rank: int
) -> tuple[str | None, str | None]:
    """Whether a mid-epoch ``start`` fits ``loader``: ``(data change, misfit)``, None each if so.

    The change is :func:`data_change`'s, the misfit :func:`check_start`'s.
    Each rank judges its own data, and every rank of the process group gets
    the same verdict (the first rank's that found one, named when the ranks
    differ), so all resume, move on or stop together: a collective. A server
    whose ranks alone found one joined with other data: it is refused
    (:func:`~ddpkit.distributed.membership.refuse_strangers`), and the others go on.

    Raises:
        JoinRefused: some servers' data differ from the others'.
    """
    change = data_change(start, getattr(loader, "dataset", None), loader_seed(loader), rank)
    misfit = None
    if change is None:
        try:
            check_start(loader, start, world_size)
        except ValueError as exc:
            misfit = str(exc)
    return refuse_strangers(change), refuse_strangers(misfit)


def check_start(loader: Iterable[Any], start: Position, world_size: int) -> None:
    """Refuse a mid-epoch ``start`` that cannot be a position in ``loader``'s epoch.

    Raises:
        ValueError: on the same number of ranks, ``start.batches`` is more than
            an epoch's batches per rank, or ``start.samples`` more than an
            epoch's samples over all ranks; the message names the field.
    """
    total = _length(loader) if exact_length(loader) else None  # a stream's is a hint
    if not start.mid_epoch or start.world_size != world_size or total is None:
        return
    if start.batches > total:
        raise ValueError(
            f"its position's batches is {start.batches}, but an epoch of this training loader "
            f"has {total} batches per rank"
        )
    batch = loader.batch_size if isinstance(loader, DataLoader) else None
    if batch is not None and start.samples > total * batch * world_size:
        raise ValueError(
            f"its position's samples is {start.samples}, but an epoch of this training loader "
            f"takes at most {total * batch * world_size} ({total} batches of {batch} on "
            f"{world_size} rank(s))"
        )
