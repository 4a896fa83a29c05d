"""``FocalLoss``: multi-class softmax focal loss that is ``cross_entropy`` at ``gamma=0``.

Targets are class indices or, as Mixup and CutMix make them, probabilities
over the classes; either way ``gamma=0`` gives ``cross_entropy``'s value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

__all__ = ["FocalLoss"]

# Floor for (1 - p) when 0 < gamma < 1: the derivative of (1 - p)**gamma is
# infinite at p = 1, which turns a perfectly confident logit into NaN gradients.
# Past the floor the factor stays (1e-6)**gamma, a loss change below 1e-6 * (1e-6)**gamma.
_MIN_ONE_MINUS_P = 1e-6

_Reduction = Literal["mean", "sum", "none"]


class FocalLoss(nn.Module):
    """Softmax focal loss (Lin et al., 2017) with label smoothing, class weights and ignore_index.

    For logits with ``C`` classes, ``p = softmax(logits)`` and the smoothed target
    ``q = (1 - smooth) * onehot(y) + smooth / C``, each sample's loss is
    ``-sum_c w_c * q_c * (1 - p_c)**gamma * log(p_c)``, computed from
    ``log_softmax`` in at least float32 (fp16/bf16 logits give a float32 loss).
    With ``gamma=0`` it equals ``F.cross_entropy(logits, y, weight=w,
    label_smoothing=smooth, ignore_index=..., reduction=...)``, times ``alpha``
    when ``alpha`` is a number.

    The target may also hold probabilities, shaped like the logits (Mixup /
    CutMix targets, ``ddpkit.mixup_cutmix``): then ``q = (1 - smooth) *
    target + smooth / C`` and, as ``cross_entropy`` does with probability
    targets, ``"mean"`` divides by the number of samples and
    ``ignore_index`` does not apply.

    Args:
        num_class: number of classes; when given, checked against ``logits.shape[1]``.
        alpha: None: every class weighs 1. A number ``a > 0``: the loss is
            multiplied by ``a`` (the paper's alpha) and ``"mean"`` divides by
            the number of non-ignored samples. ``C`` non-negative numbers
            (sequence or tensor): per-class weights ``w_c``, and ``"mean"``
            divides by the sum of the targets' weights, as ``cross_entropy``
            does. The weights are a non-persistent buffer: they follow
            ``.to()`` but stay out of ``state_dict``.
        gamma: focusing exponent, at least 0. For ``0 < gamma < 1``, ``1 - p``
            is floored at 1e-6 so that gradients stay finite at ``p = 1``.
        smooth: label smoothing in ``[0, 1)``, as ``cross_entropy``'s ``label_smoothing``.
        ignore_index: target value that contributes nothing (0 under ``"none"``).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (the target's shape).
        num_classes: alias of ``num_class``.

    Raises:
        ValueError: a parameter out of range, or ``num_class`` and
            ``num_classes`` that disagree.

    Example:
        >>> criterion = FocalLoss(alpha=0.25, gamma=2, num_class=1000, smooth=0.1)
        >>> loss = criterion(model(images), labels)  # logits (N, C), labels (N,) int64
    """

    weight: torch.Tensor | None

    def __init__(
        self,
        num_class: int | None = None,
        alpha: float | Sequence[float] | torch.Tensor | None = None,
        gamma: float = 2.0,
        smooth: float = 0.0,
        ignore_index: int = -100,
        reduction: _Reduction = "mean",
        *,
        num_classes: int | None = None,
    ) -> None:
        super().__init__()
        if num_classes is not None:
            if num_class is not None and num_class != num_classes:
                raise ValueError(
                    f"num_class={num_class} and num_classes={num_classes} disagree; "
                    "they are the same setting, pass one of them"
                )
            num_class = num_classes
        if num_class is not None and num_class < 1:
            raise ValueError(f"num_class must be at least 1, got {num_class}")
        if not (math.isfinite(gamma) and gamma >= 0):
            raise ValueError(f"gamma must be a finite number >= 0, got {gamma}")
        if not 0.0 <= smooth < 1.0:
            raise ValueError(f"smooth must be in [0, 1) like label_smoothing, got {smooth}")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.num_class = num_class
        self.gamma = float(gamma)
        self.smooth = float(smooth)
        self.ignore_index = int(ignore_index)
        self.reduction: _Reduction = reduction
        self.alpha: float | None = None  # alpha as a number; per-class weights live in .weight
        weight: torch.Tensor | None = None
        if isinstance(alpha, bool):
            raise TypeError("alpha must be None, a number or a sequence of per-class weights")
        if isinstance(alpha, int | float) or (isinstance(alpha, torch.Tensor) and alpha.ndim == 0):
            self.alpha = float(alpha)
            if not (math.isfinite(self.alpha) and self.alpha > 0):
                raise ValueError(f"alpha as a number scales the loss and must be > 0, got {alpha}")
        elif alpha is not None:
            weight = torch.as_tensor(alpha, dtype=torch.float32).detach().clone()
            if weight.ndim != 1 or not torch.isfinite(weight).all() or (weight < 0).any():
                raise ValueError(
                    f"alpha as per-class weights must be C finite numbers >= 0, got {alpha}"
                )
            if num_class is not None and weight.numel() != num_class:
                raise ValueError(f"alpha has {weight.numel()} weights but num_class={num_class}")
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Return the loss for ``logits`` (N, C) or (N, C, d1, ...) and class indices (N, d1, ...).

        Raises:
            ValueError: shapes that do not fit, a class count different from
                ``num_class`` or from the number of weights, or a target
                outside ``[0, C)`` that is not ``ignore_index``.
        """
        if logits.ndim < 2:
            raise ValueError(f"logits must be (N, C) or (N, C, d1, ...), got {tuple(logits.shape)}")
        n_cls = logits.shape[1]
        if self.num_class is not None and n_cls != self.num_class:
            raise ValueError(
                f"logits have {n_cls} classes (shape {tuple(logits.shape)}) but "
                f"num_class={self.num_class}; fix the model's head or num_class"
            )
        if self.weight is not None and self.weight.numel() != n_cls:
            raise ValueError(f"alpha has {self.weight.numel()} weights but logits have {n_cls}")
        probabilities = target.is_floating_point() and target.ndim == logits.ndim
        shape = self._target_shape(logits, target, probabilities)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        log_p = logits.to(dtype).log_softmax(1).movedim(1, -1).reshape(-1, n_cls)
        weight = None if self.weight is None else self.weight.to(log_p.device, dtype)
        denominator: torch.Tensor | int
        if probabilities:
            loss, denominator = self._probability_loss(log_p, target, weight)
        else:
            loss, denominator = self._index_loss(log_p, target, weight)
        if self.alpha is not None:
            loss = loss * self.alpha
        if self.reduction == "none":
            return loss.reshape(shape)
        if self.reduction == "sum":
            return loss.sum()
        # An all-ignored (or empty) batch gives 0 / 0 = nan, as cross_entropy does.
        return loss.sum() / denominator

    @staticmethod
    def _target_shape(
        logits: torch.Tensor, target: torch.Tensor, probabilities: bool
    ) -> tuple[int, ...]:
        """The per-sample shape (N, d1, ...) of the loss, after checking ``target``'s shape."""
        expected = (logits.shape[0], *logits.shape[2:])
        if probabilities:
            if target.shape != logits.shape:
                raise ValueError(
                    f"probability targets must have the logits' shape {tuple(logits.shape)}, "
                    f"got {tuple(target.shape)}"
                )
        elif tuple(target.shape) != expected or target.is_floating_point() or target.is_complex():
            raise ValueError(
                f"target must hold class indices of shape {expected} for logits of shape "
                f"{tuple(logits.shape)}, got {target.dtype} of shape {tuple(target.shape)}"
            )
        return expected

    def _index_loss(
        self, log_p: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample losses for class indices, and the mean's denominator (the weight kept)."""
        n_cls = log_p.shape[1]
        flat = target.reshape(-1).long()
        valid = flat != self.ignore_index
        self._check_targets(flat, valid, n_cls)
        index = flat.masked_fill(~valid, 0)
        # Only the target's probability is needed, unless smoothing spreads the target.
        loss = self._focal(log_p.gather(1, index[:, None]).squeeze(1))
        if weight is not None:
            loss = loss * weight[index]
        if self.smooth > 0:
            every_class = self._focal(log_p)
            if weight is not None:
                every_class = every_class * weight
            loss = (1 - self.smooth) * loss + (self.smooth / n_cls) * every_class.sum(1)
        loss = loss.masked_fill(~valid, 0.0)
        denominator = valid.sum() if weight is None else weight[index].masked_fill(~valid, 0).sum()
        return loss, denominator

    def _probability_loss(
        self, log_p: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]:
        """Per-sample losses for probability targets (Mixup, CutMix), and the sample count."""
        n_cls = log_p.shape[1]
        q = target.to(log_p.dtype).movedim(1, -1).reshape(-1, n_cls)
        if q.numel():
            # One host sync, as for class indices: probabilities, or a mistake worth naming.
            low, sums = torch.stack([q.min(), (q.sum(1) - 1).abs().max()]).tolist()
            # Targets stored in bf16 / fp16 sum to 1 only within their rounding.
            tolerance = max(1e-3, torch.finfo(target.dtype).eps * n_cls)
            if low < 0 or sums > tolerance:
                raise ValueError(
                    "probability targets must be >= 0 and sum to 1 over the classes, got a "
                    f"minimum of {low:.4g} and a row sum off by {sums:.4g}; pass class indices "
                    "(int64) or probabilities"
                )
        if self.smooth > 0:
            q = (1 - self.smooth) * q + self.smooth / n_cls
        per_class = q * self._focal(log_p)
        if weight is not None:
            per_class = per_class * weight
        loss = per_class.sum(1)
        # The mean is per sample, as cross_entropy's with probabilities.
        return loss, loss.numel()

    def _focal(self, log_p: torch.Tensor) -> torch.Tensor:
        """Return ``-(1 - p)**gamma * log(p)`` element-wise from ``log(p)``."""
        if self.gamma == 0:
            return -log_p
        # -expm1(log p) is 1 - p without the cancellation of 1 - exp(log p) near p = 1.
        floor = _MIN_ONE_MINUS_P if self.gamma < 1 else 0.0
        return -(-torch.expm1(log_p)).clamp(min=floor).pow(self.gamma) * log_p

    def _check_targets(self, flat: torch.Tensor, valid: torch.Tensor, n_cls: int) -> None:
        if flat.numel() == 0:
            return
        # One min/max pass (a single device sync); the bad values are only looked up on failure.
        low, high = torch.stack(torch.aminmax(flat.masked_fill(~valid, 0))).tolist()
        if low >= 0 and high < n_cls:
            return
        bad = torch.unique(flat[valid & ((flat < 0) | (flat >= n_cls))])[:8].tolist()
        raise ValueError(
            f"target values {bad} are outside the {n_cls} classes [0, {n_cls - 1}] and are not "
            f"ignore_index={self.ignore_index}; check the labels and the model's number of outputs"
        )

    def extra_repr(self) -> str:
        if self.weight is not None:
            alpha = f"[{', '.join(f'{w:g}' for w in self.weight.tolist())}]"
        else:
            alpha = f"{self.alpha:g}" if self.alpha is not None else "None"
        return (
            f"num_class={self.num_class}, alpha={alpha}, gamma={self.gamma:g}, "
            f"smooth={self.smooth:g}, ignore_index={self.ignore_index}, "
            f"reduction={self.reduction!r}"
        )
