"""``CheckpointManager``: the files of one training run, and the one place that names them.

Epoch checkpoints (``latest.pth`` / ``previous.pth``), step checkpoints
(``step-<n>.pth``), ``interrupted.pth`` (written when a signal stops the job),
per-epoch weight files and ``best.pth``: written atomically and
``weights_only``-safe (``ddpkit.checkpoint.serialization``), in a background thread after
a snapshot to host memory (``ddpkit.checkpoint.background``), with every rank's RNG state.
Resume takes the newest complete checkpoint that any node holds and sends it
to the ranks that lack it (``ddpkit.checkpoint.transfer``): no shared disk is needed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit import _graveyard
from ddpkit.checkpoint.background import BackgroundWriter, snapshot
from ddpkit.checkpoint.cadence import SaveCadence
from ddpkit.checkpoint.files import FORMAT, INTERRUPTED, LATEST, VERSION, step_name, write_files
from ddpkit.checkpoint.serialization import MapLocation, check_saveable
from ddpkit.checkpoint.state import TrainingState
from ddpkit.checkpoint.sync import (
    claim_directory,
    describe_error,
    load_newest,
    next_generation,
    raise_earlier_failure,
    restore_state,
    share_outcome,
)
from ddpkit.distributed.comm import all_gather_object, get_local_rank, get_rank, get_world_size
from ddpkit.position import Position
from ddpkit.rng import capture_rng_state

__all__ = ["CheckpointManager"]

logger = logging.getLogger("ddpkit")


class CheckpointManager:
    """Save and resume one training run's checkpoints in ``directory``.

    The files, all loadable with ``torch.load(weights_only=True)`` (their
    keys are listed in docs/training.md): ``latest.pth`` (the full state after
    the last saved epoch) and ``previous.pth`` (the one before);
    ``step-<n>.pth``, the same full state after optimizer step ``n`` in the
    middle of an epoch (the ``keep_steps`` newest stay); ``interrupted.pth``,
    written when a signal stopped the job (removed once a later checkpoint
    exists); ``{prefix}-epoch{N}-acc{acc1:.2f}.pth``, the weights alone, as
    classic scripts write them (the last ``keep_last`` and the best); and
    ``best.pth``, a hard link to (or copy of) the best epoch's weights.

    Rank 0 writes them; with ``on_each_node`` the first rank of every node
    writes its own copy too, so a lost disk loses nothing. The directory may
    differ between nodes: :meth:`resume` finds the newest complete checkpoint
    any rank holds and sends it over the process group to those that lack it.
    A fresh run refuses a directory that holds another run's files, unless ``overwrite``.

    :meth:`save`, :meth:`save_step` and :meth:`resume` are collectives: all
    ranks must call them, or they deadlock. With plain DDP every rank holds
    the same model and optimizer state; sharded optimizers are not supported.

    Args:
        directory: where the files go; created by the first save.
        prefix: the start of the per-epoch weight files' names.
        keep_last: how many per-epoch weight files to keep, at least 1.
        keep_steps: how many step checkpoints to keep, at least 1.
        every_steps: ``ddpkit.fit`` saves a step checkpoint every this many
            optimizer steps; None: only at epoch ends.
        every_minutes: ``ddpkit.fit`` also saves when this many minutes passed
            since the last save; None: never by time. Both are held as
            ``cadence`` (:class:`~ddpkit.checkpoint.cadence.SaveCadence`).
        on_each_node: the first rank of each node writes its own copy.
        overwrite: a fresh run deletes another run's files in ``directory``; False: refuse.
        extra: stored in every checkpoint (under a save's own ``extra``), e.g. the
            architecture; :meth:`resume` refuses, before loading, a checkpoint
            whose ``extra`` holds another value for one of these keys.
        network: the former name of ``prefix`` (deprecated).

    Attributes:
        cadence: when ``fit`` takes a step checkpoint (``every_steps``, ``every_minutes``).
        best_acc1: the best ``acc1`` saved so far (restored by :meth:`resume`), or None.
        position: where the resumed checkpoint stood (:meth:`resume`), or None.
        resumed_from: the file :meth:`resume` loaded (on the rank that read it), or None.
        loop: what the training loop stored with the resumed checkpoint, one entry per rank.
        resumed_extra: the resumed checkpoint's ``extra`` (this manager's and its save's).
        latest_path: ``directory / "latest.pth"``.
        interrupted_path: ``directory / "interrupted.pth"``.

    Example:
        >>> manager = CheckpointManager("runs/exp1", prefix="seresnext50", every_steps=500)
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
        keep_steps: int = 2,
        every_steps: int | None = None,
        every_minutes: float | None = None,
        on_each_node: bool = False,
        overwrite: bool = False,
        extra: Mapping[str, Any] | None = None,
        state: TrainingState | None = None,
        network: str | None = None,
    ):
        if network is not None:
            _graveyard.deprecated("CheckpointManager(network=...)", "prefix=...")
            prefix = network
        for name, count in (("keep_last", keep_last), ("keep_steps", keep_steps)):
            if type(count) is not int or count < 1:
                raise ValueError(f"{name} must be at least 1, got {count!r}")
        self.cadence = SaveCadence(every_steps=every_steps, every_minutes=every_minutes)
        if not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"prefix must be a file name prefix without '/', got {prefix!r}")
        self.directory = Path(directory)
        self.prefix, self.keep_last, self.keep_steps = prefix, keep_last, keep_steps
        self.on_each_node, self.overwrite = on_each_node, overwrite
        self.extra = dict(check_saveable(dict(extra or {})))
        self.state: TrainingState | None = None
        if state is not None:
            self.bind(state)
        self.latest_path = self.directory / LATEST
        self.interrupted_path = self.directory / INTERRUPTED
        self.best_acc1: float | None = None
        self._best_epoch: int | None = None
        self.position: Position | None = None
        self.resumed_from: Path | None = None
        self.resumed_checkpoint: str | None = None  # the same on every rank, for messages
        self.loop: list[Any] | None = None
        self.resumed_extra: dict[str, Any] = {}
        self._generation: int | None = None
        self._step = 0
        self._latest_damaged = False
        self._writer = BackgroundWriter()
        # The host copy of the last background save, written into by the next one.
        self._spare: Any = None

    @property
    def every_steps(self) -> int | None:
        """``cadence.every_steps``: a step checkpoint every this many optimizer steps."""
        return self.cadence.every_steps

    @property
    def every_minutes(self) -> float | None:
        """``cadence.every_minutes``: a step checkpoint when this many minutes passed."""
        return self.cadence.every_minutes

    @property
    def write_error(self) -> BaseException | None:
        """The error of a background write that failed on this rank, until it is raised."""
        return self._writer.error

    def bind(self, state: TrainingState) -> None:
        """Take the objects every later save and resume reads and loads; once per run.

        Raises:
            TypeError: ``state`` is not a :class:`TrainingState`.
        """
        if not isinstance(state, TrainingState):
            raise TypeError(f"bind() takes a TrainingState, got {type(state).__name__}")
        self.state = state

    def _bound(self, given: tuple[Any, Any, Any, Any], ema: nn.Module | None) -> TrainingState:
        """The bound state, or one made of objects passed the way 0.1 passed them."""
        model, optimizer, scheduler, scaler = given
        if model is not None:  # save(epoch, model, optimizer, ...): bind them, as 0.1 did
            self.bind(TrainingState(model, optimizer, scheduler, scaler, ema))
        elif ema is not None and self.state is not None and self.state.ema is not ema:
            self.bind(dataclasses.replace(self.state, ema=ema))
        if self.state is None:
            raise TypeError(
                "no training state: bind it once with CheckpointManager(..., "
                "state=TrainingState(model, optimizer, ...)) or manager.bind(...)"
            )
        return self.state

    def save(
        self,
        epoch: int,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        metrics: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        step: int | None = None,
        block: bool = True,
        ema: nn.Module | None = None,
    ) -> Path | None:
        """Save the state after ``epoch``. All ranks must call this, or it deadlocks.

        Pass the same ``metrics`` on every rank (``ddpkit.evaluate``'s are).

        Args:
            epoch: the epoch just finished.
            model, optimizer, scheduler, scaler, ema: the objects to save, as in
                ddpkit 0.1; given, they are bound (:meth:`bind`) for later saves
                and :meth:`resume`. Leave them out once a state is bound.
            metrics: ``acc1`` names the weight file (0 without it) and picks
                ``best.pth``; ``loss`` and the rest are stored. With an average
                and an ``ema_acc1`` above ``acc1``, the weight file holds the
                average's weights and is named (and ranked) by ``ema_acc1``.
            extra: anything else to store, weights_only-loadable.
            step: optimizer steps taken so far (``fit`` passes it); default:
                the last step known to this manager.
            block: wait until the files are written. With False, return once the
                state is copied to host memory (reusing the last such copy, kept
                until :meth:`flush`); the next save, :meth:`wait` and
                :meth:`resume` wait for the write.

        Returns:
            The path of ``latest.pth`` on the ranks that write, None on the others.

        Raises:
            TypeError: no state is bound, or ``metrics`` or ``extra`` hold
                something that cannot be loaded back; nothing is written.
            OSError: (writing ranks, ``block=True``) writing failed.
            Rank0Error: (other ranks, ``block=True``) rank 0 failed to write.
            CheckpointError: an earlier background write failed on some rank.
        """
        self._bound((model, optimizer, scheduler, scaler), ema)
        step = self._step if step is None else step
        position = Position(epoch + 1, 0, 0, step, get_world_size())
        return self._save("epoch", epoch, position, metrics, extra, None, block)

    def save_step(
        self,
        position: Position,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        kind: str = "step",
        loop: Any = None,
        extra: Mapping[str, Any] | None = None,
        block: bool = True,
        ema: nn.Module | None = None,
    ) -> Path | None:
        """Save the state in the middle of an epoch, at ``position``. All ranks must call this.

        Args:
            position: where training stands (its ``step`` names the file).
            model, optimizer, scheduler, scaler, ema: as in :meth:`save`.
            kind: ``"step"`` (``step-<n>.pth``) or ``"interrupted"`` (``interrupted.pth``).
            loop: this rank's running totals (picklable), given back in :attr:`loop`.
            extra: anything else to store, weights_only-loadable.
            block: as in :meth:`save`.

        Returns:
            The file's path on the ranks that write, None on the others.
        """
        if kind not in ("step", "interrupted"):
            raise ValueError(f"kind must be 'step' or 'interrupted', got {kind!r}")
        self._bound((model, optimizer, scheduler, scaler), ema)
        return self._save(kind, position.epoch, position, None, extra, loop, block)

    @property
    def writes(self) -> bool:
        """Whether this rank writes files: rank 0, and with ``on_each_node`` each node's first."""
        return get_rank() == 0 or (self.on_each_node and get_local_rank() == 0)

    def wait(self, *, raise_error: bool = True) -> None:
        """Wait for this rank's background write; raise its error if it failed (and asked to)."""
        if raise_error:
            self._writer.wait()
        else:
            self._writer.join()

    def flush(self) -> None:
        """Wait for every rank's background write; if one failed, raise on every rank.

        All ranks must call this, or it deadlocks.

        Raises:
            CheckpointError: (or the write's own error, on its rank) a write failed.
        """
        self._writer.join()
        self._spare = None  # the end of training: the host copy is not needed any more
        failed = self._writer.error
        reports = all_gather_object(describe_error(failed))
        raise_earlier_failure(failed, reports, self._writer)

    def _save(
        self,
        kind: str,
        epoch: int,
        position: Position,
        metrics: Mapping[str, Any] | None,
        extra: Mapping[str, Any] | None,
        loop: Any,
        block: bool,
    ) -> Path | None:
        assert self.state is not None, "bound by save() / save_step()"
        self._writer.join()  # at most one write in flight
        failed = self._writer.error
        gathered = all_gather_object((capture_rng_state(), loop, describe_error(failed)))
        raise_earlier_failure(failed, [g[2] for g in gathered], self._writer)
        metrics, extra = dict(metrics or {}), {**self.extra, **(extra or {})}
        check_saveable({"metrics": metrics, "extra": extra})  # the same on all ranks
        if self._generation is None:  # the first save of a fresh run: the directory is its own
            claim_directory(self.directory, writes=self.writes, overwrite=self.overwrite)
            self._generation = next_generation(self.directory)
        acc1 = float(metrics["acc1"]) if "acc1" in metrics else None
        # The weight file holds the better of the model and its average, as measured.
        averaged = self.state.ema is not None and "ema_acc1" in metrics
        ema_acc1 = float(metrics["ema_acc1"]) if averaged else None
        use_ema = (
            ema_acc1 is not None
            and not math.isnan(ema_acc1)
            and (acc1 is None or math.isnan(acc1) or ema_acc1 > acc1)
        )
        acc1 = ema_acc1 if use_ema else acc1
        improved = (
            kind == "epoch"
            and acc1 is not None
            and not math.isnan(acc1)
            and (self.best_acc1 is None or acc1 > self.best_acc1)
        )
        best = (acc1, epoch) if improved else (self.best_acc1, self._best_epoch)
        self._step = max(self._step, position.step)
        path: Path | None = None
        error: BaseException | None = None
        gather = self.on_each_node and get_world_size() > 1
        pieces = self.state.capture(gather)
        if self.writes:
            state = {
                "format": FORMAT,
                "version": VERSION,
                "kind": kind,
                "snapshot": f"g{self._generation}-s{position.step}-e{epoch}-{kind}",
                "generation": self._generation,
                "epoch": epoch,
                "position": position.as_dict(),
                "acc1": acc1,
                "loss": float(metrics["loss"]) if "loss" in metrics else None,
                "lr": self.state.learning_rate(),
                **pieces,
                "weights": "ema" if use_ema else "model",
                "world_size": get_world_size(),
                "rng": [g[0] for g in gathered],
                "loop": [g[1] for g in gathered],
                "metrics": metrics,
                "extra": extra,
                "best_acc1": best[0],
                "best_epoch": best[1],
            }
            path = self.latest_path if kind == "epoch" else self._path_of(kind, position.step)
            if block:
                write = functools.partial(self._write, state, improved)
                try:
                    write()
                except Exception as exc:
                    error = exc
            else:  # training changes the originals from here on: write a copy
                # The last copy's write is done (joined above): its host memory is reused.
                self._spare = snapshot(state, reuse=self._spare)
                self._writer.submit(functools.partial(self._write, self._spare, improved))
        if block:
            share_outcome(error, kind)
        self.best_acc1, self._best_epoch = best
        return path

    def _path_of(self, kind: str, step: int) -> Path:
        return self.interrupted_path if kind == "interrupted" else self.directory / step_name(step)

    def _write(self, state: dict[str, Any], improved: bool) -> None:
        rotate = not self._latest_damaged  # a damaged latest.pth must not become previous.pth
        write_files(
            self.directory,
            state,
            prefix=self.prefix,
            keep_last=self.keep_last,
            keep_steps=self.keep_steps,
            best=improved,
            rotate=rotate,
        )
        if state["kind"] == "epoch":
            self._latest_damaged = False

    def resume(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        path: str | os.PathLike[str] | None = None,
        map_location: MapLocation = "cpu",
        strict_rng: bool = True,
        ema: nn.Module | None = None,
    ) -> int:
        """Restore the newest complete checkpoint any rank holds; return the epoch to start in.

        The ranks agree on the newest checkpoint of the newest generation
        (epoch, step or interrupted) in any rank's directory; its holders load
        it, checking every CRC, and one sends it to the others. A damaged file
        is skipped, with a warning, for the next newest. Also restores this
        rank's RNG state, :attr:`best_acc1`, :attr:`position` and :attr:`loop`.
        All ranks must call this, or it deadlocks.

        Args:
            model, optimizer, scheduler, scaler, ema: as in :meth:`save` (bound
                for later saves when given); a piece that is None is not restored.
            path: resume from this file (on any rank's file system) instead
                of the newest; later saves start a new generation.
            map_location: where loaded tensors go first.
            strict_rng: refuse a checkpoint saved by a different number of ranks,
                whose RNG states cannot be matched to these; with False, resume
                without restoring RNG state, with a warning.

        Returns:
            The epoch to start in: the saved epoch + 1 after an epoch
            checkpoint, the epoch in progress after a step checkpoint (see
            :attr:`position` for how far into it), 0 when there is none.

        Raises:
            CheckpointError: no checkpoint is loadable, ``path`` is none on any rank (said what
                it is), a part asked for is missing, the position or RNG states are malformed,
                the model differs (keys named), or the world size changed with ``strict_rng``.

        Example:
            >>> start_epoch = manager.resume(model, optimizer, scheduler, scaler)
        """
        training = self._bound((model, optimizer, scheduler, scaler), ema)
        self._writer.join()
        agreed = load_newest(self.directory, Path(path) if path is not None else None, map_location)
        self._latest_damaged = agreed.latest_damaged
        self.resumed_from, self.resumed_checkpoint = agreed.file, None
        if agreed.state is None or agreed.found is None:
            self._generation = agreed.generation + 1
            self.position = None
            return 0
        self.resumed_checkpoint = str(path or self.directory / agreed.found.name)
        restored = restore_state(
            agreed.state,
            agreed.found,
            training,
            strict_rng,
            where=self.resumed_checkpoint,
            expected=self.extra,
        )
        self.position, self.loop = restored.position, restored.loop
        self.resumed_extra = restored.extra or {}
        self.best_acc1, self._best_epoch = restored.best_acc1, restored.best_epoch
        self._step = self.position.step
        # An explicit file may be older than the newest: what follows is a new line of saves.
        self._generation = agreed.generation + 1 if path is not None else agreed.found.generation
        if get_rank() == 0:
            logger.info(
                "resuming from %s (read on rank %d)", agreed.found.describe(), agreed.source
            )
        return self.position.epoch if self.position is not None else 0
