"""How often a run takes a step checkpoint: every so many optimizer steps, or minutes.

:class:`SaveCadence` is the whole rule, and :class:`CheckpointManager` applies
it with its own clock (``manager.step_due(step)``, ``manager.time_due()``;
the clock restarts at each save of any kind).
:class:`ddpkit.distributed.stops.StepControl` asks the manager after each
optimizer step, so every rank saves after the same one: the step count is the
same on every rank, so each decides it alone; the minutes are read on rank
0's clock and agreed through the store. An epoch's end always saves, and a
stop (a signal) saves ``interrupted.pth``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit._numbers import positive_seconds

__all__ = ["SaveCadence"]


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
