"""Gradient compression hooks in real Gloo groups: refusals, bytes, PowerSGD's per-rank state.

The resume tests train a small convolutional net on 2 ranks with PowerSGD in
several buckets, stop after some steps, build a new DDP model (whose first
step runs one bucket of every gradient, as after a restart) and go on from
the saved state: each rank's own state continues ``torch.equal`` to a run
never stopped; every rank given rank 0's state, as PyTorch's docs save it,
does not.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.distributed.compression import comm_hook_of
from ddpkit.distributed.parallel import wrap_ddp
from ddpkit.testing import run_distributed

STEPS, STOP = 8, 5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 4),
    )  # fmt: skip


def _wrapped(hook: str | None, **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    # A tiny bucket cap: one bucket per layer or two, as a big model has.
    model = wrap_ddp(_net(), comm_hook=hook, bucket_cap_mb=0.002, **options)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def _weights(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    momenta = [s["momentum_buffer"] for s in optimizer.state_dict()["state"].values()]
    return [p.detach().clone() for p in model.parameters()] + [m.clone() for m in momenta]


def _resumed(rank: int, world: int, given: str, stop: int = STOP) -> dict[str, Any]:
    model, optimizer = _wrapped("powersgd", powersgd_warmup=2)
    for step in range(stop):
        _step(model, optimizer, rank, step)
    hook = comm_hook_of(model)
    assert hook is not None
    # Copies, as a checkpoint file holds: state dicts hold the live tensors.
    saved = copy.deepcopy((hook.state_dict(), model.state_dict(), optimizer.state_dict()))
    rank0 = [saved[0]]
    dist.broadcast_object_list(rank0, src=0)
    for step in range(stop, STEPS):
        _step(model, optimizer, rank, step)
    reference = _weights(model, optimizer)

    model, optimizer = _wrapped("powersgd", powersgd_warmup=2)  # as a restarted process has
    model.load_state_dict(saved[1])
    optimizer.load_state_dict(saved[2])
    again = comm_hook_of(model)
    assert again is not None
    assert again.load_state_dict(saved[0] if given == "own" else rank0[0]) is None
    for step in range(stop, STEPS):
        _step(model, optimizer, rank, step)
    after = _weights(model, optimizer)
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(after, reference, strict=True)),
        "buckets": len(saved[0]["layout"]),
        "compressed": again.state.iter > again.state.start_powerSGD_iter,
        "error_differs": stop == 2 or not torch.equal(saved[0]["error"][0], rank0[0]["error"][0]),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [STOP, 2], ids=["compressing", "as-compression-starts"])
def test_each_ranks_own_powersgd_state_resumes_bit_exactly(stop: int) -> None:
    # Stopped after step 5 (PowerSGD compressing since step 2, its memories kept), or after
    # step 2 (its warm-up over, no memory yet): either way the resumed steps are the same.
    results = run_distributed(_resumed, 2, args=("own", stop), timeout=90)
    for result in results:
        assert result["compressed"], result
        assert result["buckets"] > 2, result
        assert result["equal"], result


@pytest.mark.timeout(120)
def test_rank_0s_powersgd_state_on_every_rank_diverges() -> None:
    # PyTorch's docs save PowerSGD's state on rank 0 and load it on every rank; its
    # error feedback is per rank, so rank 1 goes on with rank 0's errors, and the
    # gradient every rank applies is another than an unbroken run's.
    results = run_distributed(_resumed, 2, args=("rank0",), timeout=90)
    assert results[1]["error_differs"], results
    assert not any(result["equal"] for result in results), results


def _bytes(hook: str | None, options: dict[str, Any], rank: int) -> dict[str, Any]:
    model, optimizer = _wrapped(hook, **options)
    counter = comm_hook_of(model)
    assert counter is not None
    for step in range(3):
        _step(model, optimizer, rank, step)
    warm = counter.counted()
    for step in range(3, 6):
        _step(model, optimizer, rank, step)
    return {
        "kind": str(counter.kind),
        "full": counter.full_bytes,
        "per_step": counter.bytes_per_step(),
        "after_warmup": counter.bytes_per_step(warm),
        "steps": counter.steps,
    }


CASES: list[tuple[str | None, dict[str, Any]]] = [
    (None, {}),
    ("bf16", {}),
    ("fp16", {}),
    ("powersgd", {"powersgd_warmup": 3, "powersgd_rank": 1}),
]


def _every_hook(rank: int, world: int) -> dict[str, Any]:
    """Each hook's counts, and what a PowerSGD hook says of states it cannot load."""
    seen: dict[str, Any] = {str(hook): _bytes(hook, options, rank) for hook, options in CASES}
    model, _ = _wrapped("powersgd", powersgd_warmup=2, powersgd_rank=2)
    hook = comm_hook_of(model)
    assert hook is not None
    logging.getLogger("ddpkit").setLevel(logging.ERROR)
    seen["refused"] = [
        hook.load_state_dict({"kind": "bf16"}),
        hook.load_state_dict({"kind": "powersgd", "options": {"powersgd_rank": 1}}),
        hook.load_state_dict({"kind": "powersgd", "options": hook.state_dict()["options"]}),
    ]
    return seen


