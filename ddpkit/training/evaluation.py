"""``evaluate()``: exact top-1 / top-5 and loss over all ranks, and the batch helpers of ``fit``.

Each rank sums per-sample losses and correct predictions over its share and
the sums are all-reduced once, so the numbers do not depend on how the data
was split into batches or ranks.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from ddpkit.data.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize_batch
from ddpkit.distributed.devices import module_device
from ddpkit.distributed.parallel import sync_buffers, unwrap_model
from ddpkit.training.metrics import ClassificationTotals

__all__ = ["Amp", "Criterion", "Normalize", "autocast", "evaluate", "per_sample", "to_device"]

Amp = Literal["bf16", "fp16"]
Normalize = tuple[Sequence[float], Sequence[float]]
Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    normalize: Normalize | None = (IMAGENET_MEAN, IMAGENET_STD),
    amp: Amp | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Top-1 / top-5 accuracy, mean loss, per-class figures and speed over the whole dataset.

    Exact whatever the world size: each rank sums per-sample losses and
    correct predictions over its share (use an unpadded sampler such as
    ``build_loader(train=False)``'s, so every sample counts once), and the
    sums are all-reduced at the end. The forward pass runs on the
    unwrapped model, so ranks with different numbers of batches never wait
    on each other. First every rank takes rank 0's buffers
    (:func:`ddpkit.distributed.parallel.sync_buffers`): without SyncBN each rank's
    BatchNorm statistics drift apart in training, and the figures are those
    of rank 0's model, the one checkpoints save. All ranks must call it, or
    it deadlocks.

    Returns:
        ``acc1`` and ``acc5`` in percent, ``loss`` (mean per sample; nan
        without ``criterion``), ``samples``, ``images_per_sec`` (all ranks);
        per class (lists indexed by class, in percent, None where a class has
        no samples or no predictions): ``recall`` (the class's accuracy) and
        ``precision``; ``confusion`` (``confusion[t][p]``: samples of class
        ``t`` predicted as ``p``; up to 1000 classes); ``worst_class`` and
        ``worst_recall``, the class with the lowest recall.

    Example:
        >>> metrics = evaluate(model, val_loader, criterion=nn.CrossEntropyLoss())
    """
    net = unwrap_model(model)
    sync_buffers(net)
    dev = torch.device(device) if device is not None else module_device(net)
    losses = per_sample(criterion) if criterion is not None else None
    was_training = net.training
    net.eval()
    totals = ClassificationTotals(dev)
    start = time.perf_counter()
    try:
        for images, targets in loader:
            images, targets = to_device(images, targets, dev, normalize)
            with autocast(dev, amp):
                logits = net(images)
            # float64: a sample's loss then does not depend on how the data was
            # split into batches or ranks, so the total is the same on any world size.
            loss_sum = (
                _loss_sum(losses, logits.double(), targets)
                if losses is not None
                else torch.tensor(float("nan"), device=dev)
            )
            totals.update(logits, targets, loss_sum)
    finally:
        net.train(was_training)
    metrics: dict[str, Any] = dict(totals.reduce())
    metrics["images_per_sec"] = metrics["samples"] / max(time.perf_counter() - start, 1e-9)
    return metrics


def to_device(
    images: Any, targets: torch.Tensor, device: torch.device, normalize: Normalize | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch on ``device``; uint8 images normalised there.

    An :class:`~ddpkit.data.gpu_decode.EncodedBatch` (``decode="cuda"``) is
    decoded on ``device`` here, a batch at a time.
    """
    images = images.to(device, non_blocking=True)  # an EncodedBatch decodes there
    targets = targets.to(device, non_blocking=True)
    if normalize is not None and images.dtype == torch.uint8:
        images = normalize_batch(images, *normalize)
    return images, targets


def per_sample(criterion: Criterion) -> Criterion:
    """``criterion`` returning one loss per sample: a copy with ``reduction="none"``.

    The caller's criterion is not touched: a shallow copy shares its weights
    and buffers but has its own ``reduction``.
    """
    reduction = getattr(criterion, "reduction", None)
    if not isinstance(reduction, str) or reduction == "none":
        return criterion
    per_sample = copy.copy(criterion)
    per_sample.reduction = "none"  # type: ignore[attr-defined]
    return per_sample


def _loss_sum(criterion: Criterion, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum of per-sample losses: exact over any split of the data into batches."""
    losses = criterion(logits, targets).double()
    if losses.dim() == 0:  # a criterion without per-sample losses: its mean times the count
        return losses * targets.shape[0]
    return losses.sum()


def autocast(device: torch.device, amp: Amp | None) -> contextlib.AbstractContextManager[Any]:
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES[amp])
