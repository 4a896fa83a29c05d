"""SaveCadence: the rule for step checkpoints, validated when it is made."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from ddpkit.checkpoint import CheckpointManager
from ddpkit.checkpoint.cadence import SaveCadence
from ddpkit.checkpoint.cadence import SaveCadence as FromConfig


def test_steps_are_counted_over_the_run() -> None:
    cadence = SaveCadence(every_steps=4)
    assert [s for s in range(0, 13) if cadence.step_due(s)] == [4, 8, 12]
    assert not cadence.time_due(1e9)


def test_minutes_are_compared_with_the_time_since_the_last_save() -> None:
    cadence = SaveCadence(every_minutes=Fraction(1, 2))
    assert cadence.every_minutes == 0.5
    assert not cadence.time_due(29.9)
    assert cadence.time_due(30.0)
    assert not any(cadence.step_due(s) for s in range(100))


def test_nothing_asked_is_never_due() -> None:
    cadence = SaveCadence()
    assert not cadence.step_due(1)
    assert not cadence.time_due(1e12)


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "10"])
def test_a_bad_step_count_is_named(steps: object) -> None:
    with pytest.raises(ValueError, match="every_steps must be at least 1"):
        SaveCadence(every_steps=steps)  # type: ignore[arg-type]


@pytest.mark.parametrize("minutes", [0, -1, float("nan"), float("inf"), "5", True])
def test_bad_minutes_are_named(minutes: object) -> None:
    with pytest.raises(ValueError, match="every_minutes must be > 0"):
        SaveCadence(every_minutes=minutes)  # type: ignore[arg-type]


def test_the_manager_holds_one_frozen_cadence_and_config_re_exports_it(tmp_path) -> None:
    manager = CheckpointManager(tmp_path, every_steps=500, every_minutes=10)
    assert manager.cadence == SaveCadence(every_steps=500, every_minutes=10.0)
    assert manager.clock.cadence is manager.cadence
    with pytest.raises(dataclasses.FrozenInstanceError):
        manager.cadence.every_steps = 1  # type: ignore[misc]
    assert FromConfig is SaveCadence
