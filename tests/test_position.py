"""ddpkit.position.Position: mid-epoch, the dict a checkpoint stores, and reading it back."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ddpkit.position import Position


def test_defaults_are_the_start_of_a_one_rank_run() -> None:
    start = Position()
    assert (start.epoch, start.batches, start.samples, start.step, start.world_size) == (
        0, 0, 0, 0, 1,
    )  # fmt: skip
    assert not start.mid_epoch


@pytest.mark.parametrize(
    ("batches", "samples", "mid"), [(0, 0, False), (1, 0, True), (0, 8, True), (3, 24, True)]
)
def test_mid_epoch_means_part_of_the_epoch_is_done(batches: int, samples: int, mid: bool) -> None:
    assert Position(epoch=4, batches=batches, samples=samples, step=9).mid_epoch is mid


def test_as_dict_round_trips_and_holds_plain_ints() -> None:
    here = Position(epoch=2, batches=5, samples=40, step=17, world_size=4)
    stored = here.as_dict()
    assert stored == {"epoch": 2, "batches": 5, "samples": 40, "step": 17, "world_size": 4}
    assert all(type(v) is int for v in stored.values())
    assert Position.from_dict(stored) == here


FULL = {"epoch": 3, "batches": 2, "samples": 16, "step": 9, "world_size": 1}


@pytest.mark.parametrize(
    "value", [torch.tensor(3), np.int64(3), 3.0, "3", True], ids=lambda v: type(v).__name__
)
def test_from_dict_takes_plain_ints_only(value: object) -> None:
    # A save writes plain ints: anything else was written by something else.
    with pytest.raises(ValueError, match=r"the position's epoch is .* not an int"):
        Position.from_dict({**FULL, "epoch": value})
    assert Position.from_dict(FULL) == Position(epoch=3, batches=2, samples=16, step=9)


def test_from_dict_ignores_unknown_keys_and_names_a_missing_one() -> None:
    assert Position.from_dict({**FULL, "future_field": 5}) == Position.from_dict(FULL)
    for name in FULL:
        with pytest.raises(ValueError, match=f"lacks its '{name}' field"):
            Position.from_dict({k: v for k, v in FULL.items() if k != name})


def test_from_dict_refuses_a_value_that_is_not_a_number() -> None:
    with pytest.raises((TypeError, ValueError)):
        Position.from_dict({"epoch": "two"})
    with pytest.raises((TypeError, ValueError)):
        Position.from_dict({"step": None})


def test_a_position_is_frozen_and_hashable() -> None:
    here = Position(epoch=1, batches=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        here.epoch = 3  # type: ignore[misc]
    assert {here, Position(epoch=1, batches=2)} == {here}


def test_the_orders_seed_is_stored_and_read_back() -> None:
    position = Position(1, 3, 12, 7, 2, 48, "sha256:ab", 11)
    assert position.as_dict()["data_seed"] == 11
    assert Position.from_dict(position.as_dict()) == position
    with pytest.raises(ValueError, match="data_seed"):
        Position.from_dict({**position.as_dict(), "data_seed": -1})
