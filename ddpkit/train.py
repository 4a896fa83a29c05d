"""``fit()`` and ``evaluate()``: the minimal DDP training loop, as two plain functions.

``fit`` runs the epochs: ``set_epoch`` on the sampler, mixed precision,
gradient accumulation without needless all-reduces, uint8 batches normalised
on the device, exact validation, and a crash-safe checkpoint from rank 0
after every epoch. Everything else stays yours: the model, the data, the
optimiser and the schedule are arguments. How each step runs is a frozen
:class:`TrainConfig`; what is shown and written is ``ddpkit.reporting``'s.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ddpkit import comm
from ddpkit._docs import see
from ddpkit.checkpoint import CheckpointManager
from ddpkit.data.samplers import set_epoch
from ddpkit.data.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize_batch
from ddpkit.devices import module_device
from ddpkit.metrics import ClassificationTotals
from ddpkit.parallel import no_sync, unwrap_model
from ddpkit.reporting import ReportConfig, Reporter

__all__ = ["History", "ReportConfig", "TrainConfig", "TrainingError", "evaluate", "fit"]

logger = logging.getLogger("ddpkit")

Amp = Literal["bf16", "fp16"]
Normalize = tuple[Sequence[float], Sequence[float]]
Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# How often (in optimizer steps) rank 0 refreshes the progress bar; each
# refresh reads the running loss from the device, a host sync.
_REFRESH_STEPS = 20
# fit()'s keyword arguments before they moved into TrainConfig / ReportConfig.
_TRAIN_KEYS = ("amp", "grad_accum", "clip_grad_norm", "scheduler_per_step", "normalize", "device")
_REPORT_KEYS = ("progress", "log_dir")


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss); the message names the epoch and step."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How :func:`fit` runs each training step.

    Attributes:
        amp: ``"bf16"`` or ``"fp16"`` autocast; fp16 uses a GradScaler whose
            state is checkpointed. None: full precision.
        grad_accum: micro-batches per optimizer step, at least 1.
        clip_grad_norm: clip the total gradient norm to this value (> 0).
        scheduler_per_step: step the scheduler after each optimizer step
            instead of after each epoch.
        normalize: ``(mean, std)`` for uint8 batches, applied on the device;
            None leaves batches as they come.
        device: where batches go; default: the model's parameters' device.

    Raises:
        ValueError: a value out of range; the message names it.
    """

    amp: Amp | None = None
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    scheduler_per_step: bool = False
    normalize: Normalize | None = (IMAGENET_MEAN, IMAGENET_STD)
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        if self.amp is not None and self.amp not in _AMP_DTYPES:
            raise ValueError(f"amp must be 'bf16', 'fp16' or None, got {self.amp!r}")
        if isinstance(self.grad_accum, bool) or self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm}")
        if self.normalize is not None and len(self.normalize[0]) != len(self.normalize[1]):
            raise ValueError(
                f"normalize=(mean, std) needs as many means as stds, got {self.normalize}"
            )


@dataclass
class History:
    """What ``fit`` measured: one record (a dict) per epoch, in order."""

    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def last(self) -> dict[str, Any]:
        """The most recent epoch's record."""
        return self.records[-1]

    def best(self, key: str = "val_acc1") -> dict[str, Any]:
        """The record with the highest ``key``."""
        return max((r for r in self.records if key in r), key=lambda r: r[key])


