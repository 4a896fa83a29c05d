"""ddpkit.training.ema: model_ema's average and its checks, sync_ema_buffers over ranks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit.testing import run_distributed
from ddpkit.training.ema import model_ema, sync_ema_buffers


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))


def _part(module: nn.Module, index: int) -> Any:
    return module.get_submodule(str(index))


def test_the_first_update_copies_then_each_one_averages_with_decay() -> None:
    net = _net()
    ema = model_ema(net, decay=0.75)
    assert ema.module is not net  # a copy, not the model
    first = _part(net, 0).weight.detach().clone()
    ema.update_parameters(net)
    assert torch.equal(_part(ema.module, 0).weight, first)
    with torch.no_grad():
        _part(net, 0).weight.add_(4.0)
        _part(net, 1).running_mean.fill_(8.0)
    ema.update_parameters(net)
    assert torch.allclose(_part(ema.module, 0).weight, 0.75 * first + 0.25 * (first + 4.0))
    # Buffers are averaged too (use_buffers=True): BatchNorm statistics included.
    assert torch.allclose(_part(ema.module, 1).running_mean, torch.full((2,), 0.25 * 8.0))


def test_the_average_is_built_on_the_unwrapped_model() -> None:
    net = _net()
    # A DistributedDataParallel without a process group: only what unwrapping looks at.
    ddp_like = torch.nn.parallel.DistributedDataParallel.__new__(
        torch.nn.parallel.DistributedDataParallel
    )
    nn.Module.__init__(ddp_like)
    ddp_like.module = net
    ema = model_ema(ddp_like)
    assert set(ema.module.state_dict()) == set(net.state_dict())


@pytest.mark.parametrize("decay", [0, 1, -0.5, 1.5, math.nan, math.inf, True])
def test_a_decay_outside_0_1_is_refused(decay: float) -> None:
    with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\)"):
        model_ema(_net(), decay=decay)


def test_without_a_process_group_syncing_buffers_changes_nothing() -> None:
    ema = model_ema(_net())
    before = {k: v.clone() for k, v in ema.module.state_dict().items()}
    sync_ema_buffers(ema)
    assert all(torch.equal(v, before[k]) for k, v in ema.module.state_dict().items())


def _sync(rank: int, world_size: int) -> tuple[list[float], list[float]]:
    ema = model_ema(_net())
    with torch.no_grad():
        _part(ema.module, 1).running_mean.fill_(float(rank + 1))
        _part(ema.module, 0).bias.fill_(float(rank + 10))  # a parameter: not a buffer, left alone
    sync_ema_buffers(ema)
    return _part(ema.module, 1).running_mean.tolist(), _part(ema.module, 0).bias.tolist()


@pytest.mark.timeout(180)
def test_every_rank_takes_rank_0s_averaged_buffers() -> None:
    out = run_distributed(_sync, 2, timeout=150)
    assert [means for means, _ in out] == [[1.0, 1.0], [1.0, 1.0]]
    assert [bias for _, bias in out] == [[10.0, 10.0], [11.0, 11.0]]
