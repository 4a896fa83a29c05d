"""``fit()`` and ``evaluate()``: the minimal DDP training loop, as two plain functions.

``fit`` runs the epochs: ``set_epoch`` on the sampler, mixed precision,
gradient accumulation without needless all-reduces, uint8 batches normalised
on the device, exact validation, and a crash-safe checkpoint from rank 0
after every epoch. Everything else stays yours: the model, the data, the
optimiser and the schedule are arguments.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ddpkit import comm
from ddpkit.checkpoint import CheckpointManager, save_checkpoint
from ddpkit.data.loaders import set_epoch
from ddpkit.data.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize_batch
from ddpkit.metrics import ClassificationTotals
from ddpkit.parallel import no_sync, unwrap_model

__all__ = ["History", "TrainingError", "evaluate", "fit"]

logger = logging.getLogger("ddpkit")

Amp = Literal["bf16", "fp16"]
Normalize = tuple[Sequence[float], Sequence[float]]
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# How often (in optimizer steps) rank 0 refreshes the progress bar; each
# refresh reads the running loss from the device, a host sync.
_REFRESH_STEPS = 20


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss); the message names the epoch and step."""


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
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    epochs: int,
    val_loader: Iterable[Any] | None = None,
    scheduler: Any = None,
    scheduler_per_step: bool = False,
    amp: Amp | None = None,
    grad_accum: int = 1,
    clip_grad_norm: float | None = None,
    checkpoints: CheckpointManager | None = None,
    resume: bool = False,
    normalize: Normalize | None = (IMAGENET_MEAN, IMAGENET_STD),
    device: torch.device | str | None = None,
    progress: bool = True,
    log_dir: str | os.PathLike[str] | None = None,
    callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
) -> History:
    """Train ``model`` for ``epochs`` epochs; every rank calls it with its own loaders.

    Each epoch: ``set_epoch`` on the loader's sampler; for each batch, move it
    to the device (uint8 images are normalised there with ``normalize``),
    forward under ``torch.autocast`` when ``amp`` is set, scale the loss by
    ``1 / grad_accum`` and backward, inside ``no_sync`` except on the micro-step
    that completes an optimizer step; clip, step (through a GradScaler for
    fp16), zero the gradients. Then :func:`evaluate` on ``val_loader``, the
    scheduler step, one record in the :class:`History` (and, on rank 0, a JSON
    line in ``log_dir/metrics.jsonl`` and TensorBoard scalars when installed),
    the callbacks, and ``checkpoints.save`` (a collective). Ctrl-C saves the
    interrupted weights and optimizer to ``interrupted.pth`` on rank 0.

    Args:
        model: the model, already on its device and wrapped (``wrap_ddp``).
        train_loader: batches of ``(images, targets)``.
        optimizer: the optimizer over ``model``'s parameters.
        criterion: ``criterion(logits, targets) -> loss`` (mean over the batch).
        epochs: train until this many epochs are done (counting resumed ones).
        val_loader: evaluated after each epoch; metrics are exact across ranks.
        scheduler: stepped after each epoch (or each optimizer step with
            ``scheduler_per_step``).
        scheduler_per_step: step the scheduler per optimizer step.
        amp: ``"bf16"`` or ``"fp16"`` autocast; fp16 uses a GradScaler whose
            state is checkpointed.
        grad_accum: micro-batches per optimizer step.
        clip_grad_norm: clip the total gradient norm to this value.
        checkpoints: where to save after each epoch (and resume from).
        resume: continue from ``checkpoints``' latest checkpoint.
        normalize: ``(mean, std)`` for uint8 batches; None leaves batches as they come.
        device: where batches go; default: the model's parameters' device.
        progress: a tqdm bar on rank 0.
        log_dir: rank 0 writes ``metrics.jsonl`` (and TensorBoard events) here.
        callbacks: called with each epoch's record, on every rank.

    Returns:
        The :class:`History` of this run (resumed epochs are not repeated).

    Raises:
        TrainingError: a loss that is not finite (names the epoch and step).
        ValueError: ``epochs``, ``grad_accum`` or ``amp`` is invalid, or
            ``resume`` without ``checkpoints``.

    Example:
        >>> history = fit(model, train_loader, optimizer, criterion=FocalLoss(gamma=2),
        ...               epochs=90, val_loader=val_loader, scheduler=scheduler,
        ...               amp="bf16", checkpoints=CheckpointManager("checkpoints"))
    """
    if epochs < 0 or grad_accum < 1:
        raise ValueError(f"epochs must be >= 0 and grad_accum >= 1, got {epochs} and {grad_accum}")
    if amp is not None and amp not in _AMP_DTYPES:
        raise ValueError(f"amp must be 'bf16', 'fp16' or None, got {amp!r}")
    if resume and checkpoints is None:
        raise ValueError("resume=True needs checkpoints=CheckpointManager(directory)")
    dev = torch.device(device) if device is not None else _model_device(model)
    scaler = torch.amp.GradScaler(dev.type) if amp == "fp16" else None
    start = 0
    if resume and checkpoints is not None:
        start = checkpoints.resume(model, optimizer, scheduler, scaler)
        logger.info("resuming at epoch %d", start)
    step = _Step(model, optimizer, criterion, dev, amp, scaler, grad_accum, clip_grad_norm)
    writer = _MetricsWriter(log_dir) if comm.is_main_process() and log_dir is not None else None
    history = History()
    epoch = start
    try:
        for epoch in range(start, epochs):
            record = _train_epoch(
                step,
                train_loader,
                epoch,
                epochs,
                normalize,
                scheduler,
                scheduler_per_step,
                progress,
            )
            if val_loader is not None:
                val = evaluate(model, val_loader, criterion=criterion, normalize=normalize, amp=amp)
                record.update({f"val_{k}": v for k, v in val.items()})
            if scheduler is not None and not scheduler_per_step:
                scheduler.step()
            history.records.append(record)
            if writer is not None:
                writer.write(record)
            for callback in callbacks:
                callback(record)
            if checkpoints is not None:
                metrics = {"acc1": record.get("val_acc1", 0.0), "loss": record["train_loss"]}
                checkpoints.save(epoch, model, optimizer, scheduler, scaler, metrics=metrics)
            if comm.is_main_process():
                logger.info("epoch %d: %s", epoch, _summary(record))
    except KeyboardInterrupt:
        if checkpoints is not None and comm.is_main_process():
            path = os.path.join(checkpoints.directory, "interrupted.pth")
            save_checkpoint(
                {
                    "epoch": epoch,
                    "model": unwrap_model(model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                },
                path,
            )
            logger.warning(
                "interrupted in epoch %d; weights and optimizer saved to %s", epoch, path
            )
        raise
    finally:
        if writer is not None:
            writer.close()
    return history


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
    dev = torch.device(device) if device is not None else _model_device(net)
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
                _loss_sum(criterion, logits.double(), targets)
                if criterion is not None
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
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        amp: Amp | None,
        scaler: torch.amp.GradScaler | None,
        grad_accum: int,
        clip_grad_norm: float | None,
    ) -> None:
        self.model, self.optimizer, self.criterion = model, optimizer, criterion
        self.device, self.amp, self.scaler = device, amp, scaler
        self.grad_accum, self.clip = grad_accum, clip_grad_norm

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, update: bool) -> torch.Tensor:
        # Only the micro-step that completes an update all-reduces gradients.
        with no_sync(self.model, enabled=not update), _autocast(self.device, self.amp):
            loss = self.criterion(self.model(images), targets)
        scaled = loss / self.grad_accum
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()  # type: ignore[no-untyped-call]
        else:
            scaled.backward()  # type: ignore[no-untyped-call]
        if update:
            if self.clip is not None:
                if self.scaler is not None:
                    self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
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
    normalize: Normalize | None,
    scheduler: Any,
    scheduler_per_step: bool,
    progress: bool,
) -> dict[str, Any]:
    if isinstance(loader, torch.utils.data.DataLoader):
        set_epoch(loader, epoch)  # reshuffles, and seeds this epoch's augmentations
    step.model.train()
    batches = len(loader) if isinstance(loader, Sized) else None
    bar = _progress_bar(progress, batches, f"epoch {epoch + 1}/{epochs}")
    dev = step.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
    # The first non-finite step, kept on the device: no host sync per step.
    first_bad = torch.full((), -1, dtype=torch.int64, device=dev)
    samples, start = 0, time.perf_counter()
    i = -1
    for i, (images, targets) in enumerate(loader):
        images, targets = _to_device(images, targets, dev, normalize)
        update = (i + 1) % step.grad_accum == 0 or (batches is not None and i + 1 == batches)
        loss = step(images, targets, update)
        n = targets.shape[0]
        loss_sum += loss.double() * n
        bad_now = (first_bad < 0) & ~torch.isfinite(loss)
        first_bad = torch.where(bad_now, torch.full_like(first_bad, i), first_bad)
        samples += n
        if update and scheduler is not None and scheduler_per_step:
            scheduler.step()
        if bar is not None and (i % _REFRESH_STEPS == 0 or i + 1 == batches):
            _check_finite(first_bad, epoch)
            bar.set_postfix(loss=f"{loss_sum.item() / samples:.4f}", refresh=False)
            bar.update(i + 1 - bar.n)
    if i >= 0 and (i + 1) % step.grad_accum != 0 and batches is None:
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
            f"{comm.get_rank()}. Common causes: a learning rate too high, fp16 without a "
            "loss scale (use amp='bf16' or 'fp16', which scales), or bad inputs; the last "
            "checkpoint is from before this epoch."
        )


