"""Stragglers: the rule that names the slow rank, and a real 2-rank fit with a slow disk."""

from __future__ import annotations

from typing import Any

import pytest
from train_jobs import straggler_run

from ddpkit.testing import run_distributed
from ddpkit.training.reporting import epoch_line
from ddpkit.training.stragglers import find_straggler, straggler_text


def _timings(*pairs: tuple[float, float]) -> list[dict[str, Any]]:
    return [{"host": f"gpu{r}", "data_s": d, "compute_s": c} for r, (d, c) in enumerate(pairs)]


def test_a_rank_waiting_for_data_is_named_though_every_epoch_takes_as_long() -> None:
    # DDP: the others wait for rank 2 in the all-reduce, so their compute is longer.
    found = find_straggler(_timings((1.0, 99.0), (1.0, 99.0), (40.0, 60.0), (1.0, 99.0)))
    assert found is not None
    assert (found["rank"], found["host"], found["cause"]) == (2, "gpu2", "data")
    assert found["slower"] == pytest.approx(0.39)
    text = straggler_text(found)
    assert text.startswith("straggler: rank 2 on host gpu2, 39% slower than the median rank")
    assert "waiting for data 40% of its time (median rank 1%)" in text


def test_a_rank_whose_epoch_is_longer_in_compute_is_named_for_compute() -> None:
    found = find_straggler(_timings((1.0, 50.0), (1.0, 80.0), (1.0, 50.0)))
    assert found is not None
    assert (found["rank"], found["cause"]) == (1, "compute")
    assert "in compute" in straggler_text(found)


@pytest.mark.parametrize(
    "timings",
    [
        _timings((1.0, 10.0)),  # one rank: nobody to compare with
        _timings((1.0, 10.0), (1.5, 9.5), (1.9, 9.2)),  # within 10 %
        _timings((0.0, 0.0), (0.0, 0.0)),
    ],
)
def test_ranks_within_ten_percent_name_nobody(timings: list[dict[str, Any]]) -> None:
    assert find_straggler(timings) is None


def test_the_epoch_line_names_the_straggler_and_shows_the_spread() -> None:
    found = find_straggler(_timings((1.0, 9.0), (6.0, 4.0)))
    record = {
        "epoch": 1,
        "train_loss": 0.5,
        "rank_data_s": [1.0, 6.0],
        "rank_spread": 0.0,
        "straggler": found,
    }
    line = epoch_line(record, 2)
    assert "ranks: spread 0%, data wait 1.0-6.0 s" in line
    assert "straggler: rank 1 on host gpu1" in line


@pytest.mark.timeout(120)
def test_a_real_rank_reading_3x_slower_is_named_and_a_balanced_run_names_nobody() -> None:
    balanced, slow = run_distributed(straggler_run, 2, timeout=100)[0]
    assert [straggler for straggler, _, _ in balanced] == [None, None, None], balanced
    ((found, _, line),) = slow
    assert found is not None, slow
    assert (found["rank"], found["cause"]) == (1, "data")
    assert "straggler: rank 1 on host" in line
