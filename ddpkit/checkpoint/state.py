"""``TrainingState``: everything a checkpoint saves and restores, one bag bound to its manager.

The model and the objects that train it (optimizer, scheduler, GradScaler,
the model's average), where training stands (:class:`~ddpkit.position.Position`),
this rank's running totals of the epoch and what else every checkpoint
records (``extra``) are one object, given to the ``CheckpointManager`` once.
The run's progress (position, totals, stream place) lives here only, written
by :meth:`TrainingState.advance`. A new piece of state (a second optimizer, a
loader with a state of its own) is a new field of this class and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from ddpkit._docs import see
from ddpkit.checkpoint.serialization import CheckpointError
from ddpkit.checkpoint.transfer import broadcast_state
from ddpkit.distributed.comm import get_rank
from ddpkit.distributed.parallel import unwrap_model
from ddpkit.position import Position

__all__ = ["TrainingState", "check_fits", "rank0_state"]

# The fields that hold values, not objects with state_dict(): recorded as they are.
VALUES = ("model", "position", "loop", "loader_state", "extra")
# How the message names each piece, and how to resume without it.
_WHAT = {
    "optimizer": ("optimizer", "pass optimizer=None to resume"),
    "scheduler": ("scheduler", "pass scheduler=None to resume"),
    "scaler": (
        "GradScaler",
        "it was saved without fp16: resume with its precision (no amp='fp16'), or scaler=None",
    ),
    "ema": (
        "model average (EMA)",
        "it was saved without one. Resume without ema= (fit(ema=None), no --model-ema), or "
        "start a new run with it",
    ),
}


@dataclass(eq=False)
class TrainingState:
    """Everything a checkpoint holds; an object that is None is not saved or restored.

    Every object but ``model`` is saved with ``state_dict()`` and restored
    with ``load_state_dict()`` under its field's name. ``model`` (DDP- or
    compile-wrapped or not) and ``ema`` are saved as rank 0 holds them, so a
    copy written by another rank resumes exactly too. ``position``, ``loop``
    and ``extra`` are plain values: a save records them as they are, and a
    resume sets them to what the checkpoint recorded.

    Attributes:
        model: the model being trained.
        optimizer: its optimizer.
        scheduler: a learning-rate scheduler.
        scaler: a ``torch.amp.GradScaler`` (fp16).
        ema: the model's average (``ddpkit.model_ema``).
        position: where training stands: after an epoch, the next epoch with
            no batch done; in the middle of one, the batches and samples done.
        loop: this rank's running totals of the epoch in progress (any
            ``weights_only``-loadable values); a checkpoint keeps every
            rank's, and a resume gives back this rank's (see
            :meth:`CheckpointManager.resume`).
        loader_state: this rank's place in its training loader's stream, the
            ``state_dict()`` of a stateful loader (torchdata's
            ``StatefulDataLoader``, a stateful ``IterableDataset``) after the
            last optimizer step; None for a loader that can skip to a
            position, and at an epoch's start. Like ``loop``, a checkpoint
            keeps every rank's and a resume gives back this rank's.
        extra: recorded in every checkpoint beside the manager's own ``extra``
            (the trackers' runs, the run's configuration ...).
    """

    model: nn.Module
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    ema: nn.Module | None = None
    position: Position = field(default_factory=Position)
    loop: dict[str, Any] = field(default_factory=dict)
    loader_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def advance(
        self,
        position: Position,
        *,
        loop: Mapping[str, Any] | None = None,
        loader_state: Any = None,
    ) -> None:
        """Move the run's progress to ``position``: the one writer of the progress fields.

        ``loop`` (this rank's totals) and ``loader_state`` (its stream place) go
        with it: a step that saves gives them, others leave them empty.
        """
        self.position = position
        self.loop = dict(loop) if loop is not None else {}
        self.loader_state = loader_state

    def end_epoch(self, epoch: int, world_size: int, step: int | None = None) -> None:
        """Advance to the next epoch's start; step count (or ``step``) and data identity kept."""
        p, n = self.position, self.position.step if step is None else step
        self.advance(
            replace(p, epoch=epoch + 1, batches=0, samples=0, step=n, world_size=world_size)
        )

    def pieces(self) -> dict[str, Any]:
        """Every object but the model, by field name (None where there is none).

        Every field that is not one of :data:`VALUES`: a subclass's new field is
        saved and restored with no other change.
        """
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in VALUES}

    def capture(self, gather: bool) -> dict[str, Any]:
        """The state of the model and every object, by name; ``gather``: buffers as rank 0's.

        With ``gather`` this is a collective: all ranks must call it, or it deadlocks.
        """
        state: dict[str, Any] = {"model": rank0_state(unwrap_model(self.model), gather)}
        for name, obj in self.pieces().items():
            if obj is None:
                state[name] = None
            elif name == "ema":
                state[name] = rank0_state(obj, gather)
            else:
                state[name] = obj.state_dict()
        return state

    def learning_rate(self) -> float | None:
        """The optimizer's first group's learning rate, for the checkpoint's header."""
        if self.optimizer is None:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    def check(self, state: dict[str, Any], name: str) -> None:
        """Refuse ``state`` (a loaded checkpoint) that cannot restore every object; load nothing.

        Raises:
            CheckpointError: an object this state has is missing from the file,
                or the model (or its average) is not the one that saved it.
        """
        for piece, obj in self.pieces().items():
            if obj is not None and state.get(piece) is None:
                what, fix = _WHAT.get(piece, (piece, f"pass {piece}=None to resume"))
                raise CheckpointError(f"{name} holds no {what} state; {fix}")
        check_fits(unwrap_model(self.model), state["model"], name, "model")
        if self.ema is not None:
            check_fits(self.ema, state["ema"], name, "model average (EMA)")

    def load(self, state: dict[str, Any]) -> None:
        """Load the model and every object from ``state``, checked by :meth:`check` first."""
        unwrap_model(self.model).load_state_dict(state["model"])
        for piece, obj in self.pieces().items():
            if obj is not None:
                obj.load_state_dict(state[piece])


