"""``CheckpointManager``: the files of one training run, and the one place that names them.

Epoch checkpoints (``latest.pth`` / ``previous.pth``), step checkpoints
(``step-<n>.pth``), ``interrupted.pth`` (written when a signal stops the job),
per-epoch weight files and ``best.pth``: written atomically and
``weights_only``-safe (``ddpkit.checkpoint.serialization``), in a background thread after
a snapshot to host memory (``ddpkit.checkpoint.background``), with every rank's RNG state.
Resume takes the newest complete checkpoint that any node holds and sends it
to the ranks that lack it (``ddpkit.checkpoint.transfer``): no shared disk is needed.
A URL (``s3://bucket/prefix``) puts the same files on an object store, committed
by manifests (``ddpkit.checkpoint.store``).
"""

from __future__ import annotations

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
from ddpkit._docs import see
from ddpkit._version import __version__
from ddpkit.checkpoint.background import BackgroundWriter, snapshot
from ddpkit.checkpoint.cadence import SaveCadence, SaveClock
from ddpkit.checkpoint.files import (
    BEST,
    FORMAT,
    INTERRUPTED,
    LATEST,
    VERSION,
    is_run_file,
    step_name,
    write_files,
)
from ddpkit.checkpoint.outcomes import describe_error, raise_earlier_failure, share_outcome
from ddpkit.checkpoint.restore import Restored, check_extra, restore_state
from ddpkit.checkpoint.serialization import CheckpointError, MapLocation, check_saveable
from ddpkit.checkpoint.state import TrainingState
from ddpkit.checkpoint.store import SIDE_FILES, ObjectStore, is_url
from ddpkit.checkpoint.sync import (
    claim_directory,
    load_newest,
    load_remote,
    newest_extra,
    next_generation,
    shared,
)
from ddpkit.distributed.comm import (
    all_gather_object,
    gather_object,
    get_local_rank,
    get_rank,
    get_world_size,
)
from ddpkit.distributed.compression import comm_hook_of
from ddpkit.distributed.launchers import launcher_job
from ddpkit.distributed.membership import refuse_strangers
from ddpkit.position import Position
from ddpkit.rng import capture_rng_state

__all__ = ["KINDS", "CheckpointManager"]

