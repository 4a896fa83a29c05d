"""Model EMA: ``torch.optim.swa_utils.AveragedModel`` with an exponential average, kept in step.

:func:`model_ema` builds the average of a (DDP-wrapped, compiled) model's
weights and buffers; :func:`ddpkit.fit` updates it after every optimizer step,
evaluates it beside the model, checkpoints it and restores it.
:func:`sync_ema_buffers` gives every rank rank 0's averaged BatchNorm
statistics, as DDP does for the model's own before each forward, so the
average evaluated and saved is the same on every rank and after a resume.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ddpkit.distributed.parallel import sync_buffers, unwrap_model

__all__ = ["model_ema", "sync_ema_buffers"]


def model_ema(model: nn.Module, decay: float = 0.9998) -> AveragedModel:
    """An exponential moving average of ``model``'s parameters and buffers.

    ``ema = decay * ema + (1 - decay) * weights`` after each optimizer step
    (``update_parameters``); the first update copies the weights. Built on the
    unwrapped model (no DDP, no ``torch.compile``), on the model's device.
    Pass it to ``fit(..., ema=...)``; ``ema.module`` is the averaged network.

    Args:
        model: the model being trained (wrapped or not).
        decay: the weight of the past, in (0, 1); 0.9998 averages over about
            5,000 steps (``1 / (1 - decay)``).

    Raises:
        ValueError: ``decay`` outside (0, 1).

    Example:
        >>> ema = ddpkit.model_ema(model, decay=0.9998)
        >>> history = ddpkit.fit(model, train_loader, optimizer, criterion=criterion,
        ...                      epochs=90, val_loader=val_loader, ema=ema)
    """
    if isinstance(decay, bool) or not (math.isfinite(decay) and 0 < decay < 1):
        raise ValueError(f"decay must lie in (0, 1), got {decay!r}")
    net = unwrap_model(model)
    average = get_ema_multi_avg_fn(decay)  # type: ignore[no-untyped-call]
    return AveragedModel(net, multi_avg_fn=average, use_buffers=True)


@torch.no_grad()
def sync_ema_buffers(ema: AveragedModel) -> None:
    """Give every rank rank 0's averaged buffers (BatchNorm statistics). A collective.

    The parameters are the same everywhere (DDP keeps the model's equal), but
    each rank averages the BatchNorm statistics its own batches left. Without a
    process group (or with one rank) nothing happens.
    """
    sync_buffers(ema.module)
