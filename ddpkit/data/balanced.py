"""Class-balanced, weighted and repeated draws for training, distributed and exact on resume.

An epoch is one global order of draws, a function of ``(seed, epoch)`` only:
draws with replacement by per-sample weights (``torch.multinomial``, or an
inverse-CDF draw past its 2**24 samples) or a plain permutation, each draw
repeated ``repeats`` times in a row (repeated augmentation). Rank ``r`` of
``R`` takes positions ``r, r + R, ...`` of it, as ``DistributedSampler``
does, so every rank gets the same number of samples, consecutive copies of a
draw land on different ranks, and ``ddpkit.data.resume`` deals out the unseen
rest of an interrupted epoch on any number of ranks. Each draw's position in
the order is its ``draw`` number: the copies of one image get different
augmentations.
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
from ddpkit.data.samplers import SEED_RANGE, check_whole
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
    occurs (a shuffle with replacement). The labels are whole class indices,
    one per sample: ints, or floats that are whole numbers (``3.0``), 0 or
    more; any number of classes and any index value (sparse indices are
    counted without a table as long as the largest).

    Raises:
        ValueError: ``power`` outside 0..1; no labels; labels that are not one
            per sample (a 2-D array, a single number); a label that is not a
            whole number (``1.7``, NaN, a string, a bool) or is negative.
    """
    if isinstance(power, bool) or not isinstance(power, numbers.Real) or not 0 <= power <= 1:
        raise _error(
            f"power must be a number in 0..1 (0: as the data are, 0.5: square root, "
            f"1: class-balanced), got {power!r}"
        )
    labels = torch.from_numpy(_class_indices(targets))
    if int(labels.max()) <= 2 * labels.numel():  # a table of counts no larger than the labels
        counts, inverse = torch.bincount(labels), labels
    else:  # sparse indices (10**12): count without a table as long as the largest
        _, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    weights = counts.to(torch.float64)[inverse].pow(-float(power))
    return (weights / weights.sum()).to(torch.float32)


# Labels past this are not int64s; float labels past 2**53 are not exact integers either,
# but they are still whole numbers and counted as the classes they are.
_LABEL_LIMIT = 2**63
_RELABEL = "map the labels to 0, 1, 2, ... first (np.unique(targets, return_inverse=True)[1])"


def _class_indices(targets: Any) -> np.ndarray:
    """``targets`` as a 1-D int64 array of class indices, or a ValueError saying what is wrong."""
    array = _numbers(targets, "targets", "class index", _RELABEL)
    if array.dtype.kind == "f":
        whole = np.isfinite(array) & (np.floor(array) == array)
        if not whole.all():
            i = int(np.flatnonzero(~whole)[0])
            raise _error(
                f"targets must be whole class indices, and sample {i} has {_plain(array[i])!r}; "
                f"pass the class index of each sample, or {_RELABEL}"
            )
    if array.dtype.kind in "fi" and bool((array < 0).any()):
        i = int(np.flatnonzero(array < 0)[0])
        raise _error(
            f"targets must be class indices (0 or more), and sample {i} has {_plain(array[i])!r}; "
            f"{_RELABEL}"
        )
    if array.dtype.kind in "fu" and bool((array >= _LABEL_LIMIT).any()):
        i = int(np.flatnonzero(array >= _LABEL_LIMIT)[0])
        raise _error(
            f"targets must be class indices below 2**63, and sample {i} has {_plain(array[i])!r}; "
            f"{_RELABEL}"
        )
    return array.astype(np.int64, copy=False)


def _numbers(values: Any, name: str, each: str, fix: str) -> np.ndarray:
    """``values`` as a non-empty 1-D array of real numbers (ints or floats), or a ValueError.

    ``each`` names one element ("weight", "class index"); ``fix`` is the
    advice given for values that are not numbers.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dtype in (torch.bfloat16, torch.float16):
            values = values.float()  # NumPy has no bfloat16
        array: np.ndarray = values.numpy()
    else:
        try:
            array = np.asarray(values)
        except (TypeError, ValueError):  # ragged nested lists
            raise _error(
                f"{name} must be a 1-D sequence of numbers, one {each} per sample, got "
                f"{_shown(values)} that NumPy cannot make an array of; {fix}"
            ) from None
    if array.ndim == 0:
        raise _error(
            f"{name} must be 1-D, one {each} per sample, got the single value "
            f"{_shown(values)}; pass a sequence of one {each} per sample"
        )
    if array.ndim > 1:
        raise _error(
            f"{name} must be 1-D, one {each} per sample, got shape {array.shape}; pass one "
            f"{each} per sample, not a row each (of one-hot rows, their argmax)"
        )
    if array.size == 0:
        raise _error(f"{name} must hold one {each} per sample, got none")
    if array.dtype.kind == "b":
        raise _error(
            f"{name} must be numbers, one {each} per sample, got bools ({array[:3].tolist()}...); "
            f"convert them to numbers first if that is what you mean (e.g. .astype(int))"
        )
    if array.dtype.kind not in "iuf":
        raise _error(
            f"{name} must be numbers, one {each} per sample, got {array.dtype} values such as "
            f"{_shown(_plain(array[0]))}; {fix}"
        )
    return array


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python value it holds: messages then read ``0.5``."""
    return value.item() if isinstance(value, np.generic) else value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