def fit(
    model: nn.Module,
    train_loader: Iterable[Any],
    optimizer: torch.optim.Optimizer,
    *,
    criterion: Criterion,
    epochs: int,
    val_loader: Iterable[Any] | None = None,
    scheduler: Any = None,
    config: TrainConfig | None = None,
    checkpoints: CheckpointManager | None = None,
    resume: bool = False,
    report: ReportConfig | None = None,
    callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
    **deprecated: Any,
) -> History:
    """Train ``model`` for ``epochs`` epochs; every rank calls it with its own loaders.

    Each epoch: ``set_epoch`` on the loader's sampler; for each batch, move it
    to the device (uint8 images are normalised there), forward under
    ``torch.autocast`` when ``config.amp`` is set, scale the loss by ``1 /
    grad_accum`` and backward, inside ``no_sync`` except on the micro-step
    that completes an optimizer step; clip, step (through a GradScaler for
    fp16), zero the gradients. Then :func:`evaluate` on ``val_loader``, the
    scheduler step, one record in the :class:`History` (and, on rank 0, what
    ``report`` asks for), the callbacks, and ``checkpoints.save`` (a
    collective). Ctrl-C saves the interrupted weights and optimizer through
    ``checkpoints.save_interrupted``. Nothing passed in is changed beyond what
    training does (the model's weights and mode, the optimizer, the
    scheduler, the sampler's epoch).

    Args:
        model: the model, already on its device and wrapped (``wrap_ddp``).
        train_loader: batches of ``(images, targets)``.
        optimizer: the optimizer over ``model``'s parameters.
        criterion: ``criterion(logits, targets) -> loss`` (mean over the batch).
        epochs: train until this many epochs are done (counting resumed ones).
        val_loader: evaluated after each epoch; metrics are exact across ranks.
        scheduler: stepped after each epoch (or each optimizer step with
            ``config.scheduler_per_step``).
        config: how each step runs (:class:`TrainConfig`); default ``TrainConfig()``.
        checkpoints: where to save after each epoch (and resume from).
        resume: continue from ``checkpoints``' latest checkpoint.
        report: what rank 0 shows and writes (:class:`ReportConfig`); default
            ``ReportConfig()``: a progress bar, no files.
        callbacks: called with each epoch's record, on every rank.
        **deprecated: ``amp``, ``grad_accum``, ``clip_grad_norm``,
            ``scheduler_per_step``, ``normalize``, ``device`` (now in
            ``config``) and ``progress``, ``log_dir`` (now in ``report``),
            accepted with a ``DeprecationWarning`` until ddpkit 0.3.

    Returns:
        The :class:`History` of this run (resumed epochs are not repeated).

    Raises:
        TrainingError: a loss that is not finite (names the epoch and step).
        ValueError: ``epochs`` is negative, a config value is invalid, or
            ``resume`` without ``checkpoints``.
        TypeError: an unknown keyword argument.

    Example:
        >>> history = fit(model, train_loader, optimizer, criterion=FocalLoss(gamma=2),
        ...               epochs=90, val_loader=val_loader, scheduler=scheduler,
        ...               config=TrainConfig(amp="bf16"),
        ...               checkpoints=CheckpointManager("checkpoints"))
    """
    config, report = _configs(config, report, deprecated)
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if resume and checkpoints is None:
        raise ValueError("resume=True needs checkpoints=CheckpointManager(directory)")
    dev = torch.device(config.device) if config.device is not None else module_device(model)
    scaler = torch.amp.GradScaler(dev.type) if config.amp == "fp16" else None
    start = 0
    if resume and checkpoints is not None:
        start = checkpoints.resume(model, optimizer, scheduler, scaler)
        logger.info("resuming at epoch %d", start)
    step = _Step(model, optimizer, criterion, config, dev, scaler)
    reporter = Reporter(report, is_main=comm.is_main_process())
    history = History()
    epoch = start
    try:
        for epoch in range(start, epochs):
            record = _train_epoch(step, train_loader, epoch, epochs, scheduler, reporter)
            if val_loader is not None:
                val = evaluate(
                    model,
                    val_loader,
                    criterion=criterion,
                    normalize=config.normalize,
                    amp=config.amp,
                    device=dev,
                )
                record.update({f"val_{k}": v for k, v in val.items()})
            if scheduler is not None and not config.scheduler_per_step:
                scheduler.step()
            history.records.append(record)
            reporter.epoch(record)
            for callback in callbacks:
                callback(record)
            if checkpoints is not None:
                metrics = {"acc1": record.get("val_acc1", 0.0), "loss": record["train_loss"]}
                checkpoints.save(epoch, model, optimizer, scheduler, scaler, metrics=metrics)
    except KeyboardInterrupt:
        if checkpoints is not None:
            path = checkpoints.save_interrupted(epoch, model, optimizer)
            if path is not None:
                logger.warning(
                    "interrupted in epoch %d; weights and optimizer saved to %s", epoch, path
                )
        raise
    finally:
        reporter.close()
    return history


