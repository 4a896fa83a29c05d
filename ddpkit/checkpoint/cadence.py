"""When a run saves: every so many optimizer steps, every so many minutes, each epoch's end.

The whole cadence is here. :class:`SaveCadence` is the rule (what the user
asked), :class:`SaveClock` applies it to a run: the time since the last save
of any kind (the ``CheckpointManager`` restarts it at each save) and the
decision after each optimizer step. The step count is the same on every rank,
so each decides ``every_steps`` alone; ``every_minutes`` is read on rank 0's
clock and agreed by :class:`ddpkit.distributed.stops.StepControl`, which only
agrees. An epoch's end always saves its own checkpoint, so no step
checkpoint follows an epoch's last batch; a stop saves ``interrupted.pth``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ddpkit._numbers import positive_seconds

__all__ = ["SaveCadence", "SaveClock"]


@dataclass(frozen=True, kw_only=True)
class SaveCadence:
    """When to take a step checkpoint between two optimizer steps; both None: never.

    Raises:
        ValueError: a count below 1 or minutes not above 0; the message names it.
    """

    every_steps: int | None = None
    """Save after every this many optimizer steps, counted over the whole run."""

    every_minutes: float | None = None
    """Save when this many minutes passed since the last save (rank 0's clock)."""

    def __post_init__(self) -> None:
        steps = self.every_steps
        if steps is not None and (type(steps) is not int or steps < 1):
            raise ValueError(f"every_steps must be at least 1, got {steps!r}")
        if self.every_minutes is not None:
            minutes = positive_seconds(self.every_minutes)
            if minutes is None:
                raise ValueError(f"every_minutes must be > 0 or None, got {self.every_minutes!r}")
            object.__setattr__(self, "every_minutes", minutes)

    def step_due(self, step: int) -> bool:
        """Whether ``every_steps`` asks for a save after optimizer step ``step`` (1, 2, ...)."""
        return self.every_steps is not None and step > 0 and step % self.every_steps == 0

    def time_due(self, seconds_since_save: float) -> bool:
        """Whether ``every_minutes`` asks for a save, this long after the last one."""
        return self.every_minutes is not None and seconds_since_save >= self.every_minutes * 60.0


class SaveClock:
    """A run's cadence and the clock of its last save: whether a step checkpoint falls now.

    Attributes:
        cadence: the rule.
    """

    def __init__(self, cadence: SaveCadence) -> None:
        self.cadence = cadence
        self._last = time.monotonic()

    def restart(self) -> None:
        """A save of any kind was taken: ``every_minutes`` counts from now."""
        self._last = time.monotonic()

    def due(self, step: int, *, timed: bool) -> tuple[bool, bool]:
        """After optimizer step ``step``: (``every_steps`` says save, ``every_minutes`` says save).

        ``timed``: read this rank's clock (rank 0's is the one the ranks agree on); else False.
        """
        late = timed and self.cadence.time_due(time.monotonic() - self._last)
        return self.cadence.step_due(step), late

    @staticmethod
    def step_checkpoint(agreed: bool, last: bool) -> bool:
        """Whether an agreed save after a step is written: not after an epoch's last batch.

        The epoch's own checkpoint follows that batch, always.
        """
        return agreed and not last
