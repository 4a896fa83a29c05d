"""ddpkit.distributed.comm without a process group and inside real Gloo groups."""

from __future__ import annotations

import pytest
import torch

from ddpkit.distributed import comm
from ddpkit.testing import run_distributed


def test_helpers_without_process_group() -> None:
    assert not comm.is_dist_initialized()
    assert comm.get_rank() == 0
    assert comm.get_world_size() == 1
    assert comm.get_local_rank() == 0
    assert comm.is_main_process()
    comm.barrier()  # returns at once
    t = torch.tensor([1.5, 2.5])
    out = comm.all_reduce_sum(t)
    assert torch.equal(out, t)
    assert out is not t  # a new tensor, like the distributed path
    assert comm.all_reduce_sum(7) == 7
    assert comm.all_reduce_sum(0.25) == 0.25
    assert comm.all_gather_object({"a": 1}) == [{"a": 1}]


@pytest.mark.parametrize("bad", ["3", None, True, [1, 2]])
def test_all_reduce_sum_rejects_non_numbers(bad: object) -> None:
    with pytest.raises(TypeError, match="all_reduce_sum takes a tensor"):
        comm.all_reduce_sum(bad)  # type: ignore[call-overload]


def _exercise_comm(rank: int, world_size: int) -> dict[str, object]:
    comm.barrier()
    t = torch.tensor([float(rank), 1.0], dtype=torch.float32)
    summed = comm.all_reduce_sum(t)
    # big ints must stay exact: float32 or float64 would round 2**60 + rank
    big = comm.all_reduce_sum(2**60 + rank)
    return {
        "rank": comm.get_rank(),
        "world": comm.get_world_size(),
        "local": comm.get_local_rank(),
        "main": comm.is_main_process(),
        "tensor": summed.tolist(),
        "input_untouched": t.tolist(),
        "int": comm.all_reduce_sum(rank + 1),
        "big": big,
        "float": comm.all_reduce_sum(0.5 * rank),
        "gathered": comm.all_gather_object(("rank", rank, [rank] * rank)),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_helpers_inside_process_group(world_size: int) -> None:
    results = run_distributed(_exercise_comm, world_size, timeout=90)
    ranks = list(range(world_size))
    expected_gather = [("rank", r, [r] * r) for r in ranks]
    for r, res in zip(ranks, results, strict=True):
        assert res["rank"] == r
        assert res["world"] == world_size
        assert res["local"] == r
        assert res["main"] is (r == 0)
        assert res["tensor"] == [float(sum(ranks)), float(world_size)]
        assert res["input_untouched"] == [float(r), 1.0]
        assert res["int"] == sum(r + 1 for r in ranks)
        assert res["big"] == world_size * 2**60 + sum(ranks)
        assert isinstance(res["float"], float)
        assert res["float"] == pytest.approx(0.5 * sum(ranks))
        assert res["gathered"] == expected_gather
