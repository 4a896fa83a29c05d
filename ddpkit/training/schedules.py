"""Learning-rate schedules stepped per optimizer step: linear warm-up, then cosine or step decay.

Composed from ``torch.optim.lr_scheduler`` (``LinearLR``, ``CosineAnnealingLR``,
``MultiStepLR``, ``SequentialLR``): what this module adds is the arithmetic
from epochs to steps and the linear scaling rule, checked once, so that a
checkpoint holds an ordinary ``SequentialLR`` state that resumes exactly.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, MultiStepLR, SequentialLR

__all__ = ["WarmupSchedule", "linear_scaled_lr", "warmup_schedule"]

Decay = Literal["cosine", "step"]


class WarmupSchedule(SequentialLR):
    """A ``SequentialLR`` that :func:`ddpkit.fit` steps after every optimizer step.

    Made by :func:`warmup_schedule`; its ``state_dict`` is ``SequentialLR``'s.
    Loading one restores where the schedule stands (the steps taken, the
    current rates) and keeps the shape it was built with now, so a run resumed
    with more epochs stretches its decay to the new end instead of following
    the old one (a cosine past its end would rise again). A state saved with
    another number of steps per epoch (another number of ranks, or batch)
    counts its steps in other units: the schedule is then placed at the same
    point of training in epochs, as a fresh run would be there.
    """

    per_step = True
    _SHAPE = (
        "T_max",
        "eta_min",
        "milestones",
        "gamma",
        "total_iters",
        "start_factor",
        "end_factor",
    )

    steps_per_epoch = 0  # set by warmup_schedule; saved in the state with the counters
    total_steps = 0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("_schedulers", [])
        kinds = [type(s).__name__ for s in self._schedulers]
        if len(saved) != len(self._schedulers):
            raise ValueError(
                f"the saved schedule has {len(saved)} phase(s) and this one {len(kinds)} "
                f"({' then '.join(kinds)}): a warm-up was added or removed; resume with the "
                "warm-up the run started with"
            )
        per_epoch = state_dict.get("steps_per_epoch") or self.steps_per_epoch
        if per_epoch != self.steps_per_epoch:
            self._place(state_dict["last_epoch"] / per_epoch)
            return
        shapes = [
            {k: s.__dict__[k] for k in self._SHAPE if k in s.__dict__} for s in self._schedulers
        ]
        kept = (self._milestones, self.steps_per_epoch, self.total_steps)
        super().load_state_dict(state_dict)
        self._milestones, self.steps_per_epoch, self.total_steps = kept
        for scheduler, shape in zip(self._schedulers, shapes, strict=True):
            scheduler.__dict__.update(shape)

    def _place(self, epochs_done: float) -> None:
        """Step this fresh schedule to where ``epochs_done`` epochs of training end."""
        if self.last_epoch != 0:
            raise ValueError(
                "a schedule saved with other steps per epoch loads only into a new one"
            )
        with warnings.catch_warnings():  # no optimizer step comes between these
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(min(round(epochs_done * self.steps_per_epoch), self.total_steps)):
                self.step()


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int,
    steps_per_epoch: int,
    warmup_epochs: float = 0.0,
    decay: Decay = "cosine",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    min_lr: float = 0.0,
    warmup_start: float = 0.01,
) -> WarmupSchedule:
    """Linear warm-up for ``warmup_epochs``, then cosine or step decay, one step per update.

    The learning rate starts at ``warmup_start`` times the optimizer's ``lr``
    and rises linearly to it over the warm-up steps (``LinearLR``); then
    either falls along a cosine to ``min_lr`` at the last step of ``epochs``
    (``CosineAnnealingLR``) or is multiplied by ``gamma`` at the start of
    each epoch in ``milestones`` (``MultiStepLR``, epochs counted from 0 as
    ``MultiStepLR``'s are). ``fit`` steps it after every optimizer step.

    Args:
        optimizer: whose ``lr`` (per parameter group) is the peak.
        epochs: the length of training, in epochs.
        steps_per_epoch: optimizer steps per epoch: ``len(train_loader)``,
            or ``ceil(len(train_loader) / grad_accum)`` with accumulation.
        warmup_epochs: length of the warm-up, in epochs (fractions allowed); 0: none.
        decay: ``"cosine"`` or ``"step"``.
        milestones: for ``"step"``: the epochs at whose start the rate drops
            (one at or past ``epochs`` never comes, as with ``MultiStepLR``).
        gamma: for ``"step"``: the factor of each drop.
        min_lr: for ``"cosine"``: the rate at the end.
        warmup_start: the first step's fraction of the peak rate, in (0, 1].

    Raises:
        ValueError: a count or rate out of range, milestones for cosine decay,
            or milestones inside the warm-up; the message names the value.

    Example:
        >>> scheduler = warmup_schedule(optimizer, epochs=90, steps_per_epoch=len(train_loader),
        ...                             warmup_epochs=5, decay="cosine")
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int):
        raise ValueError(f"steps_per_epoch must be an integer >= 1, got {steps_per_epoch!r}")
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch} (an empty loader?)")
    if not (math.isfinite(warmup_epochs) and 0 <= warmup_epochs < epochs):
        raise ValueError(f"warmup_epochs must lie in [0, epochs={epochs}), got {warmup_epochs}")
    if decay not in ("cosine", "step"):
        raise ValueError(f"decay must be 'cosine' or 'step', got {decay!r}")
    if not 0 < warmup_start <= 1:
        raise ValueError(f"warmup_start must lie in (0, 1], got {warmup_start}")
    if not (math.isfinite(min_lr) and min_lr >= 0):
        raise ValueError(f"min_lr must be a number >= 0, got {min_lr}")
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must lie in (0, 1], got {gamma}")
    total = epochs * steps_per_epoch
    warmup = round(warmup_epochs * steps_per_epoch)
    if total - warmup < 1:
        raise ValueError(
            f"warmup_epochs={warmup_epochs} leaves no step of the {epochs} epochs x "
            f"{steps_per_epoch} steps after the warm-up"
        )
    main: CosineAnnealingLR | MultiStepLR
    if decay == "cosine":
        if milestones:
            raise ValueError("milestones apply to decay='step'; cosine decay has none")
        main = CosineAnnealingLR(optimizer, T_max=total - warmup, eta_min=min_lr)
    else:
        bad = [m for m in milestones if isinstance(m, bool) or not (isinstance(m, int) and m > 0)]
        if bad:
            raise ValueError(f"milestones must be epochs >= 1, got {bad}")
        early = [m for m in milestones if m * steps_per_epoch <= warmup]
        if early:
            raise ValueError(
                f"milestones {early} fall inside the warm-up of {warmup_epochs} epochs; "
                "the rate would drop before it peaks"
            )
        # MultiStepLR counts its own steps, from the end of the warm-up.
        at = sorted(m * steps_per_epoch - warmup for m in milestones)
        main = MultiStepLR(optimizer, milestones=at, gamma=gamma)
    if warmup == 0:
        schedule = WarmupSchedule(optimizer, [main], milestones=[])
    else:
        ramp = LinearLR(optimizer, start_factor=warmup_start, end_factor=1.0, total_iters=warmup)
        schedule = WarmupSchedule(optimizer, [ramp, main], milestones=[warmup])
    schedule.steps_per_epoch, schedule.total_steps = steps_per_epoch, total
    return schedule


def linear_scaled_lr(lr_base: float, global_batch_size: int, reference: int = 256) -> float:
    """The linear scaling rule (Goyal et al., 2017): ``lr_base`` per ``reference`` images.

    Example:
        >>> linear_scaled_lr(0.1, 1024)  # 0.1 per 256 images, 1024 per step
        0.4
    """
    if not (math.isfinite(lr_base) and lr_base > 0):
        raise ValueError(f"lr_base must be a positive number, got {lr_base}")
    if global_batch_size < 1 or reference < 1:
        raise ValueError(
            f"global_batch_size and reference must be >= 1, got {global_batch_size}, {reference}"
        )
    return lr_base * global_batch_size / reference
