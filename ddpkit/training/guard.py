"""``StepGuard``: the one training step and ``fit``'s fault tolerance, for any training loop.

A loop of your own keeps its forward and loss; :meth:`StepGuard.forward` is
their context (autocast, DDP's ``no_sync`` while an accumulation window is
open) and :meth:`StepGuard.backward` the rest of the step, the one optimizer
step of ddpkit (``fit``'s too), then one question, the same answer on every
rank: save a step checkpoint, or stop (a signal, a failed write: every rank
after the same step, ``interrupted.pth``, :class:`Preempted`)? Around the
epochs the guard resumes, hands out the rest of an epoch, runs the hang
watchdog, and at the block's end waits for every checkpoint it started::

    state = ddpkit.TrainingState(model, optimizer, ema=ema)
    manager = ddpkit.CheckpointManager("runs/exp", state=state, every_steps=500)
    config = ddpkit.TrainConfig(amp="bf16", grad_accum=2, clip_grad_norm=1.0)
    with ddpkit.StepGuard(manager, config=config) as guard:
        for epoch in range(guard.resume(train_loader), epochs):
            part = guard.batches(train_loader, epoch)
            for images, targets in part:
                with guard.forward(part):
                    loss = criterion(model(images), targets)
                guard.backward(loss, part)  # the optimizer step when the window closes
            guard.end_epoch(epoch, metrics={"acc1": evaluate(model, val_loader)["acc1"]})
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit._docs import see
from ddpkit.checkpoint import CheckpointManager
from ddpkit.checkpoint.cadence import SaveClock
from ddpkit.checkpoint.serialization import CheckpointError
from ddpkit.checkpoint.state import TrainingState
from ddpkit.data.resume import EpochBatches, epoch_batches, inexact_resume, resume_verdict
from ddpkit.data.streams import EPOCH_SEEDS, loader_states_for, state_holder
from ddpkit.distributed import comm
from ddpkit.distributed.devices import module_device
from ddpkit.distributed.parallel import no_sync, unwrap_model
from ddpkit.distributed.stops import Actions, Preempted, StepControl, Stop
from ddpkit.position import Position
from ddpkit.training.config import FaultConfig, TrainConfig
from ddpkit.training.evaluation import autocast

if TYPE_CHECKING:  # its thread starts only when asked for
    from ddpkit.distributed.watchdog import HangWatchdog

__all__ = ["StepGuard"]

logger = logging.getLogger("ddpkit")

Totals = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None


class StepGuard:
    """The training step, resume, the rest of an epoch, saves when due, stopping together.

    Use it as a context manager around training, entered on every rank (it
    agrees on a store prefix: a collective). Entering installs the handlers of
    ``faults.stop_signals`` (put back on exit) and, with ``faults.hang_timeout``,
    starts a :class:`~ddpkit.distributed.HangWatchdog`. Leaving it, normally or
    by an exception, waits until every checkpoint it started is on disk
    (each rank its own write, alone; normally, its failure is raised).

    The run's progress lives in the :class:`~ddpkit.checkpoint.TrainingState`
    only; the guard reads and advances it there.

    Args:
        checkpoints: where and how often to save; its bound ``TrainingState``
            is what every checkpoint holds (bind one before :meth:`resume`).
            None: nothing is saved, stops still agreed.
        state: the training state; default the manager's (given, it is bound
            to the manager).
        config: how each step runs (:class:`~ddpkit.TrainConfig`); with
            ``amp="fp16"`` a GradScaler joins a state that has none.
        faults: the stop signals, the hang watchdog and what a resume on other
            data does (:class:`FaultConfig`); default ``FaultConfig()``.
        report_dir: where the hang report goes; default ``faults.report_dir``,
            else the checkpoint directory.

    Attributes:
        watchdog: the hang watchdog, or None.
    """

    def __init__(
        self,
        checkpoints: CheckpointManager | None = None,
        *,
        state: TrainingState | None = None,
        config: TrainConfig | None = None,
        faults: FaultConfig | None = None,
        report_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if state is not None and checkpoints is not None and checkpoints.state is not state:
            checkpoints.bind(state)  # the manager saves what the guard trains
        self.checkpoints, self.config = checkpoints, config or TrainConfig()
        self.faults = faults or FaultConfig()
        default = checkpoints.directory if checkpoints is not None else None
        self.report_dir = report_dir or self.faults.report_dir or default
        self.watchdog: HangWatchdog | None = None
        self.control: StepControl | None = None
        self._state, self._own = state, TrainingState(nn.Identity())  # _own: progress only
        self._world, self._rank = comm.get_world_size(), comm.get_rank()
        self._stack = contextlib.ExitStack()
        self._plain: Any = None  # without fp16: a disabled GradScaler, which steps plainly
        self._handed: int | None = None  # the epoch batches() last handed out

    @property
    def state(self) -> TrainingState:
        """The run's one bag: ``state=``, else the manager's bound one (else progress only)."""
        bound = self.checkpoints.state if self.checkpoints is not None else None
        return self._state or bound or self._own

    @property
    def step(self) -> int:
        """Optimizer steps taken so far, over the run (the resumed ones included): the state's."""
        return self.state.position.step

    # -- the context ---------------------------------------------------------------------

    def __enter__(self) -> StepGuard:
        if self.control is not None:  # a second exit would put the default handlers back
            raise RuntimeError("this StepGuard is entered already: use one with-block for it")
        stack = self._stack
        try:
            self.control = stack.enter_context(
                StepControl(  # the one question after every step: save? stop?
                    signals=self.faults.stop_signals,
                    store=StepControl.shared_store(self._world, self._rank),
                    rank=self._rank,
                    world_size=self._world,
                )
            )
            self._plain = torch.amp.GradScaler(self._device().type, enabled=False)
            self._fp16_scaler()
            if self.faults.hang_timeout is not None:
                from ddpkit.distributed.watchdog import HangWatchdog  # its thread: only if asked

                self.watchdog = stack.enter_context(
                    HangWatchdog(
                        timeout=self.faults.hang_timeout,
                        report_dir=self.report_dir,
                        report_signal=self.faults.report_signal,
                    )
                )
        except BaseException:
            stack.close()
            self.control = self.watchdog = None
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc_info: object) -> None:
        self._stack.close()
        self.control = self.watchdog = None
        if self.checkpoints is not None:  # on disk: this rank's write, alone (a rank may be gone)
            self.checkpoints.wait(raise_error=kind is None)

    def progress(self, phase: str) -> None:
        """Tell the hang watchdog (if any) where this rank is, at the current step."""
        if self.watchdog is not None:
            self.watchdog.progress(self.step, phase)

    # -- resume and the epoch's batches ------------------------------------------------------

    def resume(self, loader: Iterable[Any], *, path: str | os.PathLike[str] | None = None) -> int:
        """Restore the newest complete checkpoint any rank holds; return the epoch to start in.

        Restores the state (:meth:`CheckpointManager.resume`; RNG states on the
        number of ranks that saved) and checks its position against ``loader``:
        a mid-epoch position on other data is refused, or with
        ``faults.on_data_change="next_epoch"`` moved to the next epoch's start
        (a per-epoch scheduler stepped). A stateful loader's saved place goes to
        :meth:`batches` (on another number of ranks, refused unless it may be
        re-split). Without a checkpoint, another run's files in the directory
        are refused now. All ranks must call this, or it deadlocks.

        Raises:
            CheckpointError: no checkpoint is loadable, the data changed
                (``on_data_change="error"``), the position is beyond this
                loader's epoch, or a stream's places were saved on another
                number of ranks; names the checkpoint.
        """
        manager = self.checkpoints
        if manager is None:
            return 0
        self._fp16_scaler()  # before the restore, which fills it
        manager.resume(path=path, strict_rng=False)
        if manager.resumed is None:
            manager.claim()
            return 0
        state = self.state
        start = state.position
        if start.mid_epoch:
            start = self._checked(start, loader)
        mid = start.mid_epoch
        place = self._place(loader, mid)
        state.advance(start, loop=state.loop if mid else None, loader_state=place)
        why = inexact_resume(loader, start, place)
        if why is not None and self._rank == 0:
            warnings.warn(f"{manager.resumed_checkpoint}: {why}", RuntimeWarning, stacklevel=2)
        return start.epoch

    def _place(self, loader: Iterable[Any], mid: bool) -> Any:
        """This rank's saved place in a stateful loader's stream, checked; None: by position."""
        manager = self.checkpoints
        assert manager is not None
        assert manager.resumed is not None
        saved = manager.resumed.loader
        if not saved or all(s is None for s in saved):
            return None
        if all(isinstance(s, Mapping) and EPOCH_SEEDS in s for s in saved):
            # A plain DataLoader's seeds: this rank's, on the ranks that drew them.
            return saved[self._rank] if mid and len(saved) == self._world else None
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
        change, misfit = resume_verdict(loader, start, self._world, self._rank)
        if misfit is not None:
            raise CheckpointError(
                f"{name} cannot be resumed with this training loader: {misfit}. Resume with "
                "the loader (data, batch size) it was saved with, or from another checkpoint. "
                + see("checkpoints")
            )
        if change is None:
            return start
        where = (
            f"{name} stopped in epoch {start.epoch + 1} after {start.samples} samples, and {change}"
        )
        if self.faults.on_data_change == "error":
            raise CheckpointError(
                f"{where}: the rest of that epoch would read some samples twice and others "
                "never. Resume with the data it was saved with (and its seed), or start at the "
                "next epoch on the new data with fit(faults=FaultConfig(on_data_change="
                "'next_epoch')) (the example's --on-data-change next-epoch). " + see("checkpoints")
            )
        if self._rank == 0:
            warnings.warn(
                f"{where}; as asked (on_data_change='next_epoch'), the rest of epoch "
                f"{start.epoch + 1} is skipped and epoch {start.epoch + 2} starts on the "
                "new data",
                RuntimeWarning,
                stacklevel=4,
            )
        scheduler = self.state.scheduler
        if scheduler is not None and not self.per_step:
            scheduler.step()  # as the skipped epoch's end would have
        return Position(start.epoch + 1, 0, 0, start.step, self._world)

    def batches(self, loader: Iterable[Any], epoch: int) -> EpochBatches:
        """The batches of ``epoch`` still to train on this rank, counted as they are read.

        From the state's position when it stands in ``epoch`` (a resume;
        :func:`ddpkit.epoch_batches`), else the whole epoch; watched by the
        watchdog (:meth:`watched`).
        """
        state, at, fresh = self.state, self.state.position, self._handed != epoch
        self._handed = epoch  # a second call in the epoch is the whole epoch, not a resume
        start = at if fresh and at.epoch == epoch and at.mid_epoch else None
        place = state.loader_state if start is not None else None
        if start is not None:  # a resume may read the done batches again first: not a hang
            self.progress("start_data")
        part = epoch_batches(
            loader, epoch, start, world_size=self._world, rank=self._rank, loader_state=place
        )
        if self.watchdog is not None:
            # The rest of a resumed epoch may come from a loader of its own, with its workers.
            source = part.batches if isinstance(part.batches, DataLoader) else loader
            # Read past the agreed end (to count what this rank drops): not a hang.
            part.batches = self.watched(source, part.batches, "data", "compute", lambda: part.last)
        return part

    def watched(
        self, loader: Any, batches: Iterable[Any], waiting: str, busy: str, ended: Any = None
    ) -> Iterable[Any]:
        """``batches`` (of ``loader``), telling the watchdog (if any) when this rank waits for them.

        :meth:`~ddpkit.distributed.HangWatchdog.watch`, at this guard's step count.
        """
        if self.watchdog is None:
            return batches
        return self.watchdog.watch(loader, batches, lambda: self.step, waiting, busy, ended)

    # -- the step ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def forward(self, part: EpochBatches) -> Iterator[None]:
        """The context of one micro-batch's forward and loss (the batch ``part`` just yielded).

        ``config.amp``'s autocast, and DDP's ``no_sync`` while the accumulation
        window stays open, so that backward all-reduces nothing until the
        window's last micro-batch. A forward outside it is correct, only slower
        with ``grad_accum`` > 1 (every micro-batch all-reduces).
        """
        model, amp = self._stepping().model, self.config.amp
        with no_sync(model, enabled=not self._closes(part)), autocast(self._device(), amp):
            yield

    def backward(self, loss: torch.Tensor, part: EpochBatches, *, loop: Totals = None) -> bool:
        """Backward for one micro-batch; on the window's last one, the optimizer step.

        ``loss`` is divided by the micro-batches of its step (``grad_accum``,
        fewer in an epoch's short last window) and backpropagated through the
        GradScaler. The window closes every ``grad_accum`` micro-batches and at
        the epoch's last; then the one optimizer step of ddpkit: unscale and
        clip, step, zero the gradients, update the EMA, step a per-step
        scheduler, :meth:`after_step` (``loop`` goes to it). All ranks must call
        this for the same micro-batches.

        Returns:
            Whether an optimizer step was taken.

        Raises:
            Preempted, CheckpointError: as :meth:`after_step`.
            TypeError: the state has no optimizer.
        """
        state, accum, batch = self._stepping(), self.config.grad_accum, part.done - 1
        # The step's window: every accum batches of the epoch, from the part's first at most.
        first = max(batch - batch % accum, part.first)
        end = batch - batch % accum + accum
        count = (end if part.total is None or not part.exact else min(end, part.total)) - first
        scaler = state.scaler or self._plain  # fp16's, else a disabled one: one path
        # Dividing by 1 would add a kernel and an autograd node to every step.
        scaler.scale(loss / count if count > 1 else loss).backward()
        if not self._closes(part):
            return False
        held = batch - first + 1  # micro-batches in this step
        if held < count:  # an unsized epoch ended early: the mean of those it holds
            _scale_gradients(state.model, count / held)
        self._optimizer_step(scaler)
        self.after_step(part, loop=loop)
        return True

    def _closes(self, part: EpochBatches) -> bool:
        """Whether the micro-batch ``part`` just yielded closes an accumulation window."""
        return part.done % self.config.grad_accum == 0 or part.last

    def _stepping(self) -> TrainingState:
        """The state a step trains, checked: entered, with an optimizer (fp16: a GradScaler)."""
        self._control()
        state = self.state
        if state.optimizer is None:
            raise TypeError(
                "StepGuard.forward() / backward() step the state's optimizer, and it has none: "
                "bind TrainingState(model, optimizer, ...) to the CheckpointManager or pass state="
            )
        if state.scaler is None and self.config.amp == "fp16":
            self._fp16_scaler()
        return state

    def _fp16_scaler(self) -> None:
        """With fp16, a GradScaler in a state that has none (so it is saved and restored)."""
        state, manager = self.state, self.checkpoints
        if self.config.amp != "fp16" or state.scaler is not None or state is self._own:
            return
        state.scaler = torch.amp.GradScaler(self._device().type)
        if manager is not None and manager.resumed is not None and self.control is not None:
            msg = "the fp16 GradScaler starts afresh: resume with guard.resume() to restore it"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _optimizer_step(self, scaler: Any) -> None:
        """Clip, step, zero, average, schedule: the one optimizer step in ddpkit."""
        state, clip = self.state, self.config.clip_grad_norm
        optimizer = state.optimizer
        if clip is not None:
            scaler.unscale_(optimizer)  # clip the true gradients (nothing to do unscaled)
            nn.utils.clip_grad_norm_(state.model.parameters(), clip)
        scaler.step(optimizer)  # the one optimizer step of ddpkit (a disabled scaler: plain)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        ema: Any = state.ema  # an AveragedModel (ddpkit.model_ema)
        if ema is not None:
            ema.update_parameters(unwrap_model(state.model))
        if state.scheduler is not None and self.per_step:
            state.scheduler.step()

    @property
    def per_step(self) -> bool:
        """Whether the scheduler steps per optimizer step (the config, or ``warmup_schedule``'s)."""
        scheduler = self.state.scheduler
        return self.config.scheduler_per_step or bool(getattr(scheduler, "per_step", False))

    def _device(self) -> torch.device:
        device = self.config.device
        return torch.device(device) if device is not None else module_device(self.state.model)

    # -- between steps, and at an epoch's end -----------------------------------------------

    def after_step(self, part: EpochBatches | Position, *, loop: Totals = None) -> Actions:
        """After each optimizer step: count it, then save a step checkpoint or stop, if asked.

        :meth:`backward` calls it; a loop that steps itself calls it once per
        optimizer step. ``part``: the :class:`EpochBatches` (the position is
        built from what it yielded) or the step's :class:`Position`; the
        state advances there. Every rank asks once, the same answer everywhere,
        whether a step checkpoint is due (the manager's cadence) or a stop was
        asked (a signal, a failed write): a due checkpoint is saved in the
        background (none after an epoch's last batch), a stop saves
        ``interrupted.pth`` and raises. ``loop``: this rank's running totals
        (or a function giving them, called only for a save). All ranks must
        call this after the same steps, or it deadlocks.

        Returns:
            What was decided (``save``; ``stop`` is never returned: it raises).

        Raises:
            Preempted: a stop signal on some rank: every rank stopped after this
                step, ``interrupted.pth`` written (exit status 75 uncaught).
            CheckpointError: a background checkpoint write failed on some rank.
        """
        control, state, manager = self._control(), self.state, self.checkpoints
        if isinstance(part, EpochBatches):
            position, last = part.position(state.position.step + 1), part.last
        else:
            position, last = part, False
        state.advance(position)  # the step is counted
        self.progress("done")
        if manager is not None and manager.write_error is not None:
            error = manager.write_error
            control.request_stop(f"rank {self._rank}: {type(error).__name__}: {error}")
        counted = timed = False
        if manager is not None:
            counted, timed = manager.clock.due(position.step, timed=self._rank == 0)
        actions = control.after_step(position.step, counted=counted, timed=timed)
        save = manager is not None and SaveClock.step_checkpoint(actions.save, last)
        if manager is not None and (save or actions.stop is not None):
            place = part.loader_state() if isinstance(part, EpochBatches) else None
            state.advance(position, loop=_totals(loop), loader_state=place)
        if actions.stop is not None:
            self._stop(actions.stop, mid_epoch=True)
        if save and manager is not None:
            self.progress("save")
            manager.checkpoint("step", block=False)
        return actions

    def end_epoch(self, epoch: int, metrics: Mapping[str, Any] | None = None) -> None:
        """After an epoch: its checkpoint (in the background), then a stop if any rank asked.

        The state's position becomes the next epoch's start
        (:meth:`TrainingState.end_epoch`); a stop here resumes from the epoch's
        checkpoint. All ranks must call this, or it deadlocks.

        Raises:
            Preempted: a stop signal arrived on some rank during the epoch's end.
            CheckpointError: a background checkpoint write failed on some rank.
        """
        control = self._control()
        self.state.end_epoch(epoch, self._world)
        manager = self.checkpoints
        if manager is not None:
            self.progress("save")
            manager.checkpoint("epoch", metrics=metrics, block=False)
        stop = control.stop_at_epoch_end()
        if stop is not None:
            self._stop(stop, mid_epoch=False)

    def _control(self) -> StepControl:
        if self.control is None:
            raise RuntimeError(
                "StepGuard is used outside its with-block: write `with StepGuard(...) as "
                "guard:` around the training loop (entering installs the stop handlers)"
            )
        return self.control

    def _stop(self, stop: Stop, *, mid_epoch: bool) -> None:
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
            if mid_epoch:
                path = manager.checkpoint("interrupted")
            else:
                manager.flush()
                path = manager.latest if manager.writes else None
        logger.warning(
            "stopped by %s after step %d%s; resume to continue (exit status %d)",
            stop.detail,
            self.step,
            f", checkpoint {path}" if path is not None else "",
            Preempted(stop.detail).code,
        )
        raise Preempted(stop.detail, str(path) if path is not None else None, self.step)


def _scale_gradients(model: nn.Module, factor: float) -> None:
    """Multiply every gradient by ``factor`` (after the all-reduce: the same on every rank)."""
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.mul_(factor)


def _totals(loop: Totals) -> Any:
    return loop() if callable(loop) else loop
