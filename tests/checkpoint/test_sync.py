"""ddpkit.checkpoint.sync: ranks agreeing on the checkpoint to resume from, and restoring it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit.checkpoint.files import FORMAT, LATEST, VERSION, Found, step_name
from ddpkit.checkpoint.serialization import CheckpointError, save_checkpoint
from ddpkit.checkpoint.state import TrainingState
from ddpkit.checkpoint.sync import (
    describe_error,
    load_newest,
    next_generation,
    rank0_state,
    restore_state,
    share_outcome,
)
from ddpkit.position import Position
from ddpkit.rng import capture_rng_state
from ddpkit.testing import run_distributed


def _state(step: int, kind: str, generation: int = 1, value: float = 0.0) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "kind": kind, "generation": generation,
            "epoch": 0, "snapshot": f"g{generation}-s{step}-{kind}", "world_size": 2,
            "position": _position(step, kind), "w": torch.full((3,), value)}  # fmt: skip


def _position(step: int, kind: str) -> dict[str, int]:
    """A whole position: the next epoch's start after an epoch file, mid-epoch otherwise."""
    if kind == "epoch":
        return Position(1, 0, 0, step, 2).as_dict()
    return Position(0, 1, 4, step, 2).as_dict()


def _agree(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each rank has its own directory (no shared file system); several agreements in a row."""
    mine = Path(root) / f"rank{rank}"
    out: dict[str, Any] = {}
    # 1. Only rank 0 holds the newest checkpoint: rank 1 is sent it.
    (mine / "a").mkdir(parents=True)
    if rank == 0:
        save_checkpoint(_state(8, "epoch", value=8.0), mine / "a" / LATEST)
    else:
        save_checkpoint(_state(6, "step", value=6.0), mine / "a" / step_name(6))
    got = load_newest(mine / "a", None, "cpu")
    assert got.state is not None
    assert got.found is not None
    out["a"] = (got.found.name, got.source, float(got.state["w"][0]), got.file is not None,
                got.generation, got.latest_damaged)  # fmt: skip
    # 2. Rank 0's latest.pth is damaged: the next newest, on rank 1, for everyone.
    (mine / "b").mkdir()
    if rank == 0:
        (mine / "b" / LATEST).write_bytes(b"\0" * 200)
    else:
        save_checkpoint(_state(6, "step", value=6.0), mine / "b" / step_name(6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = load_newest(mine / "b", None, "cpu")
    assert got.state is not None
    assert got.found is not None
    out["b"] = (got.found.name, got.source, float(got.state["w"][0]), got.latest_damaged,
                [str(w.message) for w in caught])  # fmt: skip
    # 3. Nothing anywhere: a fresh start; the next generation is 1 past any rank's.
    empty = load_newest(mine / "none", None, "cpu")
    out["c"] = (empty.state, empty.found, empty.generation)
    out["generation"] = next_generation(mine / "a")
    # 4. An explicit file that no rank can read.
    try:
        load_newest(mine / "a", mine / "missing.pth", "cpu")
    except CheckpointError as exc:
        out["d"] = str(exc)
    # 5. A failed blocking save reaches every rank.
    try:
        share_outcome(OSError("disk full") if rank == 1 else None, "epoch")
    except (CheckpointError, OSError) as exc:
        out["e"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.timeout(180)
def test_two_ranks_with_their_own_directories_agree(tmp_path: Path) -> None:
    zero, one = run_distributed(_agree, 2, args=(str(tmp_path),), timeout=150)
    assert zero["a"] == (LATEST, 0, 8.0, True, 1, False)
    assert one["a"] == (LATEST, 0, 8.0, False, 1, False)  # sent by rank 0, not read
    assert zero["b"][:4] == (step_name(6), 1, 6.0, True)  # its own latest.pth is damaged
    assert one["b"][:4] == (step_name(6), 1, 6.0, False)
    assert any("is damaged and cannot be loaded" in w for w in zero["b"][4])
    assert one["b"][4] == []  # warned once, by the rank that found it
    assert zero["c"] == one["c"] == (None, None, 0)
    assert zero["generation"] == one["generation"] == 2
    assert "missing.pth" in zero["d"]
    assert "is not a checkpoint on any rank" in zero["d"]
    assert "is not a checkpoint on any rank" in one["d"]
    assert zero["e"] == (
        "CheckpointError: rank 1 could not write its copy of the epoch checkpoint: "
        "OSError: disk full"
    )
    assert one["e"] == "OSError: disk full"


def _saved(world_size: int = 1, **drop: None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    state: dict[str, Any] = {
        "version": VERSION,
        "kind": "step",
        "model": model.state_dict(),
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": None,
        "scaler": None,
        "ema": None,
        "world_size": world_size,
        "rng": [capture_rng_state()] * world_size,
        "epoch": 2,
        "position": Position(2, 3, 12, 7, world_size).as_dict(),
        "loop": [1.0],
        "best_acc1": 50.0,
        "best_epoch": 1,
    }
    for key in drop:
        del state[key]
    return state


_FOUND = Found("latest.pth", "s", 1, 7, "step", 2, 1)


def test_restore_loads_the_weights_and_returns_the_position() -> None:
    model = nn.Linear(2, 1)
    done = restore_state(_saved(), _FOUND, TrainingState(model), strict_rng=True)
    assert torch.equal(model.weight, _saved()["model"]["weight"])
    assert done.position == Position(2, 3, 12, 7, 1)
    assert (done.loop, done.best_acc1, done.best_epoch) == ([1.0], 50.0, 1)
    old = restore_state(_saved(position=None, version=None), _FOUND, TrainingState(model), True)
    assert old.position == Position(3, 0, 0, 0, 1)  # 0.1's format: the end of epoch 2


def test_restore_refuses_parts_the_checkpoint_lacks() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = _saved()
    state["optimizer"] = None
    with pytest.raises(
        CheckpointError, match=r"latest\.pth holds no optimizer state; pass optimizer"
    ):
        restore_state(state, _FOUND, TrainingState(model, optimizer), strict_rng=True)
    with pytest.raises(CheckpointError, match="holds no model average"):
        restore_state(_saved(), _FOUND, TrainingState(model, ema=nn.Linear(2, 1)), True)


def test_another_world_size_needs_strict_rng_off() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(CheckpointError, match="RNG states for 2 ranks and this job has 1"):
        restore_state(_saved(world_size=2), _FOUND, TrainingState(model), strict_rng=True)
    with pytest.warns(RuntimeWarning, match="resuming without restoring RNG state"):
        restore_state(_saved(world_size=2), _FOUND, TrainingState(model), strict_rng=False)


def test_without_a_group_the_state_is_the_modules_and_errors_are_described() -> None:
    model = nn.Linear(2, 1)
    assert rank0_state(model, gather=True).keys() == model.state_dict().keys()
    assert describe_error(None) is None
    assert describe_error(ValueError("bad")) == "ValueError: bad"
