"""Mixup and CutMix on a batch, on its device: torchvision's ``v2.MixUp`` / ``v2.CutMix``.

``fit`` applies the transform to each normalised training batch before the
forward pass (``TrainConfig(batch_transform=mixup_cutmix(C))``); the targets
become probabilities over the ``C`` classes, which :class:`ddpkit.FocalLoss`
and ``cross_entropy`` accept. The draws come from torch's global generator,
whose state every checkpoint holds, so a resumed run mixes exactly as an
uninterrupted one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["BatchMix", "mixup_cutmix"]


class BatchMix:
    """``(images, class indices) -> (mixed images, class probabilities)`` for one batch."""

    def __init__(self, transform: Any, num_classes: int) -> None:
        self.transform = transform
        self.num_classes = num_classes

    def __call__(
        self, images: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if targets.is_floating_point():
            raise ValueError(
                "mixup/cutmix takes class indices (int64 targets), got probabilities: "
                "is the batch mixed twice?"
            )
        mixed, soft = self.transform(images, targets.long())
        return mixed, soft

    def __repr__(self) -> str:
        return f"BatchMix({self.transform!r})"


def mixup_cutmix(
    num_classes: int, *, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0
) -> BatchMix:
    """Mixup or CutMix, chosen at random per batch (timm's and torchvision's recipes).

    Each batch gets either ``v2.MixUp(alpha=mixup_alpha)`` or
    ``v2.CutMix(alpha=cutmix_alpha)`` with equal odds (``v2.RandomChoice``);
    an alpha of 0 leaves that one out.

    Args:
        num_classes: the number of classes the targets index.
        mixup_alpha: Beta(alpha, alpha) parameter of Mixup; 0: no Mixup.
        cutmix_alpha: Beta(alpha, alpha) parameter of CutMix; 0: no CutMix.

    Raises:
        ValueError: ``num_classes`` below 2, a negative alpha, or both 0.

    Example:
        >>> config = ddpkit.TrainConfig(batch_transform=ddpkit.mixup_cutmix(1000))
    """
    from torchvision.transforms import v2

    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    for name, alpha in (("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)):
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {alpha}")
    chosen: list[Any] = []
    if mixup_alpha > 0:
        chosen.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        chosen.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    if not chosen:
        raise ValueError("mixup_alpha and cutmix_alpha are both 0: nothing would be mixed")
    transform = chosen[0] if len(chosen) == 1 else v2.RandomChoice(chosen)
    return BatchMix(transform, num_classes)
