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

A loop of your own takes ``fit``'s very step, and every guarantee, from
:class:`StepGuard` (``guard``), which ``fit`` is built on::

    with StepGuard(manager, config=TrainConfig(amp="bf16", grad_accum=2)) as guard:
        for epoch in range(guard.resume(train_loader), epochs):
            part = guard.batches(train_loader, epoch)
            for images, targets in part:
                with guard.forward(part):  # autocast, no_sync in a window
                    loss = criterion(model(images), targets)
                guard.backward(loss, part)  # the optimizer step; save or stop
            guard.end_epoch(epoch, metrics=...)

This package may import every other part of ddpkit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit._lazy import lazy_names

if TYPE_CHECKING:  # the public names, each listed once (ddpkit._lazy)
    from ddpkit.training.config import FaultConfig as FaultConfig
    from ddpkit.training.config import ReportConfig as ReportConfig
    from ddpkit.training.config import TrainConfig as TrainConfig
    from ddpkit.training.config import parse_trackers as parse_trackers
    from ddpkit.training.ema import model_ema as model_ema
    from ddpkit.training.epoch import TrainingError as TrainingError
    from ddpkit.training.evaluation import evaluate as evaluate
    from ddpkit.training.guard import StepGuard as StepGuard
    from ddpkit.training.loop import History as History
    from ddpkit.training.loop import fit as fit
    from ddpkit.training.losses import FocalLoss as FocalLoss
    from ddpkit.training.models import PretrainedReport as PretrainedReport
    from ddpkit.training.models import freeze_backbone as freeze_backbone
    from ddpkit.training.models import load_pretrained as load_pretrained
    from ddpkit.training.schedules import linear_scaled_lr as linear_scaled_lr
    from ddpkit.training.schedules import warmup_schedule as warmup_schedule
    from ddpkit.training.trackers import TrackerError as TrackerError
    from ddpkit.training.trackers import missing_extra as missing_extra

if not TYPE_CHECKING:  # see ddpkit._lazy: mypy must not see an __all__ it cannot read
    __getattr__, __dir__, __all__ = lazy_names(__name__, __file__)