# torch.multinomial draws from at most 2**24 categories; past that the sampler
# draws by inverse CDF (see WeightedDistributedSampler.order).
_MULTINOMIAL_LIMIT = 2**24
MAX_DRAWS = 2**31
"""The most draws an epoch holds, repeats included (its order is int64: 16 GiB)."""
_CHUNK = 2**16  # positions a rank turns into Python ints at a time


class WeightedDistributedSampler(Sampler[int]):
    """Draw an epoch by per-sample weights (or shuffle), repeat each draw, share it over ranks.

    The epoch's order over all ranks depends on ``(seed, epoch)`` only:
    ``num_samples`` draws with replacement by the weights (with
    ``weights=None``, permutations of the dataset, each sample once per
    pass), each repeated ``repeats`` times in a row. Rank ``r`` of ``R`` takes
    the positions ``r, r + R, ...`` (``drop_last``: the first
    ``len(order) // R`` each; otherwise the order wraps around to even them
    out), so every rank has the same number of batches, and with ``repeats
    <= R`` the copies of a draw are on different ranks. It yields sample
    indices, as every torch sampler does, so ``DataLoader(dataset,
    sampler=...)`` works; :meth:`draws` yields ``(index, position)``, whose
    position seeds each copy's augmentation (``build_loader`` uses it).

    Up to 2**24 samples the draws are ``torch.multinomial(weights,
    replacement=True)``; past that (more than ``torch.multinomial`` takes),
    by inverse CDF: ``torch.rand`` in float64 searched in the float64
    cumulative sum of the weights, the same distribution. Memory: 4 bytes a
    sample for the weights (and 8 more while an epoch is drawn past 2**24
    samples), 8 a draw for the order, rebuilt in :meth:`set_epoch`; at most
    :data:`MAX_DRAWS` (2**31) draws an epoch, repeats included.

    Args:
        weights: one finite weight, 0 or more, per sample (1-D; see
            :func:`class_weights`); only their ratios count, so any finite
            scale works (``[1e308, 1e308]`` is two equal weights). Or an int:
            the dataset's length, drawn without weights.
        num_samples: draws per epoch before repeats; default: the dataset's length.
        repeats: copies of each draw in the epoch (repeated augmentation).
        num_replicas: ranks; default: ``ddpkit.get_world_size()``.
        rank: this rank; default: ``ddpkit.get_rank()``.
        seed: the order's seed, the same on every rank, 0..2**63-1.
        drop_last: drop the tail that does not divide over the ranks.

    Raises:
        ValueError: weights that are not a 1-D sequence of numbers (bools and
            strings included), a weight that is negative or not finite,
            weights that sum to 0; ``num_samples`` or ``repeats`` that is not
            a whole number of 1 or more, or more than :data:`MAX_DRAWS` draws
            an epoch (a shuffle of more than that many samples too); a bad
            rank, world size or seed. All checked here, not at the first batch.
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
            if self.length < 1:
                raise _error(f"the dataset must hold at least one sample, got {self.length}")
        else:
            self.weights = _checked_weights(weights)
            self.length = len(self.weights)
        self.num_samples = self.length if num_samples is None else num_samples
        for name, value in (("num_samples", self.num_samples), ("repeats", repeats)):
            _check_whole(name, value, 1)
        self.num_samples, self.repeats = int(self.num_samples), int(repeats)
        _check_size(self.num_samples, self.repeats, self.length, self.weights is None)
        self.num_replicas = comm.get_world_size() if num_replicas is None else num_replicas
        self.rank = comm.get_rank() if rank is None else rank
        _check_whole("num_replicas", self.num_replicas, 1)
        _check_whole("rank", self.rank, 0)
        self.num_replicas, self.rank = int(self.num_replicas), int(self.rank)
        if not self.rank < self.num_replicas:
            raise _error(
                f"rank {self.rank} is outside 0..{self.num_replicas - 1} for "
                f"num_replicas={self.num_replicas}; pass the rank and world size of this job"
            )
        _check_whole("seed", seed, SEED_RANGE[0], SEED_RANGE[1])
        if not isinstance(drop_last, bool):
            raise _error(f"drop_last must be True or False, got {drop_last!r}")
        self.seed, self.drop_last, self.epoch = int(seed), drop_last, 0

    @property
    def total(self) -> int:
        """Draws in an epoch over all ranks, repeats included, before dropping or padding."""
        return self.num_samples * self.repeats

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration draw epoch ``epoch``'s order."""
        _check_epoch(self.seed, epoch)
        self.epoch = int(epoch)

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample indices over all ranks (int64, ``total`` of them), unpadded."""
        _check_epoch(self.seed, epoch)
        generator = torch.Generator().manual_seed(self.seed + int(epoch))
        if self.weights is None:
            drawn = torch.empty(self.num_samples, dtype=torch.int64)
            for begin in range(0, self.num_samples, self.length):
                part = torch.randperm(self.length, generator=generator)
                drawn[begin : begin + self.length] = part[: self.num_samples - begin]
        elif self.length <= _MULTINOMIAL_LIMIT:
            drawn = torch.multinomial(
                self.weights, self.num_samples, replacement=True, generator=generator
            )
        else:
            drawn = _inverse_cdf(self.weights, self.num_samples, generator)
        return drawn.repeat_interleave(self.repeats) if self.repeats > 1 else drawn

    def __len__(self) -> int:
        if self.drop_last:
            return self.total // self.num_replicas
        return math.ceil(self.total / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        """This rank's sample indices of the epoch set now, as any torch sampler yields them."""
        return (index for index, _ in self.draws())

    def draws(self) -> Iterator[tuple[int, int]]:
        """This rank's ``(index, position)`` pairs: the position seeds a copy's augmentation."""
        # The order is drawn now, for the epoch set now; it is dealt out lazily.
        return self._deal(self.order(self.epoch))

    def _deal(self, order: torch.Tensor) -> Iterator[tuple[int, int]]:
        world, stop = self.num_replicas, len(self) * self.num_replicas
        # A chunk at a time: Python ints for a whole share cost ~70 bytes a draw.
        for begin in range(self.rank, stop, _CHUNK * world):
            positions = torch.arange(begin, min(begin + _CHUNK * world, stop), world)
            # Padding (drop_last=False) wraps around the order, as DistributedSampler does.
            indices = order[positions % self.total]
            yield from zip(indices.tolist(), positions.tolist(), strict=True)

    def __repr__(self) -> str:
        weighted = "weighted" if self.weights is not None else "shuffled"
        return (
            f"WeightedDistributedSampler({weighted}, {self.length} samples, "
            f"num_samples={self.num_samples}, repeats={self.repeats}, "
            f"rank {self.rank} of {self.num_replicas})"
        )


