"""Small datasets and a DistInfo for the loader and sampler tests."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit import DistInfo


def info(rank: int = 1, world_size: int = 4, local_world_size: int = 4) -> DistInfo:
    return DistInfo(
        rank=rank,
        local_rank=rank % local_world_size,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=0,
        device=torch.device("cpu"),
        backend="gloo",
        is_distributed=True,
    )


class Indices(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class Noisy(Dataset[tuple[int, int, float, float]]):
    """Each item draws from torch, Python and numpy RNGs, as augmentations do."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[int, int, float, float]:
        return index, int(torch.randint(0, 2**30, ())), random.random(), float(np.random.rand())


class Pids(Dataset[int]):
    """Each item is the process id of the worker that loaded it."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        return os.getpid()


def import_group_module() -> None:
    """In a process a forkserver forked: exit 0 if importing the group module leaves its group.

    4: the module was already imported (the check would prove nothing); 3: it moved.
    """
    import sys

    if "ddpkit.data._forkserver_group" in sys.modules:
        sys.exit(4)
    before = os.getpgid(0)
    import ddpkit.data._forkserver_group  # noqa: F401

    sys.exit(0 if os.getpgid(0) == before else 3)


class FailsAt(Indices):
    """Indices whose item ``bad`` raises ValueError, in whichever worker loads it."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            raise ValueError(f"item {index} is bad")
        return index


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended); reads /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def left_running(pids: list[int], seconds: float) -> list[int]:
    """The processes of ``pids`` still running after ``seconds``; they are killed."""
    deadline = time.monotonic() + seconds
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if running(p)]
    for p in left:
        os.kill(p, 9)
    return left
