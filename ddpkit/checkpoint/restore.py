"""Restoring a loaded checkpoint: every check first, then the objects, the RNG, the position.

:func:`restore_state` takes the state the ranks agreed on (``sync``) and the
bound :class:`~ddpkit.checkpoint.state.TrainingState`: it refuses a file that
cannot restore every piece (another model, a missing optimizer, a malformed
position or RNG list, another ``extra`` such as the architecture) before it
loads anything, then loads the pieces and this rank's RNG state.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddpkit._docs import see
from ddpkit.checkpoint.files import Found, check_position
from ddpkit.checkpoint.serialization import CheckpointError
from ddpkit.checkpoint.state import TrainingState
from ddpkit.distributed.comm import get_rank, get_world_size
from ddpkit.distributed.compression import CommHook, comm_hook_of
from ddpkit.position import Position
from ddpkit.rng import check_rng_state, restore_rng_state

__all__ = ["Restored", "check_extra", "restore_state"]


@dataclass(frozen=True)
class Restored:
    """What :func:`restore_state` read back besides the objects it loaded into."""

    position: Position
    loop: list[Any] | None
    best_acc1: float | None
    best_epoch: int | None
    extra: dict[str, Any] | None = None
    loader: list[Any] | None = None  # every rank's loader state (step kinds), else None


def check_extra(name: str, saved: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose ``extra`` differs from ``expected`` in a key both hold.

    Raises:
        CheckpointError: names the key, the value it was trained with and this run's.
    """
    differ = [k for k in expected if k in saved and saved[k] != expected[k]]
    if differ:
        was = ", ".join(f"{k} {saved[k]}" for k in differ)
        now = ", ".join(f"{k} {expected[k]}" for k in differ)
        raise CheckpointError(
            f"{name} was trained with {was}; this run has {now}. Pass {was} to resume or "
            f"evaluate it, or start a new run in another directory. {see('checkpoints')}"
        )


def restore_state(
    state: dict[str, Any],
    found: Found,
    training: TrainingState,
    strict_rng: bool,
    where: str | None = None,
) -> Restored:
    """Load ``state`` into every piece of ``training`` (None pieces are skipped).

    This rank's RNG state and PowerSGD state are restored when the world size
    is the one that saved; else they start afresh, with a warning.
    Everything is checked before anything is loaded: the position, the RNG
    states, and that the model (and its average) has the checkpoint's tensors.

    Args:
        where: the checkpoint's path, for messages; default: its file name.

    Raises:
        CheckpointError: a piece asked for is not in ``state``, the position or
            an RNG state is malformed, the model is not the one that saved
            (names the first keys and shapes that differ), the world size
            changed and ``strict_rng`` is True (with False: a warning); nothing
            is loaded then. The settings in ``state["extra"]`` are checked
            before, by every rank together (``CheckpointManager.resume``).
    """
    name = where or found.name
    saved, now = state.get("world_size"), get_world_size()
    try:
        if int(state.get("version", 0)) >= 2:
            position = check_position(state)[1]
        else:  # 0.1's format: an epoch end
            position = Position(int(state["epoch"]) + 1, 0, 0, 0, int(saved or 1))
        _check_rng_list(state.get("rng"), position.world_size)
    except ValueError as exc:
        raise CheckpointError(
            f"{name} cannot be resumed: {exc}. The file was changed after it was written, or "
            "not by ddpkit; resume from another checkpoint. " + see("checkpoints")
        ) from None
    training.check(state, name)
    saved = position.world_size
    if saved != now:
        message = f"{name} holds RNG states for {saved} ranks and this job has {now}"
        if strict_rng:
            raise CheckpointError(f"{message}; pass strict_rng=False to resume without them")
        if get_rank() == 0:  # the same words from every rank say nothing more
            warnings.warn(
                f"{message}; resuming without restoring RNG state, so the run continues but "
                "is not bit-exact with an uninterrupted one",
                RuntimeWarning,
                stacklevel=4,
            )
    training.load(state)
    if saved == now:
        restore_rng_state(state["rng"][get_rank()])
    _restore_hook(comm_hook_of(training.model), state.get("comm_hook"), name, saved, now)
    extra, loader = state.get("extra"), state.get("loader")
    return Restored(
        position,
        state.get("loop"),
        state.get("best_acc1"),
        state.get("best_epoch"),
        extra if isinstance(extra, dict) else None,
        list(loader) if isinstance(loader, list | tuple) else None,
    )


def _restore_hook(hook: CommHook | None, saved: Any, name: str, world: int, now: int) -> None:
    """Give this rank its own PowerSGD state back; say so when it starts afresh instead."""
    if hook is None or hook.state is None:
        if isinstance(saved, list) and hook is not None and get_rank() == 0:
            warnings.warn(
                f"{name} holds each rank's PowerSGD state, and this run's comm hook is "
                f"{hook.kind or 'none'}: it is not used",
                RuntimeWarning,
                stacklevel=4,
            )
        return
    if world != now:
        why: str | None = f"it was saved by {world} ranks and this job has {now}"
    elif not isinstance(saved, list) or len(saved) != now:
        why = "it holds no PowerSGD state (it was saved without comm_hook='powersgd')"
    else:
        why = hook.load_state_dict(saved[get_rank()])
    if why is not None and get_rank() == 0:
        warnings.warn(
            f"{name}: PowerSGD's error feedback and P/Q memories start afresh on every rank, "
            f"so the run is not bit-exact with an unbroken one: {why}. "
            + see("gradient-compression-comm_hook"),
            RuntimeWarning,
            stacklevel=4,
        )


def _check_rng_list(rng: Any, world_size: int) -> None:
    """The checkpoint's ``rng``: one state of :func:`capture_rng_state` per saving rank."""
    if not isinstance(rng, list | tuple):
        raise ValueError(f"its 'rng' field is {rng!r:.60}, not a list of one RNG state per rank")
    if len(rng) != world_size:
        raise ValueError(
            f"its 'rng' field holds {len(rng)} RNG state(s), but {world_size} rank(s) saved it"
        )
    for rank, entry in enumerate(rng):
        try:
            check_rng_state(entry)
        except ValueError as exc:
            raise ValueError(f"its 'rng' field, entry {rank} (rank {rank}'s): {exc}") from None