def rank0_state(module: nn.Module, gather: bool) -> dict[str, Any]:
    """``module``'s state as rank 0 holds it (with ``gather``; a collective), else as it is.

    DDP keeps parameters equal on all ranks, but each rank updates its
    BatchNorm statistics with its own batch after rank 0's are broadcast (and
    an average of the model averages them): a copy written by another rank
    takes rank 0's buffers, or a resume from it would not be exact.
    """
    weights = module.state_dict()
    if not gather:
        return weights
    buffers = {name: weights[name] for name, _ in module.named_buffers() if name in weights}
    ours = broadcast_state(buffers if get_rank() == 0 else None, 0)
    if get_rank() != 0:
        weights.update(ours)  # a fresh dict from state_dict(): the module is not touched
    return weights


def check_fits(module: nn.Module, weights: Any, name: str, what: str = "model") -> None:
    """Refuse ``weights`` that do not load into ``module``, naming the first differences.

    Raises:
        CheckpointError: keys missing from the file, keys the module lacks, or
            tensors of other shapes (the first few of each); or no state dict at all.
    """
    if not isinstance(weights, dict):
        raise CheckpointError(f"{name} holds no {what} state dict (a {type(weights).__name__})")
    mine = module.state_dict()
    missing = [k for k in mine if k not in weights]
    unexpected = [k for k in weights if k not in mine]
    shapes = [
        f"{k} (file {list(weights[k].shape)}, {what} {list(v.shape)})"
        for k, v in mine.items()
        if k in weights
        and isinstance(v, torch.Tensor)
        and isinstance(weights[k], torch.Tensor)
        and weights[k].shape != v.shape
    ]
    if not (missing or unexpected or shapes):
        return
    said = [
        f"{label}: {_first(items)}"
        for label, items in (
            ("shapes differ", shapes),
            (f"missing from the file ({len(missing)})", missing),
            (f"not in the {what} ({len(unexpected)})", unexpected),
        )
        if items
    ]
    raise CheckpointError(
        f"{name} was saved from another {what} than this one ({type(module).__name__}); "
        + "; ".join(said)
        + ". Resume with the model that wrote it (the same --arch and --num-classes), or start "
        "a new run in another checkpoint directory; to start from its weights, use "
        "load_pretrained (--pretrained) with a weight file. " + see("checkpoints")
    )


def _first(items: list[str], count: int = 3) -> str:
    more = f" and {len(items) - count} more" if len(items) > count else ""
    return ", ".join(items[:count]) + more
