"""Which device, backend and share of the CPUs a process uses: decided here, once.

``init_distributed`` picks the device and backend of a rank; ``wrap_ddp``,
``fit``, the collectives and the loaders ask this module instead of deciding
again, so every part of a job agrees on where it computes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "as_device",
    "check_backend",
    "collective_device",
    "cpu_share",
    "model_device",
    "module_device",
    "pick_device",
    "resolve_backend",
    "usable_cpus",
]


def pick_device(device: str | torch.device | None, local_rank: int, backend: str) -> torch.device:
    """The device of the rank with ``local_rank``: as asked, else its GPU, else the CPU.

    Raises:
        ValueError: CUDA asked for but absent, or more ranks on a node than GPUs.
    """
    if device is not None:
        dev = as_device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
    elif torch.cuda.is_available() and backend != "gloo":
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"device {dev} was asked for, but CUDA is not available here")
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"local rank {local_rank} wants {dev}, but only {count} GPU(s) are visible: "
                "start at most one process per GPU on each node (torchrun --nproc-per-node, "
                "srun --ntasks-per-node) or check CUDA_VISIBLE_DEVICES"
            )
    return dev


def as_device(device: str | torch.device) -> torch.device:
    """``torch.device(device)``, with a ``ValueError`` naming a string torch does not know."""
    if isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device={device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'"
        ) from exc


def resolve_backend(backend: str, dev: torch.device) -> str:
    """``"auto"`` becomes NCCL on a CUDA device and Gloo elsewhere; names are lower-cased.

    Raises:
        ValueError: not a backend name, or one this PyTorch build lacks.
    """
    if not isinstance(backend, str):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    if backend == "auto":
        return "nccl" if dev.type == "cuda" else "gloo"
    name = backend.lower()
    known = ("gloo", "nccl", "mpi", "ucc", "xccl")
    if name not in known:
        raise ValueError(f"backend={backend!r} is not a backend: use 'auto', 'nccl' or 'gloo'")
    available = getattr(dist, "is_backend_available", None)
    if name != "nccl" and available is not None and not available(name):
        raise ValueError(f"backend={backend!r} is not available in this PyTorch build; use 'gloo'")
    return name


def check_backend(backend: str, dev: torch.device) -> None:
    """Refuse a backend that cannot run on ``dev`` (NCCL without CUDA), with the fix."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend='nccl' needs CUDA GPUs, and torch.cuda.is_available() is False here: "
            "use backend='gloo' (or 'auto') to run on the CPU"
        )
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"backend='nccl' needs a CUDA device, got device={dev}; use 'gloo'")
    if not dist.is_available():
        raise ValueError("this PyTorch build has no torch.distributed support")


def collective_device() -> torch.device:
    """Where the default process group's collectives need their tensors.

    NCCL works on this rank's current CUDA device (``init_distributed`` set
    it); Gloo on the CPU.
    """
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device(device: str | torch.device | None, distributed: bool) -> torch.device:
    """Where ``wrap_ddp`` puts a model: ``device`` if given, else the current GPU, except in Gloo.

    ``"cuda"`` without an index means the current CUDA device (``init_distributed``
    set it to this rank's). A Gloo group on a GPU machine is taken for a CPU job
    (tests, CPU training); pass a device explicitly to train on the GPU over Gloo.
    """
    if device is not None:
        dev = as_device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if distributed and dist.get_backend() != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def module_device(model: nn.Module) -> torch.device:
    """The device of a model's first parameter (the CPU for a model without any)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def usable_cpus() -> int:
    """The CPUs this process may run on: a cgroup or taskset can give fewer than the machine has."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_share(local_world_size: int) -> int:
    """This process's share of the usable CPUs when ``local_world_size`` processes share a node."""
    return max(1, usable_cpus() // max(local_world_size, 1))