KINDS = ("epoch", "step", "interrupted")
"""The kinds of checkpoint :meth:`CheckpointManager.checkpoint` writes."""

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

    What a checkpoint holds is one :class:`~ddpkit.checkpoint.TrainingState`,
    bound once (``state=`` or :meth:`bind`): the objects, the run's progress
    (position, this rank's running totals, its place in a stream) and
    ``extra``. There is one save verb, :meth:`checkpoint` ``(kind)``, which
    records the bound state as it is (``save`` and ``save_step`` are 0.1's
    forms, deprecated). The manager holds the run's save cadence
    (``every_steps``, ``every_minutes``) and the clock of its last save
    (:attr:`clock`, restarted at every save of any kind); ``StepGuard`` asks it.

    Rank 0 writes the files; with ``on_each_node`` the first rank of every node
    writes its own copy too, so a lost disk loses nothing. The directory may
    differ between nodes: :meth:`resume` finds the newest complete checkpoint
    any rank holds and sends it over the process group to those that lack it.
    A fresh run refuses a directory that holds another run's files, unless ``overwrite``.

    ``directory`` may be a URL, ``s3://bucket/prefix`` (``pip install
    'ddpkit[s3]'``; credentials and endpoint from ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``): rank 0 uploads the same
    files there in its writer thread, each save committed by a manifest written
    last, and :meth:`resume` downloads the newest committed checkpoint, so a job
    whose machines are all new continues. The collectives of a save and a resume
    then wait for the store as long as
    :data:`~ddpkit.distributed.comm.PATIENT_TIMEOUT`, not the process group's timeout.

    :meth:`checkpoint`, :meth:`flush` and :meth:`resume` are
    collectives: all ranks must call them, or they deadlock. With plain DDP
    every rank holds the same model and optimizer state; sharded optimizers
    are not supported.

    Args:
        directory: where the files go; created by the first save.
        prefix: the start of the per-epoch weight files' names.
        keep_last: how many per-epoch weight files to keep, at least 1.
        keep_steps: how many step checkpoints to keep, at least 1.
        every_steps: a step checkpoint is due every this many optimizer
            steps; None: only at epoch ends.
        every_minutes: a step checkpoint is due when this many minutes passed
            since the last save (rank 0's clock); None: never by time. Both
            are held as ``cadence`` (:class:`~ddpkit.checkpoint.cadence.SaveCadence`).
        on_each_node: the first rank of each node writes its own copy.
        overwrite: a fresh run deletes another run's files in ``directory``; False: refuse.
        extra: stored in every checkpoint (under the state's and a save's own
            ``extra``), e.g. the architecture; :meth:`resume` refuses, before
            loading, a checkpoint whose ``extra`` holds another value for one
            of these keys.
        state: the training state, bound now (see :meth:`bind`).
        network: the former name of ``prefix`` (deprecated).
        local_dir: (a URL) this node's directory for the files on their way to
            and from the store and for ``metrics.jsonl``, which travels with every
            commit; default ``~/.cache/ddpkit/checkpoints/<bucket>/<prefix>``.
        storage_options: (a URL) passed to ``fsspec.url_to_fs`` (e.g. ``profile``).

    Attributes:
        state: the bound :class:`~ddpkit.checkpoint.TrainingState`, or None.
        cadence: when step checkpoints fall (:class:`~ddpkit.checkpoint.cadence.SaveCadence`).
        clock: the cadence applied, on the clock of the last save
            (:class:`~ddpkit.checkpoint.cadence.SaveClock`).
        directory: where the files are written: the local directory (with a
            URL, ``local_dir``).
        url: the store's URL, or None for a local directory.
        location: ``url``, or ``directory`` as a string: where the checkpoints are.
        best_acc1: the best ``acc1`` saved so far (restored by :meth:`resume`), or None.
        resumed_from: the file :meth:`resume` loaded (on the rank that read it), or None.
        resumed: what the resumed checkpoint held beyond the bound state's
            pieces (:class:`~ddpkit.checkpoint.restore.Restored`: every rank's
            totals and stream places as saved, its ``extra``), or None.
        resumed_extra: the resumed checkpoint's ``extra`` (this manager's and its save's).
        latest_path: ``directory / "latest.pth"`` (:attr:`latest`: with a store, its URL).
        interrupted_path: ``directory / "interrupted.pth"``.

    Example:
        >>> state = TrainingState(model, optimizer, scheduler)
        >>> manager = CheckpointManager("runs/exp1", prefix="seresnext50", state=state)
        >>> start = manager.resume()
        >>> for epoch in range(start, epochs):
        ...     train_one_epoch(...)
        ...     state.end_epoch(epoch, world_size)
        ...     manager.checkpoint("epoch", metrics=evaluate(model, val))
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
        local_dir: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ):
        if network is not None:
            _graveyard.deprecated("CheckpointManager(network=...)", "prefix=...")
            prefix = network
        for name, count in (("keep_last", keep_last), ("keep_steps", keep_steps)):
            if type(count) is not int or count < 1:
                raise ValueError(f"{name} must be at least 1, got {count!r}")
        self.cadence = SaveCadence(every_steps=every_steps, every_minutes=every_minutes)
        self.clock = SaveClock(self.cadence)
        if not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"prefix must be a file name prefix without '/', got {prefix!r}")
        self.store: ObjectStore | None = None
        self.url: str | None = None
        if is_url(directory):
            if on_each_node:
                raise ValueError(
                    f"on_each_node is for local directories: every node of the job reads "
                    f"{directory} itself (pass one or the other)"
                )
            self.store = ObjectStore(os.fspath(directory), storage_options)
            self.url = self.store.url
            self.directory = Path(local_dir) if local_dir is not None else _cache_dir(self.url)
        else:
            self.directory = Path(os.fspath(directory).removeprefix("file://"))
        self.location = self.url or str(self.directory)
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
        self.resumed_from: Path | None = None
        self.resumed_checkpoint: str | None = None  # the same on every rank, for messages
        self.resumed: Restored | None = None
        self.resumed_extra: dict[str, Any] = {}
        self._generation: int | None = None  # set by the claim of a fresh run, or a resume
        self._latest_damaged = False
        self._writer = BackgroundWriter()
        # The host copy of the last background save, written into by the next one.
        self._spare: Any = None

    @property
    def network(self) -> str:
        """The former name of :attr:`prefix` (deprecated)."""
        _graveyard.deprecated("CheckpointManager.network", "CheckpointManager.prefix")
        return self.prefix

    @property
    def position(self) -> Position | None:
        """Where the resumed checkpoint stood, or None (the run's progress is the state's)."""
        return self.resumed.position if self.resumed is not None else None

    @property
    def write_error(self) -> BaseException | None:
        """The error of a background write that failed on this rank, until it is raised."""
        return self._writer.error

    def bind(self, state: TrainingState) -> None:
        """Take the state every later save and resume records and restores; once per run.

        Raises:
            TypeError: ``state`` is not a :class:`~ddpkit.checkpoint.TrainingState`.
        """
        if not isinstance(state, TrainingState):
            raise TypeError(f"bind() takes a TrainingState, got {type(state).__name__}")
        self.state = state

    def _bound(self, call: str, given: dict[str, Any], warn: bool = True) -> TrainingState:
        """The bound state; objects passed one by one (0.1's way) are bound, with a warning."""
        passed = {name: obj for name, obj in given.items() if obj is not None}
        if passed and warn:
            names = ", ".join(passed)
            _graveyard.deprecated(
                f"CheckpointManager.{call}({names}) with the objects one by one",
                "CheckpointManager(..., state=TrainingState(model, optimizer, ...)) or "
                f"manager.bind(TrainingState(...)) once, then {call}() without them",
                stacklevel=4,
            )
        if passed:
            if "model" in passed:  # save(epoch, model, optimizer, ...): bound, as 0.1 did
                pieces = {k: v for k, v in given.items() if k != "model"}
                old, new = self.state, TrainingState(given["model"], **pieces)
                if old is not None:  # the run's progress goes on in the new bag
                    new.advance(old.position, loop=old.loop, loader_state=old.loader_state)
                self.bind(new)
            elif self.state is not None:  # an average given alone joins the bound state
                self.state.ema = passed.get("ema", self.state.ema)
        if self.state is None:
            raise TypeError(
                f"no training state to {call}: bind it once with CheckpointManager(..., "
                "state=TrainingState(model, optimizer, ...)) or manager.bind(...)"
            )
        return self.state

    def save(
        self, epoch: int, *objects: Any, step: int | None = None, **options: Any
    ) -> Path | str | None:
        """Deprecated (0.1): ``state.end_epoch(epoch, world, step)``, then ``checkpoint("epoch")``.

        ``objects`` (model, optimizer, scheduler, scaler; ``ema=`` too) are
        bound, as 0.1 did; ``options`` are :meth:`checkpoint`'s. Removed in 0.3.
        """
        _graveyard.deprecated(
            "CheckpointManager.save(epoch, ...)",
            "manager.checkpoint('epoch') after state.end_epoch(epoch, world_size) "
            "(StepGuard.end_epoch does both)",
        )
        self._bound("save", _objects(objects, options), False).end_epoch(
            epoch, get_world_size(), step
        )
        return self.checkpoint("epoch", **options)

    def save_step(
        self,
        position: Position,
        *objects: Any,
        kind: str = "step",
        loop: Any = None,
        **options: Any,
    ) -> Path | str | None:
        """Deprecated (0.1): ``state.advance(position, loop=...)``, then ``checkpoint(kind)``.

        ``kind`` is ``"step"`` or ``"interrupted"``; ``loop`` None keeps the
        state's; ``objects`` and ``options`` as in :meth:`save`. Removed in 0.3.
        """
        _graveyard.deprecated(
            "CheckpointManager.save_step(position, ...)",
            "manager.checkpoint('step') after state.advance(position, loop=...) "
            "(StepGuard.after_step does both)",
        )
        if kind not in ("step", "interrupted"):
            raise ValueError(f"kind must be 'step' or 'interrupted', got {kind!r}")
        state = self._bound("save_step", _objects(objects, options), False)
        held = state.loop if loop is None else loop
        state.advance(position, loop=held, loader_state=state.loader_state)
        return self.checkpoint(kind, **options)

    def checkpoint(
        self,
        kind: str,
        *,
        metrics: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        block: bool = True,
    ) -> Path | str | None:
        """Write the bound state as it is: the one path of every save. All ranks must call this.

        ``kind`` is ``"epoch"`` (``latest.pth``; the state's position is the
        start of the next epoch), ``"step"`` (``step-<n>.pth``) or
        ``"interrupted"`` (``interrupted.pth``); the file records the objects,
        the position, every rank's RNG state and PowerSGD state (``wrap_ddp(...,
        comm_hook="powersgd")``), ``loop`` (the step kinds) and
        ``extra`` (the manager's, the state's, then this call's).

        Args:
            kind: one of :data:`KINDS`.
            metrics: (``"epoch"``) the same on every rank: ``acc1`` names the
                weight file and picks ``best.pth`` (without it: named by epoch
                alone, ``{prefix}-epoch{N}.pth``, and no ``best.pth``); ``loss`` and
                the rest are stored. With an average and an ``ema_acc1`` above
                ``acc1``, the weight file holds the average's weights and is
                named (and ranked) by ``ema_acc1``.
            extra: anything else to store in this file, weights_only-loadable.
            block: wait until the files are written. With False, return once the
                state is copied to host memory (reusing the last such copy, kept
                until :meth:`flush`); the next save, :meth:`wait` and
                :meth:`resume` wait for the write.

        Returns:
            The file's path on the ranks that write (with a store, its URL), None
            on the others.

        Raises:
            TypeError: no state is bound, or ``metrics`` or ``extra`` hold
                something that cannot be loaded back; nothing is written.
            ValueError: an unknown ``kind``.
            OSError: (writing ranks, ``block=True``) writing failed.
            Rank0Error: (other ranks, ``block=True``) rank 0 failed to write.
            CheckpointError: an earlier background write failed on some rank.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        state = self._bound("checkpoint", {})
        position = state.position
        epoch = position.epoch - 1 if kind == "epoch" else position.epoch
        loop = dict(state.loop) if kind != "epoch" else None
        # A stream's place: this rank's, mid-epoch only (an epoch starts its stream afresh).
        loader, unsaveable = _loader_state(state.loader_state if kind != "epoch" else None)
        self._writer.join()  # at most one write in flight
        failed = self._writer.error
        patient = self.store is not None
        hook = comm_hook_of(state.model)
        stateful = hook is not None and hook.state is not None
        gathered = all_gather_object(
            (
                capture_rng_state(),
                loop,
                loader,
                unsaveable,
                describe_error(failed),
                self.writes,
                stateful,
            ),
            patient=patient,
        )
        raise_earlier_failure(failed, [g[4] for g in gathered], self._writer)
        hooks = None  # every rank's PowerSGD state, on the ranks that write only
        if any(g[6] for g in gathered):
            mine = hook.state_dict() if hook is not None else None
            for writer in (rank for rank, g in enumerate(gathered) if g[5]):
                hooks = gather_object(mine, writer, patient=patient) or hooks
        for rank, (*_, why, _error, _writes, _stateful) in enumerate(gathered):
            if why is not None:
                raise TypeError(
                    f"rank {rank}'s training loader state cannot be saved in a checkpoint: {why}. "
                    "A loader's state_dict() must hold tensors, numbers, strings, None and "
                    "dicts, lists or tuples of them; nothing was written"
                )
        metrics = dict(metrics or {})
        extra = {**self.extra, **state.extra, **(extra or {})}
        check_saveable({"metrics": metrics, "extra": extra})  # the same on all ranks
        if self._generation is None and self.claim():  # this job's files, never resumed
            raise CheckpointError(
                f"{self.location} holds this torchrun job's checkpoints (--rdzv-id "
                f"{launcher_job()}), and this process saves without having resumed them: it "
                "would train afresh over the job's progress. Resume first (fit(resume=True), "
                "StepGuard.resume, CheckpointManager.resume()), or give a new job its own "
                "--rdzv-id. " + see("a-server-leaves-or-joins")
            )
        assert self._generation is not None
        acc1 = float(metrics["acc1"]) if "acc1" in metrics else None
        # The weight file holds the better of the model and its average, as measured.
        averaged = state.ema is not None and "ema_acc1" in metrics
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
        path: Path | str | None = None
        error: BaseException | None = None
        gather = self.on_each_node and get_world_size() > 1
        pieces = state.capture(gather)
        if self.writes:
            record = {
                "format": FORMAT,
                "version": VERSION,
                "kind": kind,
                "snapshot": f"g{self._generation}-s{position.step}-e{epoch}-{kind}",
                "generation": self._generation,
                "epoch": epoch,
                "position": position.as_dict(),
                "acc1": acc1,
                "loss": float(metrics["loss"]) if "loss" in metrics else None,
                "lr": state.learning_rate(),
                **pieces,
                "weights": "ema" if use_ema else "model",
                "world_size": get_world_size(),
                "job": launcher_job(),
                "ddpkit": __version__,
                "rng": [g[0] for g in gathered],
                "loop": [g[1] for g in gathered],
                "loader": [g[2] for g in gathered],
                "comm_hook": hooks,
                "metrics": metrics,
                "extra": extra,
                "best_acc1": best[0],
                "best_epoch": best[1],
            }
            path = self.latest_path if kind == "epoch" else self._path_of(kind, position.step)
            if self.store is not None:
                path = self.store.where(path.name)
            sides = self._sides()
            if block:
                try:
                    self._write(record, improved, sides)
                except Exception as exc:
                    error = exc
            else:  # training changes the originals from here on: write a copy
                # The last copy's write is done (joined above): its host memory is reused.
                self._spare = snapshot(record, reuse=self._spare)
                self._writer.submit(functools.partial(self._write, self._spare, improved, sides))
        if block:
            share_outcome(error, kind, patient=self.store is not None)
        self.best_acc1, self._best_epoch = best
        self.clock.restart()  # every_minutes counts from the last save, any kind
        return path

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
        reports = all_gather_object(describe_error(failed), patient=self.store is not None)
        raise_earlier_failure(failed, reports, self._writer)

    def claim(self) -> bool:
        """Make the directory (or the store's prefix) this fresh run's, before it trains.

        Refuses another run's files there, or with ``overwrite`` deletes them;
        for a store, checks first that it can be reached and written, so a wrong
        bucket, credentials or endpoint fail now, within seconds. ``fit`` and
        ``StepGuard.resume`` call this at the start of a fresh run; the first
        save does otherwise. All ranks must call this, or it deadlocks.

        Returns:
            True, touching nothing, when the newest checkpoint there was saved by
            this same launcher job (``torchrun --rdzv-id``): torchrun started
            the workers again after a server joined or left, which it does not
            count as a restart; resume (:meth:`resume`) instead. False when
            the directory is now this fresh run's.

        Raises:
            CheckpointError: another run's files are there (and not
                ``overwrite``), or the store cannot be used; on every rank.
        """
        job = launcher_job()
        if self.store is None:
            if claim_directory(
                self.directory, writes=self.writes, overwrite=self.overwrite, job=job
            ):
                return _continuing(job)
            self._generation = next_generation(self.directory)
            return False
        store, overwrite = self.store, self.overwrite
        other = shared(lambda: store.claim(overwrite, job))
        if other is True:
            return _continuing(job)
        if other is not None:
            raise CheckpointError(
                f"{self.url} holds another run's checkpoints: {other}. A fresh run would "
                "replace them. Continue that run (fit(resume=True), --resume), use another "
                "prefix, or pass CheckpointManager(overwrite=True) (--overwrite) to delete them. "
                + see("a-directory-holds-another-run")
            )
        self._generation = 1
        return False

    @property
    def latest(self) -> str:
        """Where ``latest.pth`` is: ``latest_path``, or with a store its URL."""
        return self.store.where(LATEST) if self.store is not None else str(self.latest_path)

    def best(self) -> str | None:
        """Where ``best.pth`` is (a path or a URL), or None: none written yet (rank 0's view)."""
        if self.store is not None:
            return self.store.where(BEST) if BEST in self.store.files else None
        path = self.directory / BEST
        return str(path) if path.exists() else None

    def _path_of(self, kind: str, step: int) -> Path:
        return self.interrupted_path if kind == "interrupted" else self.directory / step_name(step)

    def _sides(self) -> dict[str, bytes]:
        """(A store, rank 0) the side files as they are now, read before training changes them."""
        if self.store is None or get_rank() != 0:
            return {}
        sides = {}
        for name in SIDE_FILES:
            try:
                sides[name] = (self.directory / name).read_bytes()
            except FileNotFoundError:
                continue
        return sides

    def _write(self, state: dict[str, Any], improved: bool, sides: dict[str, bytes]) -> None:
        rules: dict[str, Any] = {
            "prefix": self.prefix,
            "keep_last": self.keep_last,
            "keep_steps": self.keep_steps,
            "best": improved,
            "rotate": not self._latest_damaged,  # a damaged latest.pth must not become previous.pth
        }
        if self.store is not None:  # the same files and rules, uploaded and committed
            self.store.save(state, self.directory, sides=sides, **rules)
        else:
            write_files(self.directory, state, **rules)
        if state["kind"] == "epoch":
            self._latest_damaged = False

    def newest_extra(self) -> tuple[str, dict[str, Any]] | None:
        """The file name and ``extra`` of the checkpoint :meth:`resume` would take, or None.

        Read before the resume, without loading its tensors (to compare a run's
        settings with the one it continues). A collective: all ranks call it.
        """
        if self.store is not None:
            store = self.store
            newest = shared(store.newest)
            return None if newest is None else (newest["checkpoint"], dict(newest["extra"]))
        return newest_extra(self.directory)

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
        is skipped, with a warning, for the next newest. Restores the bound
        state's objects and progress (its position; on the number of ranks
        that saved it, this rank's totals and stream place), this rank's RNG
        state, :attr:`best_acc1` and :attr:`resumed`. All ranks must call
        this, or it deadlocks.

        Args:
            model: deprecated, as in :meth:`save` (and ``optimizer``, ``scheduler``,
                ``scaler``, ``ema``); an object of the bound state that is None is
                not restored.
            path: resume from this file (on any rank's file system) instead
                of the newest; later saves start a new generation.
            map_location: where loaded tensors go first.
            strict_rng: refuse a checkpoint saved by a different number of ranks,
                whose RNG states cannot be matched to these; with False, resume
                without restoring RNG state, with a warning.

        Returns:
            The epoch to start in: the saved epoch + 1 after an epoch
            checkpoint, the epoch in progress after a step checkpoint (the
            state's ``position`` says how far into it), 0 when there is none.

        Raises:
            CheckpointError: no checkpoint is loadable, ``path`` is none on any rank (said what
                it is), a part asked for is missing, the position or RNG states are malformed,
                the model differs (keys named), or the world size changed with ``strict_rng``.

        Example:
            >>> start_epoch = manager.resume()
        """
        given = {"scheduler": scheduler, "scaler": scaler, "ema": ema}
        training = self._bound("resume", {"model": model, "optimizer": optimizer, **given})
        self._writer.join()
        if self.store is not None and (path is None or _in_store(self.store.url, path)):
            named = None if path is None else os.fspath(path)
            agreed = load_remote(self.store, named, self.directory, map_location)
            where = self.store.where(agreed.found.name) if agreed.found is not None else ""
        else:
            if self.store is not None:  # a local file: later saves go on after the store's commits
                store = self.store
                shared(lambda: bool(store.load_layout()[0]))
            local = Path(path) if path is not None else None
            agreed = load_newest(self.directory, local, map_location)
            where = str(path or self.directory / (agreed.found.name if agreed.found else ""))
        self._latest_damaged = agreed.latest_damaged
        self.resumed_from, self.resumed_checkpoint = agreed.file, None
        if agreed.state is None or agreed.found is None:
            self._generation = agreed.generation + 1
            self.resumed = None
            return 0
        self.resumed_checkpoint = where
        _check_joined(agreed.state, where, self.extra)
        restored = restore_state(
            agreed.state, agreed.found, training, strict_rng, where=self.resumed_checkpoint
        )
        self.resumed, self.resumed_extra = restored, restored.extra or {}
        self.best_acc1, self._best_epoch = restored.best_acc1, restored.best_epoch
        rank, world = get_rank(), get_world_size()
        loop, loader = restored.loop or [], restored.loader or []
        mine = loop[rank] if len(loop) == world else None
        training.advance(
            restored.position,
            loop=mine if isinstance(mine, dict) else None,
            loader_state=loader[rank] if len(loader) == world else None,
        )
        # An explicit file may be older than the newest: what follows is a new line of saves.
        self._generation = agreed.generation + 1 if path is not None else agreed.found.generation
        self.clock.restart()
        if get_rank() == 0:
            logger.info(
                "resuming from %s (read on rank %d)", agreed.found.describe(), agreed.source
            )
        return restored.position.epoch


def _check_joined(state: Mapping[str, Any], where: str, extra: Mapping[str, Any]) -> None:
    """Every rank may train on from ``state``: the same ddpkit and the checkpoint's ``extra``.

    A collective. A server whose ranks alone differ joined with something the
    run does not have: it is refused (:func:`refuse_strangers`) and the others
    go on; the same difference on every server is the run's own: a resume
    with other settings is refused as ever, another ddpkit on all of them is
    an upgrade.

    Raises:
        CheckpointError: every server's settings differ from the checkpoint's.
        JoinRefused: some servers differ from the others.
    """
    versions = all_gather_object(__version__)
    saved = state.get("ddpkit")
    if len(set(versions)) > 1:
        wanted = saved if saved in versions else versions[0]
        mine = None
        if __version__ != wanted:
            mine = f"ddpkit {__version__}, and the run trains with ddpkit {wanted}"
        refuse_strangers(mine)
    problem = None
    saved_extra = state.get("extra")
    try:
        check_extra(where, saved_extra if isinstance(saved_extra, dict) else {}, extra)
    except CheckpointError as exc:
        problem = str(exc)
    agreed = refuse_strangers(problem)
    if agreed is not None:
        raise CheckpointError(agreed)


def _continuing(job: str | None) -> bool:
    if get_rank() == 0:
        logger.info(
            "continuing torchrun job %s from its checkpoints here (its workers started again "
            "after a server joined or left; a new job needs its own --rdzv-id)",
            job,
        )
    return True


def _in_store(url: str, path: str | os.PathLike[str]) -> bool:
    """Whether a resume's ``path`` names a file of the store: its URL, or a checkpoint's name.

    Raises:
        CheckpointError: ``path`` is the URL of another store or prefix.
    """
    text = os.fspath(path)
    if is_url(text):
        if not text.startswith(url + "/"):
            raise CheckpointError(
                f"resume: {text} is not under {url}, this run's store: pass one of its files "
                f"({url}/latest.pth, step-<n>.pth ...) or a local path. " + see("checkpoints")
            )
        return True
    return "/" not in text and is_run_file(text)


def _cache_dir(url: str) -> Path:
    """This node's directory for a store's checkpoints on their way: under the user's cache."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ddpkit" / "checkpoints" / url.split("://", 1)[1].replace(":", "_")


def _objects(objects: tuple[Any, ...], options: dict[str, Any]) -> dict[str, Any]:
    """The objects a call of 0.1's form passed (positional or by name), checked before any change.

    Raises:
        TypeError: more than four objects, one given twice, or an unknown keyword.
    """
    named = {k: options.pop(k) for k in (*_PIECES, "ema") if k in options}
    twice = [k for k in _PIECES[: len(objects)] if k in named]
    unknown = sorted(set(options) - {"metrics", "extra", "block"})
    if len(objects) > len(_PIECES) or twice or unknown:
        raise TypeError(
            "CheckpointManager.save / save_step take the objects model, optimizer, scheduler, "
            f"scaler (each once) and metrics=, extra=, block=, ema=; got {len(objects)} "
            f"objects, twice: {twice}, unknown: {unknown}"
        )
    return {**dict(zip(_PIECES, objects, strict=False)), **named}


_PIECES = ("model", "optimizer", "scheduler", "scaler")


def _loader_state(state: Any) -> tuple[Any, str | None]:
    """A loader's state as a checkpoint stores it, or why it cannot be stored."""
    if state is None:
        return None, None
    try:
        return check_saveable(state), None
    except TypeError as exc:
        return None, str(exc).removeprefix("save_checkpoint: ")
