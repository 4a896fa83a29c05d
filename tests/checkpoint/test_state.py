"""The training state a checkpoint holds: bound once to the manager, saved and restored whole."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit.checkpoint import CheckpointError, CheckpointManager, TrainingState
from ddpkit.training import model_ema


def _objects(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return TrainingState(model, optimizer, scheduler, ema=model_ema(model, decay=0.9))


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_manager_saves_and_restores_the_bound_state_without_being_passed_it(
    tmp_path: Path,
) -> None:
    saved = _objects(0)
    CheckpointManager(tmp_path, state=saved).save(0, metrics={"acc1": 50.0})
    fresh = _objects(1)
    manager = CheckpointManager(tmp_path)
    manager.bind(fresh)
    assert manager.resume() == 1
    assert _equal(fresh.model.state_dict(), saved.model.state_dict())
    assert fresh.optimizer.state_dict()["state"][0]["momentum_buffer"].equal(
        saved.optimizer.state_dict()["state"][0]["momentum_buffer"]
    )
    assert fresh.scheduler.state_dict() == saved.scheduler.state_dict()
    assert fresh.ema is not None
    assert saved.ema is not None
    assert _equal(fresh.ema.state_dict(), saved.ema.state_dict())


def test_saving_with_nothing_bound_is_a_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="bind it once"):
        CheckpointManager(tmp_path).save(0)
    with pytest.raises(TypeError, match="TrainingState"):
        CheckpointManager(tmp_path).bind(nn.Linear(2, 2))  # type: ignore[arg-type]
    assert not tmp_path.joinpath("latest.pth").exists()


def test_the_former_call_form_binds_the_objects_it_is_given_with_a_warning(
    tmp_path: Path,
) -> None:
    from ddpkit._graveyard import DdpkitDeprecationWarning

    state = _objects(0)
    manager = CheckpointManager(tmp_path)
    with pytest.warns(DdpkitDeprecationWarning, match=r"CheckpointManager.save\(epoch") as seen:
        manager.save(0, state.model, state.optimizer, state.scheduler, metrics={"acc1": 1.0})
    assert len(seen) == 1  # one warning for the one deprecated call, objects and all
    assert manager.state is not None
    assert manager.state.model is state.model
    manager.state.end_epoch(1, 1)
    manager.checkpoint("epoch")  # the bound objects, through the one verb
    assert manager.resume() == 2


def test_a_piece_the_file_lacks_is_named_before_anything_is_loaded(tmp_path: Path) -> None:
    state = _objects(0)
    CheckpointManager(tmp_path, state=dataclasses.replace(state, ema=None)).save(0)
    fresh = _objects(1)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"no model average \(EMA\) state"):
        CheckpointManager(tmp_path, state=fresh).resume()
    assert _equal(fresh.model.state_dict(), before)


class _Counter:
    """A sixth piece of state: anything with state_dict / load_state_dict."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


@dataclasses.dataclass(eq=False)
class _WithCounter(TrainingState):
    counter: _Counter | None = None


def test_a_new_piece_of_state_is_one_field_of_the_state_class(tmp_path: Path) -> None:
    # Nothing else changes: the manager saves and restores what the class lists.
    saved = _objects(0)
    CheckpointManager(tmp_path, state=_WithCounter(**vars(saved), counter=_Counter(7))).save(0)
    fresh = _WithCounter(**vars(_objects(1)), counter=_Counter(0))
    CheckpointManager(tmp_path, state=fresh).resume()
    assert fresh.counter is not None
    assert fresh.counter.value == 7
    assert "counter" in fresh.pieces()


def test_capture_holds_every_piece_by_name_and_none_for_absent_ones() -> None:
    state = dataclasses.replace(_objects(0), scheduler=None, ema=None)
    captured = state.capture(gather=False)
    assert set(captured) == {"model", "optimizer", "scheduler", "scaler", "ema"}
    assert captured["scheduler"] is None
    assert captured["scaler"] is None
    assert state.learning_rate() == pytest.approx(0.05)
    assert TrainingState(nn.Linear(1, 1)).learning_rate() is None


def test_the_position_totals_and_extra_travel_in_the_bag(tmp_path: Path) -> None:
    from ddpkit import Position

    saved = _objects(0)
    saved.position = Position(2, 3, 12, 7, 1)
    saved.loop = {"loss_sum": 4.5, "samples": 12}
    saved.extra = {"config": {"lr": 0.1}}
    manager = CheckpointManager(tmp_path, state=saved, extra={"arch": "linear"})
    path = manager.checkpoint("step")
    assert path == tmp_path / "step-000000007.pth"
    fresh = _objects(1)
    restored = CheckpointManager(tmp_path, state=fresh, extra={"arch": "linear"})
    assert restored.resume() == 2
    assert fresh.position == Position(2, 3, 12, 7, 1)
    assert fresh.loop == {"loss_sum": 4.5, "samples": 12}
    assert restored.resumed_extra == {"arch": "linear", "config": {"lr": 0.1}}
    with pytest.raises(ValueError, match="kind must be one of"):
        manager.checkpoint("weekly")


def test_rank0_state_is_the_modules_own_without_a_group() -> None:
    from ddpkit.checkpoint.state import rank0_state

    model = nn.Linear(2, 1)
    assert rank0_state(model, gather=True).keys() == model.state_dict().keys()


def test_the_former_attribute_network_reads_prefix_with_a_warning(tmp_path: Path) -> None:
    from ddpkit._graveyard import DdpkitDeprecationWarning

    manager = CheckpointManager(tmp_path, prefix="seresnext")
    with pytest.warns(DdpkitDeprecationWarning, match=r"CheckpointManager\.network is deprecated"):
        assert manager.network == "seresnext"
