"""The options of ``fit``: how each step runs, how faults are met, what is shown and written.

Every option of :func:`ddpkit.fit` beyond its arguments lives here, in
frozen, keyword-only dataclasses validated when they are made: a bad value
is a ``ValueError`` naming it at once, not an error an hour into training.
Each field carries its own docstring. How often step checkpoints are taken
is :class:`SaveCadence`, the fourth of them: it is defined beside the
``CheckpointManager`` that holds it (``every_steps``, ``every_minutes``; the
checkpoint package may not import this one) and is re-exported here.
"""

from __future__ import annotations

import difflib
import enum
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit import _graveyard
from ddpkit._numbers import positive_seconds
from ddpkit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from ddpkit.distributed.stops import StepControl
from ddpkit.training.evaluation import AMP_DTYPES, Amp, Normalize

__all__ = ["FaultConfig", "ReportConfig", "TrainConfig", "parse_trackers"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How each training step runs, in ``fit`` and in :class:`~ddpkit.StepGuard` (one step).

    Raises:
        ValueError: a value out of range; the message names it.
    """

    amp: Amp | None = None
    """``"bf16"`` or ``"fp16"`` autocast; fp16 uses a GradScaler whose state is
    checkpointed. None: full precision."""

    grad_accum: int = 1
    """Micro-batches per optimizer step, at least 1. Each micro-batch's loss is
    divided by the number of micro-batches of its step: ``grad_accum``, or fewer
    for an epoch's last step when the epoch's batches do not divide evenly (with
    a sized loader)."""

    clip_grad_norm: float | None = None
    """Clip the total gradient norm to this value (> 0); None: no clipping."""

    scheduler_per_step: bool = False
    """Step the scheduler after each optimizer step instead of after each epoch
    (``warmup_schedule``'s always are)."""

    normalize: Normalize | None = (IMAGENET_MEAN, IMAGENET_STD)
    """``(mean, std)`` for uint8 batches, applied on the device; None leaves
    batches as they come."""

    device: torch.device | str | None = None
    """Where batches go; default: the model's parameters' device."""

    batch_transform: (
        Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None
    ) = None
    """``(images, targets) -> (images, targets)`` applied to each training batch
    on the device after ``normalize``, such as ``ddpkit.mixup_cutmix(C)``
    (targets then hold probabilities)."""

    channels_last: bool = False
    """Move image batches to ``torch.channels_last`` memory format (convert the
    model too, before ``wrap_ddp``: ``model.to(memory_format=torch.channels_last)``);
    faster convolutions on recent GPUs."""

    def __post_init__(self) -> None:
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ValueError(f"amp must be 'bf16', 'fp16' or None, got {self.amp!r}")
        if isinstance(self.grad_accum, bool) or self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm}")
        if self.batch_transform is not None and not callable(self.batch_transform):
            raise ValueError(f"batch_transform must be callable, got {self.batch_transform!r}")
        if self.normalize is not None and len(self.normalize[0]) != len(self.normalize[1]):
            raise ValueError(
                f"normalize=(mean, std) needs as many means as stds, got {self.normalize}"
            )


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """How :func:`ddpkit.fit` meets the faults of a long job: stop signals, hangs, changed data.

    Raises:
        ValueError: an unknown signal, a timeout that is not a positive
            number, or ``on_data_change`` not ``"error"`` or ``"next_epoch"``.
    """

    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")
    """Signals that stop training cleanly: every rank stops after the same step,
    ``interrupted.pth`` is written, and ``fit`` raises :class:`ddpkit.Preempted`
    (exit status 75). A second Ctrl-C a second or more after the first stops at
    once. Empty: signals keep their usual effect."""

    hang_timeout: float | None = None
    """Seconds a rank may take to finish a step once the first step is done;
    past it every rank logs its Python stack and the job exits with status 124,
    which a launcher's restart policy sees as a failure. None: no watchdog.
    Choose it above the slowest step, validation batch and checkpoint snapshot."""

    report_signal: str | None = "SIGUSR2"
    """With the watchdog on: a signal that, sent to any rank of the running job
    (``kill -USR2 PID``), makes every rank that can answer send its last
    collectives and Python stacks, and rank 0 write ``hang-report.txt``; the
    job goes on. None: no signal is taken."""

    report_dir: str | os.PathLike[str] | None = None
    """Where ``hang-report.txt`` and each rank's flight-recorder dump (and NCCL's
    dump on a collective timeout) go; default the checkpoint directory, else
    ``ReportConfig.log_dir``; with neither, the report is only logged."""

    on_data_change: str = "error"
    """A resume from a mid-epoch checkpoint whose training set had another size
    or index (recorded in step checkpoints): ``"error"`` raises
    ``CheckpointError`` (the rest of that epoch's order would read samples twice
    or never); ``"next_epoch"`` drops the rest of that epoch and starts the next
    one on the new data (the scheduler steps as at an epoch end), with a warning."""

    def __post_init__(self) -> None:
        StepControl(signals=self.stop_signals)  # names checked here, installed by fit
        timeout = self.hang_timeout
        if timeout is not None:
            seconds = positive_seconds(timeout)
            if seconds is None:
                raise ValueError(
                    f"hang_timeout must be a positive number of seconds or None, got {timeout!r}"
                )
            object.__setattr__(self, "hang_timeout", seconds)  # frozen: a plain float from here
        if self.report_signal is not None:
            StepControl(signals=(self.report_signal,))  # the same check of the name
            if self.report_signal in self.stop_signals:
                raise ValueError(
                    f"report_signal {self.report_signal!r} is also a stop signal; choose another "
                    "(SIGUSR2) or None"
                )
        if self.on_data_change not in ("error", "next_epoch"):
            raise ValueError(
                f"on_data_change must be 'error' or 'next_epoch', got {self.on_data_change!r}"
            )


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """What :func:`ddpkit.fit` shows and writes; all of it on rank 0 only."""

    progress: bool = True
    """A tqdm progress bar for each epoch, when stderr is a terminal."""

    log_dir: str | os.PathLike[str] | None = None
    """Write ``metrics.jsonl`` here (a run header, then one JSON line per epoch),
    TensorBoard events when ``tensorboard`` is installed, and ``curves.png`` at
    the end when ``matplotlib`` is (``ddpkit[plot]``)."""

    verbose: bool = True
    """Print one line per epoch to stdout, "resuming at ..." and "nothing to
    do ..." lines, and a summary table at the end. False: these go to the
    ``ddpkit`` logger at INFO instead."""

    profile_steps: tuple[int, int] | None = None
    """``(A, B)``: record optimizer steps A to B - 1 (counted over the run, from
    0) with ``torch.profiler`` into ``log_dir/profile/rank<r>.stepsA-B.pt.trace.json``,
    which Perfetto and TensorBoard's profiler open. Needs ``log_dir``. None:
    no profiler, nothing is done per step."""

    profile_ranks: tuple[int, ...] | None = None
    """The ranks that profile ``profile_steps``; None: every rank."""

    trackers: tuple[str, ...] | None = None
    """Experiment trackers to log the run to: ``"tensorboard"`` (events in
    ``log_dir``), ``"mlflow"`` (``MLFLOW_TRACKING_URI``, else ``./mlruns``) and
    ``"wandb"`` (``WANDB_MODE`` and the rest of W&B's settings; files in
    ``log_dir``), each an extra (``pip install "ddpkit[mlflow]"``). Each gets the
    ``run_config`` once, every epoch's record at the global step, and at the end
    the best checkpoint and ``curves.png``. The tracker's run id is saved in every
    checkpoint: a resumed run continues the same tracker run and logs no epoch
    twice. A tracker that fails warns once and training goes on. Names are read as
    :func:`parse_trackers` reads them (one string ``"mlflow, wandb"`` too; any case,
    each once); an unknown name is a ``ValueError``. None: TensorBoard when it is
    installed and ``log_dir`` is set, as before 0.3."""

    project: str = "ddpkit"
    """The MLflow experiment and W&B project a new tracker run is made in."""

    tracker_timeout: float = 60.0
    """The longest ``fit`` waits for the trackers, in seconds: while their runs open
    (one that does not answer is a ``TrackerError``) and for their last records at
    the end. Between the two they never hold training: they log on a thread of their
    own."""

    run_config: Mapping[str, Any] | None = None
    """The run's resolved configuration, recorded in ``metrics.jsonl``'s run header,
    logged once to each tracker and saved in every checkpoint. It is copied once into
    plain JSON values: paths become their text, enums their value, tuples and sets
    lists, numpy scalars Python numbers, a number that is not finite its text
    (``"nan"``, ``"inf"``). Any other value (an object, a function) is a ``ValueError``
    naming its key, so ``vars(args)`` of an ``argparse`` namespace fits as it is."""

    def __post_init__(self) -> None:
        seconds = positive_seconds(self.tracker_timeout)
        if seconds is None:
            raise ValueError(
                f"tracker_timeout must be a positive number of seconds, got "
                f"{self.tracker_timeout!r}"
            )
        object.__setattr__(self, "tracker_timeout", seconds)  # frozen: a plain float from here
        if self.trackers is not None:
            try:
                names = _tracker_names(self.trackers)
            except ValueError as exc:
                from ddpkit.training.trackers import TRACKERS

                raise ValueError(
                    f"trackers must be a tuple of {', '.join(map(repr, TRACKERS))} or one "
                    f"string of them ('mlflow, wandb'), got {_shown(self.trackers)}: {exc}"
                ) from None
            object.__setattr__(self, "trackers", names)  # frozen: a plain tuple from here
        if self.run_config is not None:
            if not isinstance(self.run_config, Mapping):
                raise ValueError(
                    f"run_config must be a mapping of names to values, got "
                    f"{type(self.run_config).__name__} {_shown(self.run_config)}"
                )
            object.__setattr__(self, "run_config", _plain(self.run_config, "run_config", ()))
        steps = self.profile_steps
        if steps is not None:
            if (
                len(steps) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                or not 0 <= steps[0] < steps[1]
            ):
                raise ValueError(
                    f"profile_steps must be (first, end) with 0 <= first < end, got {steps!r}"
                )
            if self.log_dir is None:
                raise ValueError("profile_steps needs log_dir: the traces go to log_dir/profile")
            object.__setattr__(self, "profile_steps", (int(steps[0]), int(steps[1])))
        if self.profile_ranks is not None and any(
            isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.profile_ranks
        ):
            raise ValueError(f"profile_ranks must be ranks (ints >= 0), got {self.profile_ranks!r}")


def parse_trackers(names: str | Iterable[str]) -> tuple[str, ...]:
    """The tracker names of ``names``: ``"mlflow, wandb"``, ``"mlflow,wandb"`` or
    ``("mlflow", "wandb")``, in any case, each kept once in its first place.

    Example:
        >>> parse_trackers("MLflow, wandb,mlflow")
        ('mlflow', 'wandb')

    Raises:
        ValueError: a name that is not one of ``ddpkit.training.trackers.TRACKERS``
            (the message lists them and the closest), an item that is not a
            string, or a string that names no tracker.
    """
    from ddpkit.training.trackers import TRACKERS

    try:
        return _tracker_names(names)
    except ValueError as exc:
        raise ValueError(f"{exc}; the trackers are {', '.join(TRACKERS)}") from None


def _tracker_names(names: object) -> tuple[str, ...]:
    """:func:`parse_trackers` with a short ``ValueError``: what is wrong, without the list."""
    from ddpkit.training.trackers import TRACKERS

    if isinstance(names, str):
        items: list[object] = [names]
    elif isinstance(names, Iterable) and not isinstance(names, bytes | Mapping):
        items = list(names)
    else:
        raise ValueError(f"{_shown(names)} ({type(names).__name__}) is not a string or a tuple")
    found: dict[str, None] = {}
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{_shown(item)} ({type(item).__name__}) is not a tracker name")
        for part in item.split(","):
            name = part.strip().lower()
            if not name:
                continue
            if name not in TRACKERS:
                close = difflib.get_close_matches(name, TRACKERS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown tracker {_shown(part.strip())}{hint}")
            found[name] = None
    if isinstance(names, str) and not found:
        raise ValueError(f"{names!r} names no tracker")
    return tuple(found)


# Deeper than this, a configuration is a data structure, not settings (and would
# reach Python's recursion limit when written).
_DEPTH = 64


def _plain(value: Any, where: str, path: tuple[int, ...]) -> Any:
    """``value`` as plain JSON data (see ``ReportConfig.run_config``), or a ``ValueError``
    naming ``where`` (the key path) and the type; ``path`` holds the containers above."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, enum.Enum):
        return _plain(value.value, where, path)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        number = float(value)
        return number if math.isfinite(number) else str(number)
    if isinstance(value, os.PathLike):
        text = os.fspath(value)
        if isinstance(text, str):
            return text
    if hasattr(value, "dtype") and hasattr(value, "item") and getattr(value, "shape", None) == ():
        return _plain(value.item(), where, path)  # a numpy scalar, a 0-d array or tensor
    container = isinstance(value, Mapping | Set) or (
        isinstance(value, Sequence) and not isinstance(value, bytes | bytearray)
    )
    if container:
        if id(value) in path:
            raise ValueError(f"{where} holds itself; pass a copy without the loop")
        if len(path) >= _DEPTH:
            raise ValueError(f"{where} is nested more than {_DEPTH} deep; flatten it")
        inner = (*path, id(value))
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            name = _key(key, where)
            if name in out:
                raise ValueError(f"{where} has the key {name!r} twice (as {key!r} too)")
            out[name] = _plain(item, f"{where}[{name!r}]", inner)
        return out
    if container:
        items = [_plain(v, f"{where}[{i}]", inner) for i, v in enumerate(value)]
        if isinstance(value, Set):  # no order of its own: one that is the same every run
            items.sort(key=repr)
        return items
    raise ValueError(
        f"{where}: {_shown(value)} ({type(value).__name__}) is not a JSON value (text, "
        "number, true/false, null, list or mapping): pass str() of it, or leave it out"
    )


def _key(key: Any, where: str) -> str:
    """A mapping's key as JSON writes it: text (numbers, true/false and null as JSON's text)."""
    if isinstance(key, enum.Enum):
        key = key.value
    if isinstance(key, os.PathLike):
        key = os.fspath(key)
    if isinstance(key, str):
        return str(key)
    if key is None or isinstance(key, bool):
        return {None: "null", True: "true", False: "false"}[key]
    if isinstance(key, int | float):
        return str(_plain(key, where, ()))
    raise ValueError(
        f"{where} has the key {_shown(key)} ({type(key).__name__}); keys are text or numbers"
    )


def _shown(value: object, width: int = 60) -> str:
    """``repr(value)``, cut to ``width`` characters: an error message stays one line."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def __getattr__(name: str) -> Any:
    return _graveyard.moved_name(__name__, name)
