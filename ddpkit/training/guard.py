"""``StepGuard``: ``fit``'s fault tolerance for any training loop, and the one ``fit`` uses.

A loop of your own keeps its forward, ``backward()`` and ``optimizer.step()``;
around them a guard resumes from the newest checkpoint any rank holds, hands
out the rest of the epoch from where it stood (:func:`epoch_batches`: on the
same number of ranks batch for batch, on another the samples not yet seen),
and after each optimizer step asks one question, the same answer on every
rank: is a step checkpoint due (every N steps, or M minutes on rank 0's
clock), and did any rank get a stop signal or fail to write? It saves the
step checkpoint, or ``interrupted.pth`` and raises :class:`Preempted` (exit
status 75). With ``hang_timeout`` a watchdog names a rank that stops making
progress and ends the job with status 124. ``fit`` is built from this class,
so the two cannot drift apart::

    with ddpkit.StepGuard(manager, faults=ddpkit.FaultConfig(hang_timeout=600)) as guard:
        for epoch in range(guard.resume(train_loader), epochs):
            part = guard.batches(train_loader, epoch)
            for images, targets in part:
                loss = criterion(model(images), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                guard.after_step(part)  # counts the step; saves or stops when due
            guard.end_epoch(epoch, metrics={"acc1": evaluate(model, val_loader)["acc1"]})
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from ddpkit._docs import see
from ddpkit.checkpoint import CheckpointManager
from ddpkit.checkpoint.serialization import CheckpointError
from ddpkit.checkpoint.sync import claim_directory
from ddpkit.data.resume import EpochBatches, check_start, data_change, epoch_batches
from ddpkit.data.streams import loader_states_for, state_holder
from ddpkit.distributed import comm
from ddpkit.distributed.job import restore_environ
from ddpkit.distributed.recorder import point_dumps
from ddpkit.distributed.stops import Actions, Preempted, StepControl, Stop
from ddpkit.position import Position
from ddpkit.training.config import FaultConfig

__all__ = ["StepGuard"]

logger = logging.getLogger("ddpkit")

Totals = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None


class StepGuard:
    """Resume, the rest of an epoch, and after each optimizer step: save when due, stop together.

    Use it as a context manager around training, entered on every rank (it
    agrees on a store prefix: a collective). Entering installs the handlers of
    ``faults.stop_signals`` (put back on exit) and, with ``faults.hang_timeout``,
    starts a :class:`~ddpkit.distributed.HangWatchdog`.

    Args:
        checkpoints: where and how often to save; its bound ``TrainingState``
            is what every checkpoint holds (bind one before :meth:`resume`).
            None: nothing is saved, stops still agreed.
        faults: the stop signals, the hang watchdog and what a resume on other
            data does (:class:`FaultConfig`); default ``FaultConfig()``.
        report_dir: where the hang report goes; default ``faults.report_dir``,
            else the checkpoint directory.

    Attributes:
        step: optimizer steps taken so far, over the run (the resumed ones included).
        start: where :meth:`resume` found training, or None.
        loop: this rank's running totals saved with the resumed position
            (``{}`` without), as the last :meth:`after_step` was given them.
        watchdog: the hang watchdog, or None.
    """

    def __init__(
        self,
        checkpoints: CheckpointManager | None = None,
        *,
        faults: FaultConfig | None = None,
        report_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.checkpoints = checkpoints
        self.faults = faults or FaultConfig()
        default = checkpoints.directory if checkpoints is not None else None
        self.report_dir = report_dir or self.faults.report_dir or default
        self.step = 0
        self.start: Position | None = None
        self.loop: dict[str, Any] = {}
        self.watchdog: Any = None
        self.control: StepControl | None = None
        self._world, self._rank = comm.get_world_size(), comm.get_rank()
        self._stack = contextlib.ExitStack()
        self._started: set[int] = set()  # loaders whose persistent workers run
        self._loader_state: Any = None  # the resumed place in a stateful loader's stream

    # -- the context ---------------------------------------------------------------------

    def __enter__(self) -> StepGuard:
        stack = self._stack
        try:
            self.control = stack.enter_context(
                StepControl(  # the one question after every step: save? stop?
                    signals=self.faults.stop_signals,
                    store=_control_store(self._world, self._rank),
                    rank=self._rank,
                    world_size=self._world,
                    cadence=self.checkpoints,  # the manager owns the cadence and its clock
                )
            )
            if self.faults.hang_timeout is not None:
                from ddpkit.distributed.watchdog import HangWatchdog  # its thread: only if asked

                if self.report_dir is not None and _nccl():
                    restore = point_dumps(self.report_dir)  # NCCL's own dump on a timeout
                    stack.callback(restore_environ, restore)
                self.watchdog = stack.enter_context(
                    HangWatchdog(
                        timeout=self.faults.hang_timeout,
                        report_dir=self.report_dir,
                        report_signal=self.faults.report_signal,
                    )
                )
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def progress(self, phase: str) -> None:
        """Tell the hang watchdog (if any) where this rank is, at the current step."""
        if self.watchdog is not None:
            self.watchdog.progress(self.step, phase)

    # -- resume and the epoch's batches ------------------------------------------------------

    def resume(self, loader: Iterable[Any], *, path: str | os.PathLike[str] | None = None) -> int:
        """Restore the newest complete checkpoint any rank holds; return the epoch to start in.

        Restores the manager's bound state (:meth:`CheckpointManager.resume`,
        RNG states only on the number of ranks that saved) and checks the
        position against ``loader``: a mid-epoch position taken on other data
        is refused, or with ``faults.on_data_change="next_epoch"`` moved to the
        next epoch's start (the bound per-epoch scheduler stepped as that
        epoch's end would). A stateful loader's saved place (every rank's, in a
        step checkpoint) is taken for :meth:`batches`; mid-epoch on another
        number of ranks it is refused, unless the state says it may be
        re-split. Without a checkpoint, a fresh run claims the
        directory: another run's files there are refused now, not at the first
        save. All ranks must call this, or it deadlocks.

        Raises:
            CheckpointError: no checkpoint is loadable, the data changed
                (``on_data_change="error"``), the position is beyond this
                loader's epoch, or a stream's places were saved on another
                number of ranks; names the checkpoint.
        """
        manager = self.checkpoints
        if manager is None:
            return 0
        manager.resume(path=path, strict_rng=False)
        start = manager.position
        if start is None:
            claim_directory(manager.directory, writes=manager.writes, overwrite=manager.overwrite)
        elif start.mid_epoch:
            start = self._checked(start, loader)
        self.start, self.step = start, start.step if start is not None else 0
        state = manager.state
        mid = start is not None and start.mid_epoch
        self.loop = dict(state.loop) if state is not None and mid else {}
        self._loader_state = self._place(loader, mid) if start is not None else None
        if state is not None and start is not None:
            state.position = start
        return start.epoch if start is not None else 0

    def _place(self, loader: Iterable[Any], mid: bool) -> Any:
        """This rank's saved place in a stateful loader's stream, checked; None: by position."""
        manager = self.checkpoints
        assert manager is not None
        saved = manager.loader_states
        if not saved or all(s is None for s in saved):
            return None
        if state_holder(loader) is None:
            if mid and self._rank == 0:
                warnings.warn(
                    f"{manager.resumed_checkpoint} holds the training loader's place in its "
                    "stream, but this loader has no load_state_dict(): the batches already done "
                    "are read again and dropped",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return None
        try:
            return loader_states_for(
                saved, self._world, self._rank, mid, str(manager.resumed_checkpoint)
            )
        except ValueError as exc:
            raise CheckpointError(f"{exc}. {see('checkpoints')}") from None

    def _checked(self, start: Position, loader: Iterable[Any]) -> Position:
        manager = self.checkpoints
        assert manager is not None
        name = manager.resumed_checkpoint
        change = data_change(start, getattr(loader, "dataset", None))
        if change is None:
            try:
                check_start(loader, start, self._world)
            except ValueError as exc:
                raise CheckpointError(
                    f"{name} cannot be resumed with this training loader: {exc}. "
                    "Resume with the loader (data, batch size) it was saved with, or "
                    "from another checkpoint. " + see("checkpoints")
                ) from None
            return start
        where = (
            f"{name} stopped in epoch {start.epoch + 1} after {start.samples} samples, and {change}"
        )
        if self.faults.on_data_change == "error":
            raise CheckpointError(
                f"{where}: the rest of that epoch would read some samples twice and others "
                "never. Resume with the data it was saved with, or start at the next epoch on "
                "the new data with fit(faults=FaultConfig(on_data_change='next_epoch')) (the "
                "example's --on-data-change next-epoch). " + see("checkpoints")
            )
        if self._rank == 0:
            warnings.warn(
                f"{where}; as asked (on_data_change='next_epoch'), the rest of epoch "
                f"{start.epoch + 1} is skipped and epoch {start.epoch + 2} starts on the "
                "new data",
                RuntimeWarning,
                stacklevel=4,
            )
        scheduler = manager.state.scheduler if manager.state is not None else None
        if scheduler is not None and not getattr(scheduler, "per_step", False):
            scheduler.step()  # as the skipped epoch's end would have
        return Position(start.epoch + 1, 0, 0, start.step, self._world)

    def batches(self, loader: Iterable[Any], epoch: int) -> EpochBatches:
        """The batches of ``epoch`` still to train on this rank, counted as they are read.

        From the resumed position in its epoch (:func:`ddpkit.epoch_batches`:
        ``build_loader``'s skip the done indices without reading them; on
        another number of ranks the samples not yet seen are dealt out again),
        else the whole epoch. The watchdog hears when this rank waits for a
        batch and when it computes (a loader starting its workers is never timed).
        """
        start = self.start if self.start is not None and self.start.epoch == epoch else None
        place, self._loader_state = (self._loader_state, None) if start else (None, None)
        part = epoch_batches(
            loader, epoch, start, world_size=self._world, rank=self._rank, loader_state=place
        )
        manager = self.checkpoints
        if place is not None and manager is not None and manager.state is not None:
            manager.state.loader_state = None  # used: a later save records its own place
        if self.watchdog is not None:
            # The rest of a resumed epoch may come from a loader of its own, with its workers.
            source = part.batches if isinstance(part.batches, DataLoader) else loader
            part.batches = self.watched(source, part.batches, "data", "compute")
        return part

    def watched(
        self, loader: Any, batches: Iterable[Any], waiting: str, busy: str
    ) -> Iterator[Any]:
        """``batches`` (of ``loader``), telling the watchdog when this rank waits for them.

        ``waiting`` before each batch, ``busy`` once it is here. A ``DataLoader``
        starts its workers in ``iter()``, and batch ``k`` comes from worker ``k``:
        until one batch came from each worker (each imported, ran its
        ``worker_init_fn``, fetched), the phase is ``"start_" + waiting``; after
        the last batch of workers that are not persistent, while the iterator
        joins them, ``"end_" + waiting``. The watchdog times neither.
        """
        starting = self._starts_workers(loader)
        ending = _ending_workers(loader)
        self.progress(f"start_{waiting}" if starting else waiting)
        for count, batch in enumerate(batches, 1):
            self.progress(busy)
            yield batch
            phase = "start_" if count < starting else "end_" if count == ending else ""
            self.progress(phase + waiting)
        self.progress(busy)  # what follows the last batch (the totals' all-reduce) is the work

    def _starts_workers(self, loader: Any) -> int:
        """How many workers iterating ``loader`` starts (persistent ones start once)."""
        if not isinstance(loader, DataLoader) or loader.num_workers == 0:
            return 0
        if loader.persistent_workers:
            if id(loader) in self._started:
                return 0
            self._started.add(id(loader))
        return loader.num_workers

    # -- between steps, and at an epoch's end -----------------------------------------------

    def after_step(self, part: EpochBatches | Position, *, loop: Totals = None) -> Actions:
        """After each optimizer step: count it, then save a step checkpoint or stop, if asked.

        ``part``: the epoch's :class:`EpochBatches` (the position is built from
        what it has yielded, with this step's number), or the step's
        :class:`Position`. Every rank asks once, the same answer everywhere:
        a step checkpoint is due (the manager's ``every_steps``; its
        ``every_minutes`` on rank 0's clock) or a stop was asked on some rank
        (a stop signal, a failed background write). A due checkpoint is saved
        in the background (none after the epoch's last batch: the epoch's own
        follows); a stop saves ``interrupted.pth`` and raises. ``loop``: this
        rank's running totals of the epoch (or a function that gives them,
        called only when a checkpoint is written), saved with the position.
        All ranks must call this after the same steps, or it deadlocks.

        Returns:
            What was decided (``save``; ``stop`` is never returned: it raises).

        Raises:
            Preempted: a stop signal on some rank: every rank stopped after this
                step, ``interrupted.pth`` written (exit status 75 uncaught).
            CheckpointError: a background checkpoint write failed on some rank.
        """
        assert self.control is not None, "use the StepGuard as a context manager"
        if isinstance(part, EpochBatches):
            self.step += 1
            position, last = part.position(self.step), part.last
        else:
            self.step, position, last = part.step, part, False
        self.progress("done")
        manager = self.checkpoints
        if manager is not None and manager.write_error is not None:
            error = manager.write_error
            self.control.request_stop(f"rank {self._rank}: {type(error).__name__}: {error}")
        actions = self.control.after_step(self.step)
        if actions.stop is not None:
            if manager is not None:
                _keep_place(manager, part)
            self._stop(actions.stop, position, loop)
        if manager is not None and actions.save and not last:
            self.progress("save")
            _keep_place(manager, part)
            manager.save_step(position, loop=_totals(loop), block=False)
        return actions

    def end_epoch(self, epoch: int, metrics: Mapping[str, Any] | None = None) -> None:
        """After an epoch: its checkpoint (in the background), then a stop if any rank asked.

        The bound state's position becomes the next epoch's start. A stop here
        costs no extra step: the epoch's checkpoint is the one to resume from.
        All ranks must call this, or it deadlocks.

        Raises:
            Preempted: a stop signal arrived on some rank during the epoch's end.
            CheckpointError: a background checkpoint write failed on some rank.
        """
        assert self.control is not None, "use the StepGuard as a context manager"
        manager = self.checkpoints
        if manager is not None:
            self.progress("save")
            if manager.state is not None:
                data = manager.state.position.data_size, manager.state.position.data_digest
                manager.state.position = Position(epoch + 1, 0, 0, self.step, self._world, *data)
                manager.state.loader_state = None  # the next epoch starts its stream afresh
            manager.checkpoint("epoch", metrics=metrics, block=False)
        stop = self.control.stop_at_epoch_end()
        if stop is not None:
            self._stop(stop, None, None)

    def _stop(self, stop: Stop, position: Position | None, loop: Totals) -> None:
        """End training on every rank: ``interrupted.pth`` for a signal mid-epoch; raise."""
        manager = self.checkpoints
        if stop.kind == "error":
            if manager is not None:
                manager.wait()  # the rank whose write failed raises its own error here
            raise CheckpointError(
                f"a checkpoint write failed ({stop.detail}), so every rank stops; the "
                "checkpoints written before it are intact. " + see("checkpoints")
            )
        path = None
        if manager is not None:
            if position is not None:
                path = manager.save_step(position, kind="interrupted", loop=_totals(loop))
            else:
                manager.flush()
                path = manager.latest_path if manager.writes else None
        logger.warning(
            "stopped by %s after step %d%s; resume to continue (exit status %d)",
            stop.detail,
            self.step,
            f", checkpoint {path}" if path is not None else "",
            Preempted(stop.detail).code,
        )
        raise Preempted(stop.detail, str(path) if path is not None else None, self.step)


def _keep_place(manager: CheckpointManager, part: EpochBatches | Position) -> None:
    """Put this rank's place in a stateful loader's stream into the bound state, to be saved."""
    if isinstance(part, EpochBatches) and part.holder is not None and manager.state is not None:
        manager.state.loader_state = part.loader_state()


def _totals(loop: Totals) -> Any:
    return loop() if callable(loop) else loop


def _ending_workers(loader: Any) -> int | None:
    """After which batch a ``DataLoader``'s iterator stops its workers; None: never, or unknown."""
    if not isinstance(loader, DataLoader) or loader.num_workers == 0 or loader.persistent_workers:
        return None
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without a length
        return None


def _nccl() -> bool:
    """Whether the default process group is NCCL's (whose own dump on a timeout is pointed)."""
    return dist.is_initialized() and dist.get_backend() == "nccl"


def _control_store(world: int, rank: int) -> Any:
    """The store every rank shares, under a prefix new to this run (one collective)."""
    if world <= 1 or not dist.is_initialized():
        return None
    token = comm.all_gather_object(secrets.token_hex(8) if rank == 0 else None)[0]
    return dist.PrefixStore(f"ddpkit/fit/{token}/", dist.distributed_c10d._get_default_store())