def _configs(
    config: TrainConfig | None, report: ReportConfig | None, deprecated: dict[str, Any]
) -> tuple[TrainConfig, ReportConfig]:
    """The two configs, with the former keyword arguments of ``fit`` folded in."""
    unknown = sorted(set(deprecated) - set(_TRAIN_KEYS) - set(_REPORT_KEYS))
    if unknown:
        raise TypeError(f"fit() got unexpected keyword argument(s) {unknown}")
    config, report = config or TrainConfig(), report or ReportConfig()
    if deprecated:
        warnings.warn(
            f"fit({', '.join(f'{k}=' for k in deprecated)}...): these options moved into "
            "fit(config=TrainConfig(...)) and fit(report=ReportConfig(...)); the keyword "
            "arguments will be removed in ddpkit 0.3",
            DeprecationWarning,
            stacklevel=3,
        )
        train = {k: v for k, v in deprecated.items() if k in _TRAIN_KEYS}
        shown = {k: v for k, v in deprecated.items() if k in _REPORT_KEYS}
        config = dataclasses.replace(config, **train)
        report = dataclasses.replace(report, **shown)
    return config, report


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    normalize: Normalize | None = (IMAGENET_MEAN, IMAGENET_STD),
    amp: Amp | None = None,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Top-1 / top-5 accuracy, mean loss, sample count and speed over the whole dataset.

    Exact whatever the world size: each rank sums per-sample losses and
    correct predictions over its share (use an unpadded sampler such as
    ``build_loader(train=False)``'s, so every sample counts once), and the
    sums are all-reduced once at the end. The forward pass runs on the
    unwrapped model, so ranks with different numbers of batches never wait
    on each other. All ranks must call it, or it deadlocks.

    Returns:
        ``acc1`` and ``acc5`` in percent, ``loss`` (mean per sample; nan
        without ``criterion``), ``samples``, and ``images_per_sec`` (all ranks).

    Example:
        >>> metrics = evaluate(model, val_loader, criterion=nn.CrossEntropyLoss())
    """
    net = unwrap_model(model)
    dev = torch.device(device) if device is not None else module_device(net)
    per_sample = _per_sample(criterion) if criterion is not None else None
    was_training = net.training
    net.eval()
    totals = ClassificationTotals(dev)
    start = time.perf_counter()
    try:
        for images, targets in loader:
            images, targets = _to_device(images, targets, dev, normalize)
            with _autocast(dev, amp):
                logits = net(images)
            # float64: a sample's loss then does not depend on how the data was
            # split into batches or ranks, so the total is the same on any world size.
            loss_sum = (
                _loss_sum(per_sample, logits.double(), targets)
                if per_sample is not None
                else torch.tensor(float("nan"), device=dev)
            )
            totals.update(logits, targets, loss_sum)
    finally:
        net.train(was_training)
    metrics: dict[str, float] = dict(totals.reduce())
    metrics["images_per_sec"] = metrics["samples"] / max(time.perf_counter() - start, 1e-9)
    return metrics


class _Step:
    """One micro-batch of training: forward, backward and, every ``grad_accum``, the update."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: Criterion,
        config: TrainConfig,
        device: torch.device,
        scaler: torch.amp.GradScaler | None,
    ) -> None:
        self.model, self.optimizer, self.criterion = model, optimizer, criterion
        self.config, self.device, self.scaler = config, device, scaler

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, update: bool) -> torch.Tensor:
        config = self.config
        # Only the micro-step that completes an update all-reduces gradients.
        with no_sync(self.model, enabled=not update), _autocast(self.device, config.amp):
            loss = self.criterion(self.model(images), targets)
        scaled = loss / config.grad_accum
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()  # type: ignore[no-untyped-call]
        else:
            scaled.backward()  # type: ignore[no-untyped-call]
        if update:
            if config.clip_grad_norm is not None:
                if self.scaler is not None:
                    self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), config.clip_grad_norm)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _train_epoch(
    step: _Step,
    loader: Iterable[Any],
    epoch: int,
    epochs: int,
    scheduler: Any,
    reporter: Reporter,
) -> dict[str, Any]:
    if isinstance(loader, torch.utils.data.DataLoader):
        set_epoch(loader, epoch)  # reshuffles, and seeds this epoch's augmentations
    step.model.train()
    config, dev = step.config, step.device
    batches = len(loader) if isinstance(loader, Sized) else None
    bar = reporter.progress_bar(batches, f"epoch {epoch + 1}/{epochs}")
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
    # The first non-finite step, kept on the device: no host sync per step.
    first_bad = torch.full((), -1, dtype=torch.int64, device=dev)
    samples, start = 0, time.perf_counter()
    i = -1
    for i, (images, targets) in enumerate(loader):
        images, targets = _to_device(images, targets, dev, config.normalize)
        update = (i + 1) % config.grad_accum == 0 or (batches is not None and i + 1 == batches)
        loss = step(images, targets, update)
        n = targets.shape[0]
        loss_sum += loss.double() * n
        bad_now = (first_bad < 0) & ~torch.isfinite(loss)
        first_bad = torch.where(bad_now, torch.full_like(first_bad, i), first_bad)
        samples += n
        if update and scheduler is not None and config.scheduler_per_step:
            scheduler.step()
        if bar is not None and (i % _REFRESH_STEPS == 0 or i + 1 == batches):
            _check_finite(first_bad, epoch)
            bar.set_postfix(loss=f"{loss_sum.item() / samples:.4f}", refresh=False)
            bar.update(i + 1 - bar.n)
    if i >= 0 and (i + 1) % config.grad_accum != 0 and batches is None:
        # An unsized loader ended mid-accumulation: apply what was accumulated.
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    _check_finite(first_bad, epoch)
    total = comm.all_reduce_sum(
        torch.stack([loss_sum, torch.tensor(float(samples), device=dev, dtype=torch.float64)])
    )
    global_samples = int(total[1].item())
    return {
        "epoch": epoch,
        "train_loss": float(total[0].item()) / max(global_samples, 1),
        "train_samples": global_samples,
        "train_images_per_sec": global_samples / max(seconds, 1e-9),
        "lr": float(step.optimizer.param_groups[0]["lr"]),
        "seconds": seconds,
    }


def _check_finite(first_bad: torch.Tensor, epoch: int) -> None:
    bad = int(first_bad.item())
    if bad >= 0:
        raise TrainingError(
            f"the loss was not finite (nan or inf) in epoch {epoch}, step {bad} on rank "
            f"{comm.get_rank()}. Lower the learning rate, train in bf16 (or fp16, which scales "
            "the loss) or check the inputs; the last checkpoint is from before this epoch. "
            + see("training-load_pretrained-wrap_ddp-focalloss-fit")
        )


def _to_device(
    images: torch.Tensor, targets: torch.Tensor, device: torch.device, normalize: Normalize | None
) -> tuple[torch.Tensor, torch.Tensor]:
    images = images.to(device, non_blocking=True)
    targets = targets.to(device, non_blocking=True)
    if normalize is not None and images.dtype == torch.uint8:
        images = normalize_batch(images, *normalize)
    return images, targets


def _per_sample(criterion: Criterion) -> Criterion:
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


def _autocast(device: torch.device, amp: Amp | None) -> contextlib.AbstractContextManager[Any]:
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_AMP_DTYPES[amp])
