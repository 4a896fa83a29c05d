"""``CheckpointManager``: the files of one training run, and the one place that names them.

Epoch checkpoints (``latest.pth`` / ``previous.pth``), per-epoch weight files,
``best.pth`` and ``interrupted.pth``: written by rank 0 through the atomic,
``weights_only``-safe files of ``ddpkit.serialization``, with every rank's RNG
state (``ddpkit.rng``), and resumed from the newest loadable one.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit._docs import see
from ddpkit.comm import all_gather_object, get_rank, get_world_size
from ddpkit.parallel import unwrap_model
from ddpkit.rank0 import Rank0Error, rank0_first, rank0_only
from ddpkit.rng import capture_rng_state, restore_rng_state
from ddpkit.serialization import (
    CheckpointError,
    MapLocation,
    check_saveable,
    link_or_copy,
    load_checkpoint,
    payload_bytes,
    replace_atomic,
    save_checkpoint,
    write_file,
)

__all__ = ["CheckpointManager"]

logger = logging.getLogger("ddpkit")

_FORMAT, _VERSION = "ddpkit-checkpoint", 1
# Former names, importable from here for one more release.
_DEPRECATED = {
    "RankZeroError": ("ddpkit.Rank0Error", Rank0Error),
    "rank_zero_first": ("ddpkit.rank0_first", rank0_first),
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new, value = _DEPRECATED[name]
        warnings.warn(
            f"ddpkit.checkpoint.{name} is now {new}; the old name will be removed in ddpkit 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module 'ddpkit.checkpoint' has no attribute {name!r}")


class CheckpointManager:
    """Save and resume one training run's checkpoints in ``directory``.

    The files, all loadable with ``torch.load(weights_only=True)``:

    - ``latest.pth``: the full state after the last saved epoch: ``format``,
      ``version``, ``epoch``, ``acc1``, ``loss``, ``lr``, ``model`` (unwrapped
      from DDP and torch.compile), ``optimizer``, ``scheduler``, ``scaler``,
      ``world_size``, ``rng`` (one state per rank), ``metrics``, ``extra``,
      ``best_acc1`` and ``best_epoch``.
    - ``previous.pth``: the full state saved before that. Each save renames
      ``latest.pth`` to it (unless :meth:`resume` found ``latest.pth`` damaged),
      so a damaged ``latest.pth`` costs an epoch, not the run.
    - ``{prefix}-epoch{N}-acc{acc1:.2f}.pth``: the model's weights alone, as
      classic training scripts write them: the last ``keep_last`` epochs, plus
      the best. Files of later epochs (left by an earlier run) are left alone.
    - ``best.pth``: the weights of the epoch with the highest ``metrics["acc1"]``,
      a hard link to that epoch's file where the file system allows, else a copy.
    - ``interrupted.pth``: the model and optimizer when training stopped in the
      middle of an epoch (Ctrl-C): :meth:`save_interrupted`, rank 0 only.

    :meth:`save` and :meth:`resume` are collectives: all ranks must call them,
    or they deadlock. Rank 0 writes; every rank reads in :meth:`resume`, so
    ``directory`` must be on a file system all nodes share (resume checks that
    the ranks found the same checkpoint). With plain DDP every rank holds the
    same model and optimizer state; sharded optimizers are not supported.

    Args:
        directory: where the files go; created by the first save.
        prefix: the start of the per-epoch weight files' names.
        keep_last: how many per-epoch weight files to keep, at least 1.
        network: the former name of ``prefix`` (deprecated).

    Attributes:
        best_acc1: the best ``acc1`` saved so far (restored by :meth:`resume`), or None.
        latest_path: ``directory / "latest.pth"``.
        interrupted_path: ``directory / "interrupted.pth"``.

    Example:
        >>> manager = CheckpointManager("runs/exp1", prefix="seresnext50", keep_last=3)
        >>> start = manager.resume(model, optimizer, scheduler)
        >>> for epoch in range(start, epochs):
        ...     train_one_epoch(...)
        ...     manager.save(epoch, model, optimizer, scheduler, metrics=evaluate(model, val))
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        prefix: str = "model",
        keep_last: int = 3,
        network: str | None = None,
    ):
        if network is not None:
            warnings.warn(
                "CheckpointManager(network=...) is now CheckpointManager(prefix=...); "
                "network= will be removed in ddpkit 0.3",
                DeprecationWarning,
                stacklevel=2,
            )
            prefix = network
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        if not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"prefix must be a file name prefix without '/', got {prefix!r}")
        self.directory = Path(directory)
        self.prefix, self.keep_last = prefix, keep_last
        self.latest_path = self.directory / "latest.pth"
        self.interrupted_path = self.directory / "interrupted.pth"
        self._previous_path = self.directory / "previous.pth"
        self.best_acc1: float | None = None
        self._best_epoch: int | None = None
        self._latest_damaged = False
        self._epoch_file = re.compile(rf"{re.escape(prefix)}-epoch(\d+)-acc.*\.pth")

    def save(
        self,
        epoch: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        metrics: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Path | None:
        """Save the state after ``epoch``. All ranks must call this, or it deadlocks.

        Every rank sends its RNG state to rank 0, which writes the files. Pass
        the same ``metrics`` on every rank (``ddpkit.evaluate``'s are): each
        rank tracks the best accuracy from them.

        Args:
            epoch: the epoch just finished.
            model: the model, wrapped or not.
            optimizer: its optimizer.
            scheduler: an LR scheduler, or None.
            scaler: a ``torch.amp.GradScaler``, or None.
            metrics: ``acc1`` names the weight file (0 without it) and picks
                ``best.pth``; ``loss`` and the rest are stored.
            extra: anything else to store, weights_only-loadable.

        Returns:
            The path of ``latest.pth`` on rank 0, None on the other ranks.

        Raises:
            TypeError: (rank 0) ``metrics`` or ``extra`` hold something that
                cannot be loaded back; nothing is written.
            OSError: (rank 0) writing failed.
            Rank0Error: (other ranks) rank 0 failed.
        """
        rng = all_gather_object(capture_rng_state())
        metrics = dict(metrics or {})
        acc1 = float(metrics["acc1"]) if "acc1" in metrics else None
        improved = (
            acc1 is not None
            and not math.isnan(acc1)
            and (self.best_acc1 is None or acc1 > self.best_acc1)
        )
        best = (acc1, epoch) if improved else (self.best_acc1, self._best_epoch)
        weights = unwrap_model(model).state_dict()
        state = {
            "format": _FORMAT,
            "version": _VERSION,
            "epoch": epoch,
            "acc1": acc1,
            "loss": float(metrics["loss"]) if "loss" in metrics else None,
            "lr": float(optimizer.param_groups[0]["lr"]),
            "model": weights,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "world_size": get_world_size(),
            "rng": rng,
            "metrics": metrics,
            "extra": dict(extra or {}),
            "best_acc1": best[0],
            "best_epoch": best[1],
        }
        name = f"{self.prefix}-epoch{epoch}-acc{acc1 or 0.0:.2f}.pth"
        written = rank0_only(sync=True)(self._write)(state, weights, name, improved)
        self.best_acc1, self._best_epoch = best  # only once the files are written
        return written

    def _write(self, state: dict[str, Any], weights: Any, name: str, improved: bool) -> Path:
        clean = check_saveable(state)  # refuse bad metrics or extra before touching a file
        self.directory.mkdir(parents=True, exist_ok=True)
        epoch_path = self.directory / name
        save_checkpoint(weights, epoch_path)
        if improved:
            link_or_copy(epoch_path, self.directory / "best.pth")
        # latest.pth comes last, so the files it refers to exist whenever it does.
        if self.latest_path.exists() and not self._latest_damaged:
            os.replace(self.latest_path, self._previous_path)
        replace_atomic(self.latest_path, functools.partial(write_file, clean), payload_bytes(clean))
        self._latest_damaged = False
        self._prune(state["epoch"], name, state["best_epoch"])
        logger.info("saved epoch %d: %s and %s", state["epoch"], self.latest_path, epoch_path)
        return self.latest_path

    def _prune(self, epoch: int, current: str, best_epoch: int | None) -> None:
        found = []
        for path in self.directory.iterdir():
            match = self._epoch_file.fullmatch(path.name)
            if match and int(match.group(1)) <= epoch:
                found.append((int(match.group(1)), path))
        keep = sorted({n for n, _ in found if n < epoch}, reverse=True)[: self.keep_last - 1]
        for number, path in found:
            # Another file of this epoch comes from a run that resumed before it.
            old = number != epoch and number not in keep and number != best_epoch
            if old or (number == epoch and path.name != current):
                path.unlink(missing_ok=True)

    def save_interrupted(
        self, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> Path | None:
        """On rank 0, save the model and optimizer mid-epoch to :attr:`interrupted_path`.

        Not a collective (an interrupt reaches the ranks at different moments):
        every rank may call it, and only rank 0 writes.

        Returns:
            The path on rank 0, None on the other ranks.
        """
        if get_rank() != 0:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        state = {
            "epoch": epoch,
            "model": unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(),
        }
        save_checkpoint(state, self.interrupted_path)
        return self.interrupted_path

    def resume(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        map_location: MapLocation = "cpu",
        strict_rng: bool = True,
    ) -> int:
        """Restore the newest loadable full checkpoint; return the epoch to start from.

        Tries ``latest.pth``, then (with a warning if ``latest.pth`` is damaged)
        ``previous.pth``. Restores the model (unwrapped), those of optimizer,
        scheduler and scaler that are given, this rank's RNG state and
        :attr:`best_acc1`. All ranks must call this, or it deadlocks.

        Args:
            model: the model, wrapped or not.
            optimizer: its optimizer, or None.
            scheduler: an LR scheduler, or None.
            scaler: a ``torch.amp.GradScaler``, or None.
            map_location: where loaded tensors go first.
            strict_rng: refuse a checkpoint saved by a different number of ranks,
                whose RNG states cannot be matched to these; with False, resume
                without restoring RNG state, with a warning.

        Returns:
            The saved epoch + 1, or 0 when there is no checkpoint.

        Raises:
            CheckpointError: no checkpoint file is loadable, a rank failed to
                load, the ranks found different checkpoints, a part asked for
                is missing, or the world size changed and ``strict_rng`` is True.

        Example:
            >>> start_epoch = manager.resume(model, optimizer, scheduler, scaler)
        """
        state, path, found, error = None, self.latest_path, None, None
        try:
            state, path = self._load_newest(map_location)
            found = (path.name, int(state["epoch"])) if state is not None else None
        except Exception as e:  # reported to every rank below, instead of leaving them waiting
            error = e
        reports = all_gather_object((found, f"{type(error).__name__}: {error}" if error else ""))
        if error is not None:
            raise error
        failed = [f"rank {r} ({p})" for r, (_, p) in enumerate(reports) if p]
        if failed:
            raise CheckpointError("resume failed on " + "; ".join(failed))
        if len({f for f, _ in reports}) > 1:
            views = ", ".join(
                f"rank {r}: {f'{f[0]} of epoch {f[1]}' if f else 'nothing'}"
                for r, (f, _) in enumerate(reports)
            )
            raise CheckpointError(
                f"the ranks found different checkpoints in {self.directory} ({views}). "
                "Put the directory on a file system that every node shares. " + see("checkpoints")
            )
        if state is None:
            return 0
        self._restore(state, path, model, (optimizer, scheduler, scaler), strict_rng)
        return int(state["epoch"]) + 1

    def _load_newest(self, map_location: MapLocation) -> tuple[dict[str, Any] | None, Path]:
        self._latest_damaged = False
        for path in (self.latest_path, self._previous_path):
            try:
                state = load_checkpoint(path, map_location)
            except FileNotFoundError:
                continue
            except CheckpointError as e:
                warnings.warn(f"{e}; trying an older checkpoint", RuntimeWarning, stacklevel=3)
                self._latest_damaged |= path == self.latest_path
                continue
            if state.get("format") != _FORMAT or state.get("version", 0) > _VERSION:
                raise CheckpointError(
                    f"{path} is not a ddpkit checkpoint of version <= {_VERSION} (format "
                    f"{state.get('format')!r}, version {state.get('version')!r})"
                )
            return state, path
        if self._latest_damaged:
            raise CheckpointError(
                f"no checkpoint in {self.directory} is loadable; see the warnings"
            )
        return None, self.latest_path

    def _restore(
        self,
        state: dict[str, Any],
        path: Path,
        model: nn.Module,
        parts: tuple[Any, ...],
        strict_rng: bool,
    ) -> None:
        names = ("optimizer", "scheduler", "scaler")
        for name, obj in zip(names, parts, strict=True):
            if obj is not None and state.get(name) is None:
                raise CheckpointError(f"{path} holds no {name} state; pass {name}=None to resume")
        saved, now = int(state["world_size"]), get_world_size()
        if saved != now:
            message = f"{path} holds RNG states for {saved} ranks and this job has {now}"
            if strict_rng:
                raise CheckpointError(f"{message}; pass strict_rng=False to resume without them")
            warnings.warn(
                f"{message}; resuming without restoring RNG state", RuntimeWarning, stacklevel=3
            )
        unwrap_model(model).load_state_dict(state["model"])
        for name, obj in zip(names, parts, strict=True):
            if obj is not None:
                obj.load_state_dict(state[name])
        if saved == now:
            restore_rng_state(state["rng"][get_rank()])
        self.best_acc1, self._best_epoch = state.get("best_acc1"), state.get("best_epoch")
