"""RNG capture and restore, and the per-sample seeding the loaders use."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpkit import load_checkpoint, save_checkpoint
from ddpkit.rng import capture_rng_state, restore_rng_state, sample_seed, seeded


def test_rng_state_round_trips_through_a_file(tmp_path: Path) -> None:
    state = capture_rng_state()
    expected = (torch.rand(3), random.random(), np.random.rand(2), np.random.randn())
    save_checkpoint({"rng": state}, tmp_path / "rng.pth")
    # Move every generator on, as the rest of a training epoch would.
    torch.rand(5)
    random.random()
    np.random.rand(7)
    restore_rng_state(load_checkpoint(tmp_path / "rng.pth")["rng"])
    again = (torch.rand(3), random.random(), np.random.rand(2), np.random.randn())
    assert torch.equal(again[0], expected[0])
    assert again[1] == expected[1]
    assert np.array_equal(again[2], expected[2])
    assert again[3] == expected[3]
    with pytest.raises(ValueError, match="numpy"):
        restore_rng_state({"python": state["python"], "torch": state["torch"]})


def test_seeded_repeats_and_restores_the_callers_rngs() -> None:
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    expected_after = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    with seeded(sample_seed(1, 2, 3)):
        first = (torch.rand(2), random.random(), np.random.rand())
    with seeded(sample_seed(1, 2, 3)):
        again = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0])
    assert first[1:] == again[1:]
    # The caller's generators continue as if the seeded blocks never ran.
    after = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(after[0], expected_after[0])
    assert after[1:] == expected_after[1:]


def test_seeded_without_restore_leaves_the_new_state() -> None:
    with seeded(5, restore=False):
        pass
    inside = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(inside, torch.rand(1))


def test_sample_seeds_differ_across_seed_epoch_and_index() -> None:
    # Sample 0 of epoch 1 once had the seed of sample 1 of epoch 0 (index ^ epoch).
    seeds = {sample_seed(s, e, i) for s in range(3) for e in range(30) for i in range(1000)}
    assert len(seeds) == 3 * 30 * 1000
    assert all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(0, 1, 2) == sample_seed(0, 1, 2)


def test_each_draw_of_a_sample_has_its_own_seed_and_none_is_the_single_draw() -> None:
    assert sample_seed(1, 2, 3, None) == sample_seed(1, 2, 3)
    seeds = {sample_seed(1, 2, 3, d) for d in range(1000)} | {sample_seed(1, 2, 3)}
    assert len(seeds) == 1001
    assert sample_seed(1, 2, 3, 4) != sample_seed(1, 2, 4, 3)
