"""Where training stands: the epoch, the batches and samples of it consumed, the optimizer steps.

A step checkpoint stores a :class:`Position`; with the per-sample seeds of
``(seed, epoch, index)`` that is all an exact continuation needs to know about
the data: the next batch is the one after ``batches`` of this epoch's order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
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
    """

    epoch: int = 0
    batches: int = 0
    samples: int = 0
    step: int = 0
    world_size: int = 1

    @property
    def mid_epoch(self) -> bool:
        """Part of ``epoch`` is done and part is not."""
        return self.batches > 0 or self.samples > 0

    def as_dict(self) -> dict[str, int]:
        """The fields as a dict of ints, as a checkpoint stores them."""
        return {k: int(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Any) -> Position:
        """The position a checkpoint stored; unknown keys are ignored."""
        fields = {k: int(data[k]) for k in ("epoch", "batches", "samples", "step", "world_size")
                  if k in data}  # fmt: skip
        return cls(**fields)
