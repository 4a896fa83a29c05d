"""``fit()``: the minimal DDP training loop that survives crashes, preemption and hangs.

``fit`` runs the epochs: ``set_epoch`` on the sampler, mixed precision,
gradient accumulation without needless all-reduces, uint8 batches normalised
on the device, exact validation, and checkpoints: after every epoch, every N
steps or M minutes, and when a signal stops the job. A resumed run continues
from the exact batch it stopped at, bit-exactly on the same number of ranks.
Everything else stays yours: the model, the data, the optimiser and the
schedule are arguments. How each step runs is a frozen :class:`TrainConfig`,
how faults are met a :class:`FaultConfig`; what is shown and written is
``ddpkit.training.reporting``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit import _graveyard
from ddpkit.checkpoint import CheckpointManager
from ddpkit.checkpoint.files import scan
from ddpkit.checkpoint.state import TrainingState
from ddpkit.data.streams import check_batches
from ddpkit.distributed import comm
from ddpkit.distributed.devices import module_device
from ddpkit.distributed.hang_report import is_collective_failure, report_collective_failure
from ddpkit.distributed.launchers import detect_launcher
from ddpkit.distributed.parallel import sync_buffers
from ddpkit.position import Position
from ddpkit.training.config import FaultConfig, ReportConfig, TrainConfig
from ddpkit.training.ema import sync_ema_buffers
from ddpkit.training.epoch import Run, train_epoch
from ddpkit.training.evaluation import Criterion, evaluate
from ddpkit.training.guard import StepGuard
from ddpkit.training.profiling import StepProfiler
from ddpkit.training.reporting import Reporter
from ddpkit.training.trackers import TrackerError

__all__ = ["History", "fit"]

logger = logging.getLogger("ddpkit")

# fit()'s keyword arguments before they moved into TrainConfig / ReportConfig.
_TRAIN_KEYS = ("amp", "grad_accum", "clip_grad_norm", "scheduler_per_step", "normalize", "device")
_REPORT_KEYS = ("progress", "log_dir")
# The confusion matrix goes into each epoch's record (and metrics.jsonl) up to this
# many classes; beyond, evaluate() still returns it and per-class figures stay.
_CONFUSION_IN_RECORD = 100
# With this many classes or fewer, top-5 accuracy is 100 % by definition: not recorded.
_TOP5_ALWAYS = 5


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
    ema: nn.Module | None = None,
    config: TrainConfig | None = None,
    checkpoints: CheckpointManager | None = None,
    resume: bool | str | os.PathLike[str] = False,
    report: ReportConfig | None = None,
    faults: FaultConfig | None = None,
    callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
    step_callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
    **deprecated: Any,
) -> History:
    """Train ``model`` for ``epochs`` epochs; every rank calls it with its own loaders.

    Each epoch: ``set_epoch`` on the loader's sampler; each batch moved to the
    device (uint8 images normalised there), the forward and loss in
    :meth:`StepGuard.forward`, and :meth:`StepGuard.backward`, the one step a
    loop of your own takes too (accumulation, clipping, the GradScaler, the
    save or stop after it). After the epoch: :func:`evaluate` on
    ``val_loader``, the scheduler step, one record in the :class:`History`
    (and, on rank 0, what ``report`` asks for), the callbacks, and the epoch
    checkpoint, written in the background. Nothing passed in is changed
    beyond what training does.

    Args:
        model: the model, already on its device and wrapped (``wrap_ddp``).
        train_loader: batches of ``(images, targets)``; ``build_loader``'s
            skips the batches already done when resuming mid-epoch.
        optimizer: the optimizer over ``model``'s parameters.
        criterion: ``criterion(logits, targets) -> loss`` (mean over the batch).
        epochs: train until this many epochs are done (counting resumed ones).
        val_loader: evaluated after each epoch; metrics are exact across ranks.
            The record holds ``val_acc1`` ... (``val_acc5`` only with more
            than 5 classes: below, it is always 100 %) and per class ``val_recall``,
            ``val_precision`` (and ``val_confusion`` up to 100 classes), and
            ``val_worst_class`` (a name when the dataset has ``classes``).
        scheduler: stepped after each epoch, or after each optimizer step
            with ``config.scheduler_per_step`` or when :func:`warmup_schedule`
            made it.
        ema: an average of the model (:func:`ddpkit.model_ema`), updated
            after each optimizer step, evaluated beside it (``val_ema_acc1``
            ...), checkpointed; the weight file holds the better of the two.
        config: how each step runs (:class:`TrainConfig`); default ``TrainConfig()``.
        checkpoints: where and how often to save (and resume from).
        resume: True: from the newest complete checkpoint any rank holds, at
            the exact batch; a path: from that file. On another number of
            ranks the epoch's unseen samples, with a warning (not bit-exact).
        report: what rank 0 shows and writes (:class:`ReportConfig`); default
            ``ReportConfig()``: a progress bar, no files.
        faults: stop signals and the hang watchdog (:class:`FaultConfig`);
            default ``FaultConfig()``: SIGTERM, SIGUSR1 and SIGINT stop
            cleanly, no watchdog.
        callbacks: called with each epoch's record, on every rank.
        step_callbacks: called after each optimizer step, on every rank, with
            ``{"epoch", "step", "batch", "lr", "loss", "position"}``: the epoch
            (from 1), the step (over the run), this rank's batches of the
            epoch, the step's rate, its last micro-batch's loss (a detached
            tensor on the device) and the :class:`Position`.
        **deprecated: ``amp``, ``grad_accum``, ``clip_grad_norm``,
            ``scheduler_per_step``, ``normalize``, ``device`` (now in
            ``config``) and ``progress``, ``log_dir`` (now in ``report``),
            accepted with a ``DeprecationWarning`` until ddpkit 0.3.

    Returns:
        The :class:`History` of this run (resumed epochs are not repeated).

    Raises:
        ddpkit.Preempted: a stop signal, the checkpoint written (exit status 75).
        TrainingError: a loss not finite, or an epoch with no step on any rank.
        CheckpointError: a write failed (on every rank), resume failed, or a
            fresh run's directory holds another run's files.
        ValueError: a bad ``epochs`` or config value, ``resume`` without ``checkpoints``.
        TypeError: an unknown keyword argument.

    Example:
        >>> history = fit(model, train_loader, optimizer, criterion=FocalLoss(gamma=2),
        ...               epochs=90, val_loader=val_loader, scheduler=scheduler,
        ...               config=TrainConfig(amp="bf16"), resume=True,
        ...               checkpoints=CheckpointManager("checkpoints", every_minutes=10),
        ...               faults=FaultConfig(hang_timeout=600))
    """
    config, report = _configs(config, report, deprecated)
    faults = faults or FaultConfig()
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if resume is not False and checkpoints is None:
        raise ValueError("resume=True needs checkpoints=CheckpointManager(directory)")
    dev = torch.device(config.device) if config.device is not None else module_device(model)
    # The one bag every step updates and every checkpoint saves: nothing else holds a copy.
    # With fp16 the guard adds its GradScaler.
    state = TrainingState(model, optimizer, scheduler, ema=ema)
    history = History()
    with contextlib.ExitStack() as stack:
        # Set-up: the guard (stops, the watchdog), the resume, the reporter.
        run = _start(stack, state, criterion, config, dev, checkpoints, report, faults)
        run.step_callbacks = step_callbacks
        try:
            start, carried = _resume(run, resume, train_loader)
            _open_report(run, report, start, epochs, train_loader, val_loader)
            # The epochs.
            first = start.epoch if start is not None else 0
            for epoch in range(first, epochs):
                began = time.perf_counter()
                carry = carried if epoch == first else None
                record = train_epoch(run, train_loader, epoch, epochs, carry)
                _finish_epoch(run, record, epoch, epochs, val_loader, callbacks, history, began)
            # The end.
            _end(run, history)
        except BaseException as error:
            _explain(run, error)
            raise
    return history


def _start(
    stack: contextlib.ExitStack,
    state: TrainingState,
    criterion: Criterion,
    config: TrainConfig,
    dev: torch.device,
    checkpoints: CheckpointManager | None,
    report: ReportConfig,
    faults: FaultConfig,
) -> Run:
    """The run: its guard (the stop handlers, the one question, the watchdog) and reporter."""
    if checkpoints is not None:
        checkpoints.bind(state)  # once: every save and the resume read this bag
    where = faults.report_dir or (checkpoints.directory if checkpoints else report.log_dir)
    guard = stack.enter_context(
        StepGuard(checkpoints, state=state, config=config, faults=faults, report_dir=where)
    )
    run = Run(
        state=state,
        criterion=criterion,
        config=config,
        device=dev,
        guard=guard,
        reporter=Reporter(report, is_main=comm.is_main_process()),
    )
    # The trackers' last records have a deadline of their own: not the watchdog's.
    stack.callback(run.reporter.close)
    stack.callback(guard.progress, "trackers")
    steps = report.profile_steps
    rank = comm.get_rank()
    if steps is not None and (report.profile_ranks is None or rank in report.profile_ranks):
        assert report.log_dir is not None  # ReportConfig checks it
        profile = os.path.join(report.log_dir, "profile")
        run.profiler = StepProfiler(steps[0], steps[1], profile, rank, dev)
        stack.callback(run.profiler.close)  # a run that ends inside the range
    return run


def _resume(
    run: Run, resume: bool | str | os.PathLike[str], loader: Iterable[Any]
) -> tuple[Position | None, Any]:
    """Resume when asked (or claim the directory of a fresh run); where training starts.

    Returns the start (None: the beginning) and this rank's running totals of
    that epoch (all ranks' summed on rank 0 when the number of ranks changed).
    """
    state, guard = run.state, run.guard
    state.advance(Position(world_size=comm.get_world_size()))
    manager = run.guard.checkpoints
    if manager is None:
        return None, None
    # A fresh run claims the directory: another run's files are refused before it trains,
    # and this same job's (torchrun started its workers again after a server joined) resumed.
    if resume is not False or manager.claim():
        guard.resume(loader, path=None if isinstance(resume, bool) else resume)
    if run.profiler is not None:
        run.profiler.at(run.guard.step)
    if manager.resumed is None:
        return None, None
    start = state.position
    return start, _carried(manager.resumed.loop, start, comm.get_world_size(), comm.get_rank())


def _open_report(
    run: Run,
    report: ReportConfig,
    start: Position | None,
    epochs: int,
    train_loader: Iterable[Any],
    val_loader: Iterable[Any] | None,
) -> None:
    """Start the trackers' runs (continued on a resume) and say where training starts.

    Raises:
        TrackerError: (every rank) a tracker asked for cannot start its run.
        ValueError: the training loader yields no batch.
    """
    reporter, checkpoints, world = run.reporter, run.guard.checkpoints, comm.get_world_size()
    header = _header(
        world, epochs, run.config, val_loader if val_loader is not None else train_loader
    )
    resumed = checkpoints.resumed_extra if checkpoints is not None and start else {}
    saved_runs, saved_records = resumed.get("trackers"), resumed.get("tracker_records")
    failure: TrackerError | None = None
    try:
        runs = reporter.start(
            header,
            resumed=start is not None,
            tracker_runs=saved_runs if isinstance(saved_runs, dict) else None,
            tracker_records=saved_records if isinstance(saved_records, list) else None,
        )
    except TrackerError as exc:  # rank 0's: every rank stops before training
        runs, failure = {}, exc
    if reporter.tracker_names and world > 1:  # every node's checkpoint copy records them
        runs, said = comm.all_gather_object((runs, str(failure or "") or None))[0]
        if said is not None and failure is None:
            failure = TrackerError(f"rank 0: {said}")
    if failure is not None:
        raise failure
    if start is not None and start.epoch >= epochs:
        reporter.say(f"nothing to do: finished at epoch {start.epoch} of {epochs}")
    elif start is not None:
        before = resumed.get("epochs")
        changed = f", now of {epochs} epochs (started for {before})" if before != epochs else ""
        reporter.say(
            f"resuming at epoch {start.epoch + 1} step {start.step} "
            f"({start.batches} batches of the epoch done){changed if before else ''}"
        )
    if val_loader is None and checkpoints is not None:
        reporter.say("no val_loader: weight files are named by epoch alone, and no best.pth")
    check_batches(train_loader, world)
    if checkpoints is not None:
        # Every checkpoint records the trackers' runs and the run's configuration: a
        # resumed job continues those runs, and the configuration it was trained with.
        run.state.extra["epochs"] = epochs  # a resume says when the planned run changed
        if runs:
            run.state.extra["trackers"] = runs
        if report.run_config is not None:
            run.state.extra["config"] = dict(report.run_config)


def _finish_epoch(
    run: Run,
    record: dict[str, Any],
    epoch: int,
    epochs: int,
    val_loader: Iterable[Any] | None,
    callbacks: Sequence[Callable[[dict[str, Any]], None]],
    history: History,
    began: float,
) -> None:
    """Validate, step the scheduler, report, save the epoch checkpoint, stop if asked."""
    state, config = run.state, run.config
    ema: Any = state.ema  # an AveragedModel (ddpkit.model_ema)
    # Each rank's BatchNorm statistics moved with its own last batches: from here on
    # every rank holds rank 0's, the model (and average) validated is the one saved.
    sync_buffers(state.model)
    if ema is not None:
        sync_ema_buffers(ema)
    if val_loader is not None:
        measure = functools.partial(
            evaluate,
            criterion=run.criterion,
            normalize=config.normalize,
            amp=config.amp,
            device=run.device,
        )
        watched = functools.partial(
            run.guard.watched, val_loader, val_loader, "val_data", "validate"
        )
        record.update(_val_record(measure(state.model, watched()), val_loader))
        if ema is not None:
            averaged = measure(ema.module, watched())
            keys = ("acc1", "acc5", "loss") if "val_acc5" in record else ("acc1", "loss")
            record.update({f"val_ema_{k}": averaged[k] for k in keys})
    run.guard.progress("callbacks")  # the report and the callbacks: the watchdog places them apart
    if state.scheduler is not None and not run.guard.per_step:
        state.scheduler.step()
    record["wall_seconds"] = time.perf_counter() - began
    history.records.append(record)
    run.reporter.epoch(record, epochs, run.guard.step)
    if run.guard.checkpoints is not None and run.reporter.tracker_names:
        # The records travel with the checkpoints: a resumed job sends the runs what they lack.
        records = run.reporter.tracker_records()
        if comm.get_world_size() > 1:  # every node's copy carries rank 0's
            records = comm.all_gather_object(records)[0]
        state.extra["tracker_records"] = records
    for callback in callbacks:
        callback(record)
    # Without validation no accuracy names the weight file or picks best.pth.
    val = {"acc1": record["val_acc1"]} if "val_acc1" in record else {}
    metrics = {"loss": record["train_loss"], **val}
    if "val_ema_acc1" in record:
        metrics["ema_acc1"] = record["val_ema_acc1"]
    # The bag's position becomes the next epoch's start; its checkpoint, then a stop if asked.
    run.guard.end_epoch(epoch, metrics=metrics)


def _end(run: Run, history: History) -> None:
    """Wait for the last checkpoint on every rank, then the summary, the plot, the trackers' end."""
    best = None
    checkpoints = run.guard.checkpoints
    if checkpoints is not None:
        checkpoints.flush()  # every rank learns whether the last write failed
        best = checkpoints.best()
    # On rank 0 while the others may have left: bounded by the trackers' own deadline,
    # not the watchdog's.
    run.guard.progress("trackers")
    run.reporter.finish(history.records, best)


def _explain(run: Run, error: BaseException) -> None:
    """For a failed collective, this rank's report (the guard's end completes the checkpoint);
    under torchrun with no restart left, a line saying the job ends and where it stands."""
    _last_restart(run, error)
    where = run.guard.report_dir or run.reporter.config.log_dir
    rank, world = comm.get_rank(), comm.get_world_size()
    if world > 1 and where is not None and is_collective_failure(error):
        try:
            path = report_collective_failure(where, rank, world, error, dist.get_backend())
        except Exception as failed:  # the report must never hide the error it explains
            logger.warning("rank %d: no collective report (%s)", rank, failed)
        else:
            if path is not None:
                logger.error("rank %d: its last collectives and stack: %s", rank, path)


def _last_restart(run: Run, error: BaseException) -> None:
    """Say so when this failure ends a torchrun job: its ``--max-restarts`` are used up."""
    launch = detect_launcher()
    if not isinstance(error, Exception) or launch is None:  # Preempted: a SystemExit
        return
    if not launch.max_restarts or launch.restart_count < launch.max_restarts:
        return
    if launch.local_rank != 0 or "is refused by the running job" in str(error):
        return  # one line per server; a refused server's job goes on elsewhere
    manager, kept = run.guard.checkpoints, "no checkpoint yet"
    if manager is not None:
        store = manager.store
        if bool(store.files) if store is not None else bool(scan(manager.directory)[0]):
            kept = f"its newest checkpoint in {manager.location} is intact"
    logger.error(
        "torchrun --max-restarts %d: every restart is used, so this failure ends the job on "
        "this server; %s: start it again with --resume (fit(resume=True)) to continue",
        launch.max_restarts,
        kept,
    )


def _val_record(val: dict[str, Any], loader: Iterable[Any]) -> dict[str, Any]:
    """``evaluate``'s figures as ``val_*`` keys; the worst class named, a big matrix left out."""
    val = dict(val)
    if len(val.get("confusion", ())) > _CONFUSION_IN_RECORD:
        del val["confusion"]
    if 0 < len(val.get("recall") or ()) <= _TOP5_ALWAYS:  # top-5 of at most 5 classes: 100 %
        del val["acc5"]
    classes = getattr(getattr(loader, "dataset", None), "classes", None)
    worst = val.get("worst_class")
    if worst is not None and isinstance(classes, Sequence) and worst < len(classes):
        val["worst_class"] = str(classes[worst])
    return {f"val_{k}": v for k, v in val.items()}


def _carried(loop: Any, start: Position | None, world: int, rank: int) -> Any:
    """This rank's running totals of the resumed epoch (the sums on rank 0 if ranks changed)."""
    if not loop or start is None or not start.mid_epoch:
        return None
    if start.world_size == world:
        return loop[rank]
    entries = [e for e in loop if e]
    # Every rank: the epoch's splits so far (older checkpoints: the saving world size's) and
    # its time; rank 0: the sums.
    splits = entries[0].get("splits") if entries else None
    kept = {"splits": splits or [[start.world_size, 0, 0]]} | {
        key: max((e.get(key, 0.0) for e in entries), default=0.0)
        for key in ("seconds", "data_seconds")
    }
    if rank != 0:
        return kept
    return kept | {key: sum(e.get(key, 0) for e in entries) for key in ("loss_sum", "samples")}


def _header(world: int, epochs: int, config: TrainConfig, loader: Any) -> dict[str, Any]:
    """What ``metrics.jsonl`` records about a run when it starts (the class names too)."""
    import torchvision

    from ddpkit._version import __version__

    classes = getattr(getattr(loader, "dataset", None), "classes", None)
    return {
        "classes": [str(c) for c in classes] if isinstance(classes, Sequence) else None,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "world_size": world,
        "epochs": epochs,
        "config": {k: repr(v) for k, v in dataclasses.asdict(config).items()},
        "versions": {
            "ddpkit": __version__,
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
        },
    }


def _configs(
    config: TrainConfig | None, report: ReportConfig | None, deprecated: dict[str, Any]
) -> tuple[TrainConfig, ReportConfig]:
    """The two configs, with the former keyword arguments of ``fit`` folded in."""
    unknown = sorted(set(deprecated) - set(_TRAIN_KEYS) - set(_REPORT_KEYS))
    if unknown:
        raise TypeError(f"fit() got unexpected keyword argument(s) {unknown}")
    config, report = config or TrainConfig(), report or ReportConfig()
    if deprecated:
        _graveyard.deprecated(
            f"fit({', '.join(f'{k}=' for k in deprecated)}...)",
            "fit(config=TrainConfig(...)) and fit(report=ReportConfig(...))",
            stacklevel=4,
        )
        train = {k: v for k, v in deprecated.items() if k in _TRAIN_KEYS}
        shown = {k: v for k, v in deprecated.items() if k in _REPORT_KEYS}
        config = dataclasses.replace(config, **train)
        report = dataclasses.replace(report, **shown)
    return config, report


def __getattr__(name: str) -> Any:
    return _graveyard.moved_name(__name__, name)
