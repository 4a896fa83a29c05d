"""ddpkit.distributed.devices: the one place that picks a device, a backend and a CPU share."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ddpkit.distributed import devices
from ddpkit.testing import run_distributed


def test_pick_device_on_this_machine() -> None:
    assert devices.pick_device("cpu", 3, "auto") == torch.device("cpu")
    assert devices.pick_device(None, 0, "gloo") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert devices.pick_device(None, 0, "auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available here"):
            devices.pick_device("cuda", 0, "auto")


@pytest.mark.parametrize(
    ("backend", "device", "resolved"),
    [("auto", "cpu", "gloo"), ("auto", "cuda:0", "nccl"), ("GLOO", "cpu", "gloo")],
)
def test_resolve_backend(backend: str, device: str, resolved: str) -> None:
    assert devices.resolve_backend(backend, torch.device(device)) == resolved


def test_nccl_needs_cuda() -> None:
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            devices.check_backend("nccl", torch.device("cpu"))
    else:
        with pytest.raises(ValueError, match="backend='nccl' needs CUDA GPUs"):
            devices.check_backend("nccl", torch.device("cpu"))
    devices.check_backend("gloo", torch.device("cpu"))


def test_module_device() -> None:
    assert devices.module_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert devices.module_device(nn.ReLU()) == torch.device("cpu")  # no parameters


def test_cpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    assert devices.usable_cpus() == 12
    assert devices.cpu_share(4) == 3
    assert devices.cpu_share(24) == 1  # never below one
    assert devices.cpu_share(0) == 12  # a count below one counts as one


def _devices_in_a_gloo_group(rank: int, world_size: int) -> tuple[str, str]:
    return str(devices.collective_device()), str(devices.model_device(None, True))


def test_a_gloo_group_computes_on_the_cpu() -> None:
    assert run_distributed(_devices_in_a_gloo_group, 2, timeout=60) == [("cpu", "cpu")] * 2