@pytest.fixture(scope="module")
def every_hook() -> dict[str, Any]:
    result: dict[str, Any] = run_distributed(_every_hook, 2, timeout=90)[0]
    return result


@pytest.mark.timeout(120)
def test_each_hook_counts_the_bytes_a_step_all_reduces(every_hook: dict[str, Any]) -> None:
    full = sum(p.numel() * 4 for p in _net().parameters())
    seen = every_hook
    assert [seen[str(h)]["kind"] for h, _ in CASES] == ["None", "bf16", "fp16", "powersgd"]
    assert seen["None"]["full"] == seen["None"]["per_step"] == full
    for half in ("bf16", "fp16"):  # Gloo all-reduces both on the CPU
        assert seen[half]["per_step"] == full / 2
        assert seen[half]["steps"] == 6
    sgd = seen["powersgd"]
    assert sgd["steps"] == 6
    # 3 steps of fp32 warm-up, then P and Q of each matrix and the biases in fp32.
    assert 0 < sgd["after_warmup"] < full / 3, sgd
    assert sgd["per_step"] == pytest.approx((3 * full + 3 * sgd["after_warmup"]) / 6)


@pytest.mark.timeout(120)
def test_a_state_of_another_hook_or_options_is_not_loaded(every_hook: dict[str, Any]) -> None:
    bf16, other, malformed = every_hook["refused"]
    assert "comm hook bf16" in str(bf16)
    assert "'powersgd_rank': 1" in str(other)
    assert "its PowerSGD state is malformed (KeyError" in str(malformed)
    assert comm_hook_of(nn.Linear(2, 2)) is None  # a model wrap_ddp did not wrap


def test_unknown_or_misused_hooks_are_refused_on_one_process() -> None:
    with pytest.raises(ValueError, match=r"comm_hook='int8'.*'bf16', 'fp16', 'powersgd'"):
        wrap_ddp(_net(), comm_hook="int8")
    with pytest.raises(ValueError, match=r"powersgd_rank set PowerSGD's options"):
        wrap_ddp(_net(), comm_hook="bf16", powersgd_rank=4)
    with pytest.raises(ValueError, match="powersgd_warmup must be at least 2"):
        wrap_ddp(_net(), comm_hook="powersgd", powersgd_warmup=1)
    with pytest.raises(ValueError, match="powersgd_rank must be at least 1"):
        wrap_ddp(_net(), comm_hook="powersgd", powersgd_rank=0)
    with pytest.raises(ValueError, match="powersgd_error_feedback must be True or False"):
        wrap_ddp(_net(), comm_hook="powersgd", powersgd_error_feedback="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"already torch\.float16"):
        wrap_ddp(_net().half(), comm_hook="fp16")
    plain = _net()
    assert wrap_ddp(plain, comm_hook="powersgd", powersgd_rank=2) is plain  # one process


def test_a_mpi_backend_is_refused() -> None:
    from ddpkit.distributed.compression import check_comm_hook

    with pytest.raises(ValueError, match=r"runs on the NCCL and Gloo backends.*'mpi'"):
        check_comm_hook("bf16", list(_net().parameters()), "mpi", {})
    assert check_comm_hook(None, [], "mpi", {}) == {}


def test_a_group_of_two_backends_is_read_by_the_models_device() -> None:
    from ddpkit.distributed.compression import backend_for

    assert backend_for("gloo", torch.device("cpu")) == "gloo"
    assert backend_for("cpu:gloo,cuda:nccl", torch.device("cuda", 1)) == "nccl"
    assert backend_for("cpu:gloo,cuda:nccl", torch.device("cpu")) == "gloo"