def _to_device(
    images: torch.Tensor, targets: torch.Tensor, device: torch.device, normalize: Normalize | None
) -> tuple[torch.Tensor, torch.Tensor]:
    images = images.to(device, non_blocking=True)
    targets = targets.to(device, non_blocking=True)
    if normalize is not None and images.dtype == torch.uint8:
        images = normalize_batch(images, *normalize)
    return images, targets


def _loss_sum(
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """The sum of per-sample losses: exact over any split of the data into batches."""
    if isinstance(getattr(criterion, "reduction", None), str):
        saved = criterion.reduction  # type: ignore[attr-defined]
        criterion.reduction = "none"  # type: ignore[attr-defined]
        try:
            return criterion(logits, targets).double().sum()
        finally:
            criterion.reduction = saved  # type: ignore[attr-defined]
    return criterion(logits, targets).double() * targets.shape[0]


def _autocast(device: torch.device, amp: Amp | None) -> contextlib.AbstractContextManager[Any]:
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_AMP_DTYPES[amp])


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _progress_bar(progress: bool, total: int | None, desc: str) -> Any:
    if not progress or not comm.is_main_process():
        return None
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def _summary(record: dict[str, Any]) -> str:
    shown = ("train_loss", "val_acc1", "val_acc5", "val_loss", "train_images_per_sec")
    return ", ".join(f"{k} {record[k]:.4g}" for k in shown if k in record)


class _MetricsWriter:
    """Rank 0's log: one JSON line per epoch, plus TensorBoard when it is installed."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.fspath(log_dir))
        except ImportError:
            pass

    def write(self, record: dict[str, Any]) -> None:
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in record.items()
        }
        self._jsonl.write(json.dumps(clean) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "epoch":
                    self._tb.add_scalar(key, value, record["epoch"])
            self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
