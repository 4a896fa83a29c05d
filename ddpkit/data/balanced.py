"""Class-balanced, weighted and repeated draws for training, distributed and exact on resume.

An epoch is one global order of draws, a function of ``(seed, epoch)`` only:
``torch.multinomial`` over per-sample weights (with replacement) or a plain
permutation, each draw repeated ``repeats`` times in a row (repeated
augmentation). Rank ``r`` of ``R`` takes positions ``r, r + R, ...`` of it,
as ``DistributedSampler`` does, so every rank gets the same number of
samples, consecutive copies of a draw land on different ranks, and
``ddpkit.data.resume`` deals out the unseen rest of an interrupted epoch on
any number of ranks. Each draw's position in the order is its ``draw``
number: the copies of one image get different augmentations.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ddpkit._docs import see
from ddpkit.distributed import comm

__all__ = ["WeightedDistributedSampler", "class_weights"]


def _error(message: str) -> ValueError:
    return ValueError(f"{message}. {see('weighted-balanced-and-repeated-sampling')}")


def class_weights(
    targets: Sequence[int] | np.ndarray | torch.Tensor, power: float = 1.0
) -> torch.Tensor:
    """Per-sample weights ``count(class) ** -power``, summing to 1, from the samples' labels.

    ``power=1`` draws every class equally often (class-balanced), ``0.5``
    in proportion to the square root of its size, ``0`` as often as it
    occurs (a shuffle with replacement).

    Raises:
        ValueError: ``power`` outside 0..1, no labels, or a negative label.
    """
    if isinstance(power, bool) or not isinstance(power, numbers.Real) or not 0 <= power <= 1:
        raise _error(
            f"power must be a number in 0..1 (0: as the data are, 0.5: square root, "
            f"1: class-balanced), got {power!r}"
        )
    labels = torch.as_tensor(np.asarray(targets), dtype=torch.int64).reshape(-1)
    if labels.numel() == 0:
        raise _error("class weights need at least one label, got none")
    if int(labels.min()) < 0:
        raise _error(f"labels must be class indices (0 or more), got {int(labels.min())}")
    counts = torch.bincount(labels).to(torch.float64)
    weights = counts[labels].pow(-float(power))
    return (weights / weights.sum()).to(torch.float32)


class WeightedDistributedSampler(Sampler[tuple[int, int]]):
    """Draw an epoch by per-sample weights (or shuffle), repeat each draw, share it over ranks.

    The epoch's order over all ranks depends on ``(seed, epoch)`` only:
    ``num_samples`` draws by ``torch.multinomial(weights, replacement=True)``
    (with ``weights=None``, permutations of the dataset, each sample once per
    pass), each repeated ``repeats`` times in a row. Rank ``r`` of ``R`` takes
    the positions ``r, r + R, ...`` (``drop_last``: the first
    ``len(order) // R`` each; otherwise the order wraps around to even them
    out), so every rank has the same number of batches, and with ``repeats
    <= R`` the copies of a draw are on different ranks. It yields ``(index,
    position)``: the position seeds that copy's augmentation
    (``build_loader`` does this). Memory: 4 bytes a sample for the weights,
    8 a draw for the order, rebuilt in :meth:`set_epoch`.

    Args:
        weights: one non-negative weight per sample (see :func:`class_weights`),
            or an int: the dataset's length, drawn without weights.
        num_samples: draws per epoch before repeats; default: the dataset's length.
        repeats: copies of each draw in the epoch (repeated augmentation).
        num_replicas: ranks; default: ``ddpkit.get_world_size()``.
        rank: this rank; default: ``ddpkit.get_rank()``.
        seed: the order's seed, the same on every rank.
        drop_last: drop the tail that does not divide over the ranks.

    Raises:
        ValueError: a weight that is negative or not finite, weights that sum to
            0, ``num_samples`` or ``repeats`` below 1, or a bad rank.
    """

    def __init__(
        self,
        weights: Sequence[float] | np.ndarray | torch.Tensor | int,
        num_samples: int | None = None,
        *,
        repeats: int = 1,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(weights, numbers.Integral) and not isinstance(weights, bool):
            self.weights: torch.Tensor | None = None
            self.length = int(weights)
        else:
            self.weights = _checked_weights(weights)
            self.length = len(self.weights)
        self.num_samples = self.length if num_samples is None else num_samples
        for name, value in (("num_samples", self.num_samples), ("repeats", repeats)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise _error(f"{name} must be a whole number, 1 or more, got {value!r}")
        if self.length < 1:
            raise _error(f"the dataset must hold at least one sample, got {self.length}")
        self.num_samples, self.repeats = int(self.num_samples), int(repeats)
        self.num_replicas = comm.get_world_size() if num_replicas is None else num_replicas
        self.rank = comm.get_rank() if rank is None else rank
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise _error(
                f"rank {self.rank} is outside 0..{self.num_replicas - 1} for "
                f"num_replicas={self.num_replicas}; pass the rank and world size of this job"
            )
        self.seed, self.drop_last, self.epoch = int(seed), drop_last, 0

    @property
    def total(self) -> int:
        """Draws in an epoch over all ranks, repeats included, before dropping or padding."""
        return self.num_samples * self.repeats

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration draw epoch ``epoch``'s order."""
        self.epoch = epoch

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample indices over all ranks (int64, ``total`` of them), unpadded."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        if self.weights is not None:
            drawn = torch.multinomial(
                self.weights, self.num_samples, replacement=True, generator=generator
            )
        else:
            passes = math.ceil(self.num_samples / self.length)
            drawn = torch.cat(
                [torch.randperm(self.length, generator=generator) for _ in range(passes)]
            )[: self.num_samples]
        return drawn.repeat_interleave(self.repeats) if self.repeats > 1 else drawn

    def __len__(self) -> int:
        if self.drop_last:
            return self.total // self.num_replicas
        return math.ceil(self.total / self.num_replicas)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order, world = self.order(self.epoch), self.num_replicas
        stop = len(self) * world
        positions = torch.arange(self.rank, stop, world)
        # Padding (drop_last=False) wraps around the order, as DistributedSampler does.
        indices = order[positions % self.total]
        return zip(indices.tolist(), positions.tolist(), strict=True)

    def __repr__(self) -> str:
        weighted = "weighted" if self.weights is not None else "shuffled"
        return (
            f"WeightedDistributedSampler({weighted}, {self.length} samples, "
            f"num_samples={self.num_samples}, repeats={self.repeats}, "
            f"rank {self.rank} of {self.num_replicas})"
        )


def _checked_weights(weights: Any) -> torch.Tensor:
    try:
        values = torch.as_tensor(np.asarray(weights, dtype=np.float64)).reshape(-1)
    except (TypeError, ValueError):
        raise _error(
            f"weights must be numbers, one per sample, got {type(weights).__name__}"
        ) from None
    bad = ~torch.isfinite(values) | (values < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise _error(f"weights must be finite and 0 or more; sample {i} has {float(values[i])}")
    if values.numel() == 0 or float(values.sum()) <= 0:
        raise _error(
            f"weights must have a positive sum, got {values.numel()} weight(s) summing to "
            f"{float(values.sum()) if values.numel() else 0.0}; give some sample a weight above 0"
        )
    return (values / values.sum()).to(torch.float32)
