"""Streams: ranks whose data end apart stop an epoch together, and a loader's own place.

A loader over an ``IterableDataset`` (WebDataset shards, a torchdata
pipeline, a stream of your own) may give each rank another number of
batches, and may not know how many. DDP's gradient all-reduce needs every
rank in every step: a rank that leaves the epoch early crashes the others
(Gloo) or hangs them (NCCL). So the ranks agree where the epoch ends:

- every rank's loader has a length: once per epoch, the shortest; the others
  drop what they hold beyond it;
- otherwise: before each batch, whether every rank has it (one small
  all-reduce per batch), the loader read one batch ahead; a rank stopped
  early reads the rest of its stream to count what it dropped.

The epoch's record names the batches each rank dropped. (Not
``torch.distributed.algorithms.Join``: it shadows DDP's all-reduce with
zeros, so the ranks that finished pull the mean towards zero for the rest of
the epoch, and it cannot shadow SyncBatchNorm's collectives in the forward,
which then hang.)

A stream that cannot skip to a position keeps its place in its own
``state_dict()`` (torchdata's ``StatefulDataLoader``, a stateful
``IterableDataset``): :func:`state_holder` finds the object whose state is
this rank's place, and :func:`loader_states_for` decides whether a
checkpoint's saved places fit this job.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from ddpkit.distributed import comm

__all__ = [
    "ANY_WORLD_SIZE",
    "EPOCH_SEEDS",
    "agreed_lengths",
    "agreed_with_last",
    "agreement_group",
    "check_batches",
    "exact_length",
    "is_stateful",
    "loader_states_for",
    "state_holder",
]

logger = logging.getLogger("ddpkit")

# A loader's state_dict() that holds this key set to True says it may be loaded on any
# number of ranks (its load_state_dict() re-splits the stream itself).
ANY_WORLD_SIZE = "ddpkit_any_world_size"
# A plain DataLoader's saved place: {EPOCH_SEEDS: the seeds its epoch's iterator drew from}.
EPOCH_SEEDS = "ddpkit_epoch_seeds"


def is_stateful(thing: Any) -> bool:
    """Whether ``thing`` has ``state_dict()`` and ``load_state_dict()`` (torch's Stateful)."""
    return callable(getattr(thing, "state_dict", None)) and callable(
        getattr(thing, "load_state_dict", None)
    )


def state_holder(loader: Any) -> Any | None:
    """The object whose ``state_dict()`` is this rank's place in ``loader``'s epoch; or None.

    The loader itself when it is stateful (torchdata's ``StatefulDataLoader``
    gathers its workers' dataset states). In a plain ``DataLoader`` read in
    this process (``num_workers=0``), a stateful sampler, else a stateful
    stream (an ``IterableDataset``; a map-style dataset's sampler says where
    the epoch stands). With workers, a plain ``DataLoader`` reads its sampler ahead
    and its dataset in copies of its own, so neither's state is the place:
    None, with a warning to use a ``StatefulDataLoader``.
    """
    if is_stateful(loader):
        return loader
    if not isinstance(loader, DataLoader):
        return None
    # A map-style dataset's state is no place in the epoch (its sampler says where): only a
    # stream's is.
    dataset = loader.dataset if isinstance(loader.dataset, IterableDataset) else None
    candidates = [
        thing
        for thing in (loader.batch_sampler, loader.sampler, dataset)
        if thing is not None and is_stateful(thing)
    ]
    if not candidates:
        return None
    if loader.num_workers == 0:
        return candidates[0]
    warnings.warn(
        f"the training loader's {type(candidates[0]).__name__} has a state_dict(), but with "
        f"num_workers={loader.num_workers} a DataLoader reads it in its workers (or ahead of "
        "the batches), so that state is not the epoch's place and a resume re-reads the "
        "stream instead. Use torchdata's StatefulDataLoader (pip install 'ddpkit[streams]'), "
        "which saves its workers' places",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def exact_length(loader: Any) -> bool:
    """Whether ``len(loader)`` is the number of batches an epoch yields, not a hint.

    A sequence's, and a ``DataLoader``'s over a map-style dataset (its sampler
    decides). A stream's ``__len__`` (WebDataset's ``with_length``, an
    ``IterableDataset`` split over workers) may be off by some batches.
    """
    if isinstance(loader, DataLoader):
        return not isinstance(loader.dataset, IterableDataset)
    return isinstance(loader, Sequence)


def check_batches(loader: Iterable[Any], world: int) -> None:
    """Refuse a training loader that yields no batch, before anything is trained or saved.

    Only a loader whose length is exact (:func:`exact_length`): a stream's is a
    hint, and a stream that yields nothing is refused at its epoch's end.

    Raises:
        ValueError: the loader's exact length is 0; names the batch size and the fix.
    """
    if not exact_length(loader) or len(loader) > 0:  # type: ignore[arg-type]
        return
    batch = getattr(loader, "batch_size", None)
    drop = getattr(loader, "drop_last", None)
    data = getattr(loader, "dataset", None)
    size = len(data) if data is not None and hasattr(data, "__len__") else "?"
    raise ValueError(
        f"the training loader yields no batch: the dataset has {size} samples, a batch is "
        f"{batch} per process x {world} process(es), drop_last={drop}. Lower the batch size "
        "(or use more data); with drop_last=False a short last batch is kept"
    )


def agreed_lengths(
    total: int | None, size: int | None = None
) -> tuple[bool, int | None, tuple[int | None, ...]]:
    """Once per epoch: whether every rank's loader has a length, the shortest, each rank's size.

    Returns ``(True, shortest, sizes)`` when every rank knows its epoch's
    length, ``(False, None, sizes)`` when one does not (the ranks then agree
    batch by batch); ``sizes`` holds each rank's ``size`` (its training set's,
    which a stream split by rank has of its own). One process alone:
    ``(total is not None, total, (size,))``, no collective. All ranks of the
    process group must call this, or it deadlocks.
    """
    if comm.get_world_size() < 2:
        return total is not None, total, (size,)
    pairs = comm.all_gather_object((total, size))
    totals, sizes = [t for t, _ in pairs], tuple(n for _, n in pairs)
    if any(t is None for t in totals):
        return False, None, sizes
    return True, min(t for t in totals if t is not None), sizes


def _every_rank_has(flag: bool, world: int) -> bool:
    """Whether ``flag`` holds on every rank (one small all-reduce, on the CPU).

    Under NCCL the all-reduce goes through a Gloo group of the same ranks, made
    once: an NCCL one would wait for the GPU every batch.
    """
    import torch
    import torch.distributed as dist

    flags = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(flags, group=_cpu_group())
    return int(flags.item()) == world


_CPU_GROUPS: dict[int, Any] = {}


def agreement_group() -> Any:
    """The group the ranks agree in batch by batch; made now on every rank (a collective)."""
    return _cpu_group()


def _cpu_group() -> Any:
    """The default group when it is Gloo's, else a Gloo group of all ranks (made once)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]


class _Ahead:
    """A stream read one item ahead: each item with the holder's state just after it."""

    def __init__(self, items: Iterator[Any], holder: Any | None) -> None:
        self.items, self.holder = items, holder
        self.end = object()

    def take(self) -> tuple[Any, Any]:
        item = next(self.items, self.end)
        state = None
        if item is not self.end and self.holder is not None:
            # Before the next item is read; a copy: a holder may hand out its live dict.
            state = copy.deepcopy(self.holder.state_dict())
        return item, state


def agreed_with_last(
    items: Iterator[Any], holder: Any | None, world: int, dropped: list[int]
) -> Iterator[tuple[Any, bool, Any]]:
    """Each item, whether it is the epoch's last on every rank, and the holder's state after it.

    Read one item ahead; with ``world`` ranks, before each item they agree
    whether every rank has it (one all-reduce per item). When one rank's
    stream ends, all stop after the same item; a rank whose stream goes on
    reads it to the end and appends the count it dropped to ``dropped``. All
    ranks must iterate this to its end together, or the all-reduce deadlocks.
    """
    ahead = _Ahead(items, holder)

    def have(item: Any) -> bool:
        mine = item is not ahead.end
        return _every_rank_has(mine, world) if world > 1 else mine

    held, state = ahead.take()
    going = have(held)
    while going:
        following, following_state = ahead.take()
        going = have(following)
        yield held, not going, state
        held, state = following, following_state
    if held is not ahead.end:  # this rank holds more than the others: count what it drops
        dropped.append(1 + sum(1 for _ in items))


def loader_states_for(
    saved: Sequence[Any] | None, world: int, rank: int, mid_epoch: bool, name: str
) -> Any | None:
    """This rank's saved loader state from a checkpoint's per-rank list, or None.

    On the number of ranks that saved them, this rank's own. On another
    number, mid-epoch: every state must say it may be re-split (``ANY_WORLD_SIZE``
    set True), and each rank gets rank 0's, else a ``ValueError`` that says
    why and what to do; at an epoch's start the saved places are not needed
    (each rank starts its share of the epoch afresh): None.

    Raises:
        ValueError: mid-epoch on another number of ranks, with states that do
            not say they may be re-split.
    """
    if not mid_epoch or not saved or all(s is None for s in saved):
        return None  # an epoch's start (also one moved on to): each rank starts its stream
    if len(saved) == world:
        return saved[rank]
    if all(isinstance(s, Mapping) and s.get(ANY_WORLD_SIZE) is True for s in saved):
        return saved[0]
    raise ValueError(
        f"{name} holds each rank's place in its data stream as {len(saved)} rank(s) read it, "
        f"and this job has {world}: a stream's place cannot be dealt out to another number "
        f"of ranks (each rank reads shards of its own). Resume on {len(saved)} rank(s), or "
        "from the last epoch checkpoint (fit(resume='.../latest.pth')), which starts an "
        "epoch afresh on any number; a loader whose load_state_dict() re-splits its stream "
        f"says so with {ANY_WORLD_SIZE!r}: True in its state_dict()"
    )
