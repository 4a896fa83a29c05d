"""Training: the ``fit`` loop and what it is made of.

:func:`fit` (``loop``) runs the epochs of a DDP model: each epoch
(``epoch``) from any position, mixed precision, gradient accumulation,
batch transforms, checkpoints through a ``ddpkit.checkpoint.CheckpointManager``,
a clean stop on a signal and the hang watchdog; then exact validation
(``evaluation``, ``metrics``), the schedule (``schedules``), the model's
average (``ema``), and one line, record and picture per epoch (``reporting``,
``plotting``). Its options are frozen dataclasses in ``config``
(``TrainConfig``, ``FaultConfig``, ``ReportConfig``)::

    from ddpkit.training import FocalLoss, TrainConfig, fit, warmup_schedule

    history = fit(model, train_loader, optimizer, criterion=FocalLoss(gamma=2),
                  epochs=90, val_loader=val_loader, config=TrainConfig(amp="bf16"))

``losses`` holds :class:`FocalLoss`; ``models`` loads pretrained weights into a
new head (:func:`load_pretrained`) and freezes a backbone.

This package may import every other part of ddpkit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_names

if TYPE_CHECKING:
    from ddpkit.training.config import FaultConfig, ReportConfig, TrainConfig
    from ddpkit.training.ema import model_ema
    from ddpkit.training.epoch import TrainingError
    from ddpkit.training.evaluation import evaluate
    from ddpkit.training.loop import History, fit
    from ddpkit.training.losses import FocalLoss
    from ddpkit.training.models import PretrainedReport, freeze_backbone, load_pretrained
    from ddpkit.training.schedules import linear_scaled_lr, warmup_schedule
    from ddpkit.training.trackers import TrackerError

__all__ = [
    "FaultConfig",
    "FocalLoss",
    "History",
    "PretrainedReport",
    "ReportConfig",
    "TrackerError",
    "TrainConfig",
    "TrainingError",
    "evaluate",
    "fit",
    "freeze_backbone",
    "linear_scaled_lr",
    "load_pretrained",
    "model_ema",
    "warmup_schedule",
]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "ddpkit.training.config": ("FaultConfig", "ReportConfig", "TrainConfig"),
        "ddpkit.training.ema": ("model_ema",),
        "ddpkit.training.epoch": ("TrainingError",),
        "ddpkit.training.evaluation": ("evaluate",),
        "ddpkit.training.loop": ("History", "fit"),
        "ddpkit.training.losses": ("FocalLoss",),
        "ddpkit.training.models": ("PretrainedReport", "freeze_backbone", "load_pretrained"),
        "ddpkit.training.schedules": ("linear_scaled_lr", "warmup_schedule"),
        "ddpkit.training.trackers": ("TrackerError",),
    },
)
