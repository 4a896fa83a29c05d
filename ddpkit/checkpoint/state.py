"""``TrainingState``: what a checkpoint saves and restores, bound once to its manager.

The model and the objects that train it (optimizer, scheduler, GradScaler,
the model's average) are given to the ``CheckpointManager`` once; every save
and resume then reads and loads them here. A new piece of state (a second
optimizer, a sampler with a state of its own) is a new field of this class
and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from ddpkit.checkpoint.serialization import CheckpointError
from ddpkit.checkpoint.sync import check_fits, rank0_state
from ddpkit.distributed.parallel import unwrap_model

__all__ = ["TrainingState"]

# How the message names each piece, and how to resume without it.
_WHAT = {
    "optimizer": ("optimizer", "pass optimizer=None to resume"),
    "scheduler": ("scheduler", "pass scheduler=None to resume"),
    "scaler": ("GradScaler", "pass scaler=None to resume"),
    "ema": (
        "model average (EMA)",
        "it was saved without one. Resume without ema= (fit(ema=None), no --model-ema), or "
        "start a new run with it",
    ),
}


@dataclass(eq=False)
class TrainingState:
    """The objects a checkpoint holds the state of; None: that piece is not saved or restored.

    Every piece but ``model`` is saved with ``state_dict()`` and restored with
    ``load_state_dict()`` under its field's name. ``model`` (DDP- or
    compile-wrapped or not) and ``ema`` are saved as rank 0 holds them, so a
    copy written by another rank resumes exactly too.

    Attributes:
        model: the model being trained.
        optimizer: its optimizer.
        scheduler: a learning-rate scheduler.
        scaler: a ``torch.amp.GradScaler`` (fp16).
        ema: the model's average (``ddpkit.model_ema``).
    """

    model: nn.Module
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    ema: nn.Module | None = None

    def pieces(self) -> dict[str, Any]:
        """Every piece but the model, by field name (None where there is none)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}

    def capture(self, gather: bool) -> dict[str, Any]:
        """The state of every piece, by name; ``gather``: the buffers as rank 0 holds them.

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
        """Refuse ``state`` (a loaded checkpoint) that cannot restore every piece; load nothing.

        Raises:
            CheckpointError: a piece this state has is missing from the file, or
                the model (or its average) is not the one that saved it.
        """
        for piece, obj in self.pieces().items():
            if obj is not None and state.get(piece) is None:
                what, fix = _WHAT.get(piece, (piece, f"pass {piece}=None to resume"))
                raise CheckpointError(f"{name} holds no {what} state; {fix}")
        check_fits(unwrap_model(self.model), state["model"], name, "model")
        if self.ema is not None:
            check_fits(self.ema, state["ema"], name, "model average (EMA)")

    def load(self, state: dict[str, Any]) -> None:
        """Load every piece from ``state``, checked by :meth:`check` first."""
        unwrap_model(self.model).load_state_dict(state["model"])
        for piece, obj in self.pieces().items():
            if obj is not None:
                obj.load_state_dict(state[piece])
