"""ddpkit.checkpoint.restore: every check before anything loads, then the objects and position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit.checkpoint.files import VERSION, Found
from ddpkit.checkpoint.restore import check_extra, restore_state
from ddpkit.checkpoint.serialization import CheckpointError
from ddpkit.checkpoint.state import TrainingState
from ddpkit.position import Position
from ddpkit.rng import capture_rng_state


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


def test_another_extra_is_refused_naming_the_key() -> None:
    check_extra("latest.pth", {"arch": "a", "other": 1}, {"arch": "a"})  # the same: fine
    said = r"latest\.pth was trained with arch b; this run has arch a"
    with pytest.raises(CheckpointError, match=said):
        check_extra("latest.pth", {"arch": "b"}, {"arch": "a"})


HOOK_CHANGES = [
    ("powersgd", "powersgd", None),
    ("none", "powersgd", "holds no PowerSGD state (it was saved without"),
    ("powersgd", "bf16", "holds each rank's PowerSGD state, and this run's comm hook is bf16"),
]


def _hook_changes(rank: int, world: int, directory: str) -> list[list[str]]:
    """Save a step checkpoint with each case's hook, resume it with the other: the warnings."""
    import warnings

    from ddpkit import CheckpointManager, wrap_ddp

    def wrapped(hook: str) -> nn.Module:
        torch.manual_seed(0)
        extra = {"powersgd_warmup": 2} if hook == "powersgd" else {}
        return wrap_ddp(nn.Linear(8, 8), comm_hook=None if hook == "none" else hook, **extra)

    said = []
    for case, (saved, resumed, _) in enumerate(HOOK_CHANGES):
        model = wrapped(saved)
        where = f"{directory}/{case}"
        manager = CheckpointManager(where, state=TrainingState(model))
        manager.claim()
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        manager.state.advance(Position(0, 3, 12, 3, world))
        manager.checkpoint("step")
        again = CheckpointManager(where, state=TrainingState(wrapped(resumed)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again.resume()
        said.append([str(w.message) for w in caught if "PowerSGD" in str(w.message)])
    return said


@pytest.mark.timeout(120)
def test_a_hook_changed_between_save_and_resume_is_said_once(tmp_path: Path) -> None:
    from ddpkit.testing import run_distributed

    ranks = run_distributed(_hook_changes, 2, args=(str(tmp_path),), timeout=90)
    for case, (_, _, said) in enumerate(HOOK_CHANGES):
        warned = [rank[case] for rank in ranks]
        if said is None:
            assert warned == [[], []]
        else:
            assert len(warned[0]) == 1, warned  # rank 0 says it, once
            assert said in warned[0][0]
            assert warned[1] == []
