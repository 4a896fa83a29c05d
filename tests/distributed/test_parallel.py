"""wrap_ddp, unwrap_model and no_sync on one process and inside real Gloo groups."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.distributed.parallel import no_sync, unwrap_model, wrap_ddp
from ddpkit.testing import run_distributed

_DEFAULT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _has_plain_batchnorm(model: nn.Module) -> bool:
    kinds = [type(m) for m in model.modules()]
    return nn.BatchNorm1d in kinds and nn.SyncBatchNorm not in kinds


def test_one_process_returns_the_same_model_unwrapped() -> None:
    model = _bn_net()
    out = wrap_ddp(model, find_unused_parameters=True)
    assert out is model
    assert not isinstance(out, DistributedDataParallel)
    assert _has_plain_batchnorm(out)
    assert next(out.parameters()).device.type == _DEFAULT_DEVICE
    assert wrap_ddp(_bn_net(), device="cpu").training  # nothing else changes


def test_ddp_kwargs_are_checked_on_one_process_too() -> None:
    with pytest.raises(TypeError, match=r"no argument\(s\) \['find_unused_parameter'\]"):
        wrap_ddp(_bn_net(), find_unused_parameter=True)
    with pytest.raises(ValueError, match=r"pass device=\.\.\. instead of device_ids"):
        wrap_ddp(_bn_net(), device_ids=[0])


def test_model_without_trainable_parameters_is_rejected() -> None:
    frozen = _bn_net().requires_grad_(False)
    with pytest.raises(ValueError, match="unfreeze at least the head"):
        wrap_ddp(frozen)


def test_unwrap_model_sees_through_compile_and_data_parallel() -> None:
    model = nn.Linear(2, 2)
    assert unwrap_model(model) is model
    assert unwrap_model(torch.compile(model, backend="eager")) is model
    assert unwrap_model(nn.DataParallel(model)) is model
    nested = torch.compile(nn.DataParallel(torch.compile(model, backend="eager")), backend="eager")
    assert unwrap_model(nested) is model
    with pytest.raises(TypeError, match=r"unwrap_model takes an nn\.Module, got function"):
        unwrap_model(lambda x: x)


def test_no_sync_without_ddp_does_nothing() -> None:
    model = nn.Linear(2, 2)
    assert isinstance(no_sync(model), contextlib.nullcontext)
    assert isinstance(no_sync(torch.compile(model, backend="eager")), contextlib.nullcontext)
    assert isinstance(no_sync(lambda x: x), contextlib.nullcontext)


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _raises(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _wrap_checks(rank: int) -> dict[str, Any]:
    log = logging.getLogger("ddpkit")
    keep = _Keep()
    log.addHandler(keep)
    log.setLevel(logging.INFO)

    model = _bn_net()
    ddp = wrap_ddp(model, find_unused_parameters=True, broadcast_buffers=False)
    assert isinstance(ddp, DistributedDataParallel)
    compiled = torch.compile(ddp, backend="eager")  # lazy: nothing compiles here
    with no_sync(compiled):
        sync_inside = ddp.require_backward_grad_sync
    with no_sync(ddp, enabled=False):
        sync_disabled = ddp.require_backward_grad_sync
    result: dict[str, Any] = {
        "device_ids": ddp.device_ids,
        "plain_bn": _has_plain_batchnorm(ddp),
        "find_unused": ddp.find_unused_parameters,
        "broadcast_buffers": ddp.broadcast_buffers,
        "unwrapped": unwrap_model(ddp) is model,
        "unwrapped_compiled": unwrap_model(compiled) is model,
        "sync_inside": sync_inside,
        "sync_disabled": sync_disabled,
        "sync_after": ddp.require_backward_grad_sync,
        "already": _raises(wrap_ddp, ddp),
        "already_compiled": _raises(wrap_ddp, compiled),
        "frozen": _raises(wrap_ddp, nn.Linear(2, 2).requires_grad_(False)),
    }
    wrap_ddp(nn.Linear(2, 2))  # no BatchNorm: nothing to explain
    result["messages"] = keep.messages

    # Rank-dependent data: gradients differ inside no_sync and agree outside it.
    net = nn.Linear(3, 1)
    net_ddp = wrap_ddp(net)
    x = torch.full((2, 3), float(rank + 1))
    with no_sync(net_ddp):
        net_ddp(x).sum().backward()
    assert net.weight.grad is not None
    result["grad_inside"] = net.weight.grad.tolist()
    net.zero_grad(set_to_none=True)
    net_ddp(x).sum().backward()
    result["grad_outside"] = net.weight.grad.tolist()
    return result


_STEPS, _BATCH, _LR = 5, 4, 0.1


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _train(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, rank: int, world: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=_LR)
    for x, y in zip(xs, ys, strict=True):
        part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        optimizer.zero_grad()
        F.mse_loss(model(x[part]), y[part]).backward()
        optimizer.step()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(_STEPS, 2 * _BATCH, 4, generator=g, dtype=torch.float64)
    ys = torch.randn(_STEPS, 2 * _BATCH, 3, generator=g, dtype=torch.float64)
    return xs, ys


def _gloo_job(rank: int, world_size: int) -> dict[str, Any]:
    wrap = _wrap_checks(rank)
    model = _mlp()
    _train(wrap_ddp(model), *_data(), rank, world_size)
    trained = {name: value.tolist() for name, value in model.state_dict().items()}
    return {"wrap": wrap, "trained": trained}


@pytest.fixture(scope="module")
def gloo_job() -> list[dict[str, Any]]:
    # One 2-rank job serves both tests below: starting the ranks is the slow part.
    return run_distributed(_gloo_job, 2, timeout=150)


@pytest.mark.timeout(180)
def test_wrap_ddp_in_a_gloo_group(gloo_job: list[dict[str, Any]]) -> None:
    results = [job["wrap"] for job in gloo_job]
    for res in results:
        assert res["device_ids"] is None
        assert res["plain_bn"]
        assert res["find_unused"] is True
        assert res["broadcast_buffers"] is False
        assert res["unwrapped"]
        assert res["unwrapped_compiled"]
        assert (res["sync_inside"], res["sync_disabled"], res["sync_after"]) == (False, True, True)
        assert "already wrapped in DistributedDataParallel" in res["already"]
        assert "already wrapped in DistributedDataParallel" in res["already_compiled"]
        assert "unfreeze at least the head" in res["frozen"]
        explained = [m for m in res["messages"] if "SyncBatchNorm needs CUDA" in m]
        assert len(explained) == 1, res["messages"]
        assert "each rank keeps its own BatchNorm statistics" in explained[0]
    rank0, rank1 = results
    # x is 1s on rank 0 and 2s on rank 1, two rows: local grads 2 and 4, mean 3.
    assert rank0["grad_inside"] == [[2.0, 2.0, 2.0]]
    assert rank1["grad_inside"] == [[4.0, 4.0, 4.0]]
    assert rank0["grad_outside"] == rank1["grad_outside"] == [[3.0, 3.0, 3.0]]


@pytest.mark.timeout(180)
def test_two_ranks_match_one_process_with_the_whole_batch(gloo_job: list[dict[str, Any]]) -> None:
    reference = wrap_ddp(_mlp(), device="cpu")
    _train(reference, *_data(), 0, 1)
    expected = reference.state_dict()
    initial = _mlp().state_dict()
    for state in (job["trained"] for job in gloo_job):
        for name, value in expected.items():
            got = torch.tensor(state[name], dtype=torch.float64)
            torch.testing.assert_close(got, value, rtol=0, atol=1e-6)
            assert not torch.equal(got, initial[name])  # the weights did move


def _sync_bn_on_cuda(rank: int, world_size: int, init_file: str) -> dict[str, Any]:
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        device_id=torch.device("cuda", 0),
    )
    try:
        model = wrap_ddp(_bn_net())
        out = model(torch.randn(4, 4, device="cuda"))
        return {
            "ddp": isinstance(model, DistributedDataParallel),
            "device_ids": getattr(model, "device_ids", None),
            "sync_bn": any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()),
            "plain_bn": any(type(m) is nn.BatchNorm1d for m in model.modules()),
            "out_device": str(out.device),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(180)
def test_sync_batchnorm_on_cuda_with_nccl(tmp_path: Path) -> None:
    [res] = run_distributed(
        _sync_bn_on_cuda, 1, args=(str(tmp_path / "rendezvous"),), init=None, timeout=150
    )
    assert res == {
        "ddp": True,
        "device_ids": [0],
        "sync_bn": True,
        "plain_bn": False,
        "out_device": "cuda:0",
    }
