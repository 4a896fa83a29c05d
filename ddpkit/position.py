"""Where training stands: the epoch, the batches and samples of it consumed, the optimizer steps.

A step checkpoint stores a :class:`Position`; with the per-sample seeds of
``(seed, epoch, index)`` that is all an exact continuation needs to know about
the data: the next batch is the one after ``batches`` of this epoch's order,
provided the data are the same: a step checkpoint also records the training
set's size and a digest of its index, which the resume compares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Position"]


@dataclass(frozen=True)
class Position:
    """A point in a training run, between two optimizer steps.

    Attributes:
        epoch: the epoch in progress (or about to start when ``batches`` is 0).
        batches: batches of ``epoch`` each rank has consumed.
        samples: samples of ``epoch``'s order consumed over all ranks; the
            rest of the epoch starts there, on any number of ranks.
        step: optimizer steps taken since the run began, over all epochs.
        world_size: how many ranks were training when the position was taken.
        data_size: samples in the training set then; None: not recorded.
        data_digest: a digest of the training set's index (its labels and
            classes, or ``targets``); None: not recorded or not cheap to take.
        data_seed: the seed of the training sampler's order (another seed
            deals the rest of the epoch out otherwise); None: not recorded.
        data_sizes: each rank's ``data_size`` where they differ (a stream
            split by rank has a length of its own on each); None: the same
            on every rank, or not recorded.
    """

    epoch: int = 0
    batches: int = 0
    samples: int = 0
    step: int = 0
    world_size: int = 1
    data_size: int | None = None
    data_digest: str | None = None
    data_seed: int | None = None
    data_sizes: tuple[int, ...] | None = None

    @property
    def mid_epoch(self) -> bool:
        """Part of ``epoch`` is done and part is not."""
        return self.batches > 0 or self.samples > 0

    def as_dict(self) -> dict[str, Any]:
        """The fields as a checkpoint stores them (the data's only when recorded)."""
        stored: dict[str, Any] = {k: int(getattr(self, k)) for k in _COUNTS}
        if self.data_size is not None:
            stored["data_size"] = int(self.data_size)
        if self.data_digest is not None:
            stored["data_digest"] = str(self.data_digest)
        if self.data_seed is not None:
            stored["data_seed"] = int(self.data_seed)
        if self.data_sizes is not None:
            stored["data_sizes"] = [int(n) for n in self.data_sizes]
        return stored

    def rank_data_size(self, rank: int) -> int | None:
        """Rank ``rank``'s training-set size then: its own where the ranks' differ."""
        sizes = self.data_sizes
        return sizes[rank] if sizes is not None and 0 <= rank < len(sizes) else self.data_size

    @classmethod
    def from_dict(cls, data: Any) -> Position:
        """The position a checkpoint stored, checked field by field; unknown keys are ignored.

        Raises:
            ValueError: ``data`` is not a mapping, or a field is missing, not an
                int, out of range, or at odds with another; the message names
                the field and its value.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"the position is a {type(data).__name__}, not a dict of fields")
        fields: dict[str, Any] = {}
        for name, low in _COUNTS.items():
            if name not in data:
                raise ValueError(f"the position lacks its {name!r} field")
            fields[name] = _count(name, data[name], low)
        if data.get("data_size") is not None:
            fields["data_size"] = _count("data_size", data["data_size"], 0)
        if data.get("data_seed") is not None:
            fields["data_seed"] = _count("data_seed", data["data_seed"], 0)
        sizes = data.get("data_sizes")
        if sizes is not None:
            if not isinstance(sizes, list | tuple) or len(sizes) != fields["world_size"]:
                raise ValueError(
                    f"the position's data_sizes is {sizes!r}, not one size per rank of its "
                    f"world_size {fields['world_size']}"
                )
            fields["data_sizes"] = tuple(_count("data_sizes", n, 0) for n in sizes)
        digest = data.get("data_digest")
        if digest is not None:
            if not isinstance(digest, str) or not digest:
                raise ValueError(f"the position's data_digest is {digest!r}, not a digest string")
            fields["data_digest"] = digest
        if (fields["batches"] == 0) != (fields["samples"] == 0):
            raise ValueError(
                f"the position's batches={fields['batches']} and samples={fields['samples']} "
                "disagree: a batch consumes samples, and samples are consumed in batches"
            )
        return cls(**fields)


# The counting fields, each with its least value.
_COUNTS = {"epoch": 0, "batches": 0, "samples": 0, "step": 0, "world_size": 1}


def _count(name: str, value: Any, low: int) -> int:
    if type(value) is not int:  # bool, float, str: not what a save writes
        raise ValueError(f"the position's {name} is {value!r} ({type(value).__name__}), not an int")
    if value < low:
        raise ValueError(f"the position's {name} is {value}, below its least value {low}")
    return value