def _inverse_cdf(weights: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` indices drawn with replacement with probabilities ``weights / weights.sum()``."""
    cdf = torch.cumsum(weights, 0, dtype=torch.float64)
    total = cdf[-1]
    # u in [0, total): the first index whose cumulative weight exceeds u is never
    # one of weight 0, and never past the end.
    below = torch.nextafter(total, torch.zeros((), dtype=torch.float64))
    u = torch.rand(count, dtype=torch.float64, generator=generator).mul_(total)
    return torch.searchsorted(cdf, u.clamp_(max=below), right=True)


def _check_whole(name: str, value: Any, low: int, high: int | None = None) -> None:
    try:
        check_whole(name, value, low, high)
    except ValueError as e:
        raise _error(str(e)) from None


def _check_epoch(seed: int, epoch: Any) -> None:
    _check_whole("epoch", epoch, 0, SEED_RANGE[1] - seed)


def _check_size(num_samples: int, repeats: int, length: int, shuffled: bool) -> None:
    total = num_samples * repeats
    if total > MAX_DRAWS:
        raise _error(
            f"num_samples x repeats = {num_samples} x {repeats} = {total} draws an epoch, "
            f"more than the 2**31 an epoch's order holds in memory (8 bytes a draw, 16 GiB); "
            f"draw fewer an epoch (num_samples) and train more epochs"
        )
    if shuffled and length > MAX_DRAWS:
        raise _error(
            f"a shuffle of {length} samples is more than the 2**31 a permutation holds in "
            f"memory (8 bytes a sample, 16 GiB); pass weights (one per sample) to draw "
            f"with replacement instead"
        )


def _checked_weights(weights: Any) -> torch.Tensor:
    fix = "pass one number per sample, or an int for a dataset drawn without weights"
    # astype copies: the caller's array is never changed by the in-place steps below.
    values = torch.from_numpy(_numbers(weights, "weights", "weight", fix).astype(np.float64))
    low, peak = (float(v) for v in torch.aminmax(values))  # NaN if any is NaN
    if not (low >= 0 and peak < math.inf):
        i = int((~torch.isfinite(values) | (values < 0)).nonzero()[0])
        raise _error(
            f"weights must be finite and 0 or more; sample {i} has {float(values[i])}: "
            f"give it a finite weight of 0 or more (0 leaves it out)"
        )
    if peak <= 0:
        raise _error(
            f"weights must have a positive sum, got {values.numel()} weight(s) summing to 0; "
            f"give some sample a weight above 0"
        )
    total = values.sum()
    if not bool(torch.isfinite(total)):
        # Only the ratios count: scaled by the largest, the sum is at most the count.
        values.div_(peak)
        total = values.sum()
    return values.div_(total).to(torch.float32)
