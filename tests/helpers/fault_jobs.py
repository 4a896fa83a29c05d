"""Training jobs that the fault-tolerance tests crash, stop, stall and resume in other processes.

One job, ``faulty_run``, trains ``train_jobs``' small net on noisy blobs
with ``fit`` (BatchNorm, dropout, random augmentation in 2 workers per rank)
and injects what its ``plan`` asks for: a SIGKILL at an optimizer step or in
the middle of a checkpoint write, a signal, a failed write, a data stall.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from train_jobs import NoisyBlobs, small_net, worker_start

import ddpkit.checkpoint.files
from ddpkit import (
    CheckpointManager,
    DistInfo,
    FaultConfig,
    FocalLoss,
    Preempted,
    ReportConfig,
    TrainConfig,
    build_loader,
    fit,
    mixup_cutmix,
    model_ema,
    train_transform,
    warmup_schedule,
    wrap_ddp,
)
from ddpkit.checkpoint.store import ObjectStore, is_url

BATCH = 4  # per rank: 48 samples on 2 ranks make 6 steps an epoch


class Logged(Dataset[tuple[torch.Tensor, int]]):
    """NoisyBlobs that appends each index it reads to a file, and can stall for ever."""

    def __init__(self, record: str | None, stall_after: int | None) -> None:
        self.inner, self.record, self.stall_after, self.reads = NoisyBlobs(), record, stall_after, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        if self.stall_after is not None and self.reads > self.stall_after:
            threading.Event().wait()  # the data source hangs for ever
        if self.record is not None:
            with open(self.record, "a", encoding="utf-8") as f:
                f.write(f"{index}\n")
        return self.inner[index]


class TailImages(Dataset[tuple[torch.Tensor, int]]):
    """48 tiny uint8 images in 3 classes of 36, 9 and 3, through RandAugment and Random Erasing.

    Each image's 8 column means are the small net's features, so the preset's
    draws reach the weights.
    """

    def __init__(self) -> None:
        self.targets = [0] * 36 + [1] * 9 + [2] * 3
        self.transform = train_transform(
            8, scale=(0.5, 1.0), hflip=False, auto_augment="rand", random_erase=0.25
        )

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = self.targets[index]
        g = torch.Generator().manual_seed(index)
        image = torch.rand(3, 12, 12, generator=g) * 120 + 60 * label
        out = self.transform(image.to(torch.uint8))
        return out.float().mean(dim=(0, 1)) / 255, label


def _wait_for_saved(plan: dict[str, Any]) -> None:
    """Wait until step ``plan["saved_before_kill"]``'s checkpoint is on disk, if given.

    It is written in the background and may lag a step or two on a busy machine:
    the kill then falls between two checkpoints, not in one's write (a test of its own).
    """
    step = plan.get("saved_before_kill")
    if step is None:
        return
    name = f"step-{step:09d}.pth"
    deadline = time.monotonic() + 120
    if is_url(plan["dir"]):  # on a store: once a manifest commits it
        store = ObjectStore(plan["dir"])
        while time.monotonic() < deadline:
            if name in ((store.newest() or {}).get("files") or {}):
                return
            time.sleep(0.05)
        return
    path = Path(plan["dir"], name)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class Hooked(torch.optim.SGD):
    """SGD that can kill or signal its own process at a given optimizer step."""

    def __init__(self, params: Any, plan: dict[str, Any], rank: int) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)
        self.plan, self.rank, self.count = plan, rank, 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        self.count += 1
        kill = self.plan.get("kill_at")
        if kill is not None and kill[0] == self.rank and kill[1] == self.count:
            _wait_for_saved(self.plan)
            os.kill(os.getpid(), signal.SIGKILL)
        sig = self.plan.get("signal_at")
        if sig is not None and sig[0] == self.rank and sig[1] == self.count:
            os.kill(os.getpid(), getattr(signal, sig[2]))
        return out


class FeatureMix:
    """Mixup / CutMix for the blobs' 8 features, seen as 2 x 2 x 2 images."""

    def __init__(self, classes: int) -> None:
        self.mix = mixup_cutmix(classes)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images, soft = self.mix(x.view(-1, 2, 2, 2), y)
        return images.reshape(-1, 8), soft


def _break_writes(plan: dict[str, Any], rank: int) -> None:
    """Make this rank's n-th checkpoint write die (SIGKILL) or fail (a full disk)."""
    how = plan.get("kill_in_write") or plan.get("fail_write")
    if how is None or how[0] != rank:
        return
    write, calls = ddpkit.checkpoint.files.write_file, [0]

    def broken(obj: Any, tmp: Path) -> None:
        calls[0] += 1
        if calls[0] == how[1]:
            if "kill_in_write" in plan:
                write(obj, tmp)  # the whole temporary file, never renamed into place
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(28, "No space left on device")
        write(obj, tmp)

    ddpkit.checkpoint.files.write_file = broken  # type: ignore[assignment]


def faulty_run(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, Any]:
    """fit() with the faults of ``plan``; returns the final weights and what happened."""
    # A hang prints every thread's stack well before the test's own timeout kills the job.
    faulthandler.dump_traceback_later(plan.get("dump_after", 150), exit=True)
    if plan.get("log"):
        handler = logging.FileHandler(f"{plan['log']}.{rank}")
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
        logging.getLogger("ddpkit").addHandler(handler)
        logging.getLogger("ddpkit").setLevel(logging.INFO)
    _break_writes(plan, rank)
    torch.manual_seed(1234)  # the same initial weights on every rank
    info = DistInfo(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo", True)
    model = wrap_ddp(small_net())
    optimizer = Hooked(model.parameters(), plan, rank)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    torch.manual_seed(99 + rank)  # dropout masks differ per rank, as in a real job
    record = f"{plan['record']}.{world_size}.{rank}" if plan.get("record") else None
    stall = plan.get("stall_at")
    data: Dataset[Any] = Logged(record, stall[1] * BATCH if stall and stall[0] == rank else None)
    # balanced: class-balanced draws of half the set, each twice (repeated augmentation).
    draws = {"balance": 1.0, "num_samples": 24, "repeats": 2} if plan.get("balanced") else {}
    if draws:
        data = TailImages()
    workers = plan.get("workers", 2)
    start = worker_start(data) if workers else None
    loader = build_loader(data, batch_size=BATCH, train=True, workers=workers, seed=5, info=info,
                          multiprocessing_context=start, **draws)  # type: ignore[arg-type]  # fmt: skip
    directory = plan["dirs"][rank] if "dirs" in plan else plan["dir"]
    local = {"local_dir": plan["local_dirs"][rank]} if is_url(directory) else {}
    manager = CheckpointManager(directory, prefix="tiny", every_steps=plan.get("every_steps"),
                                on_each_node=plan.get("on_each_node", False), **local)  # fmt: skip
    outcome: dict[str, Any] = {}
    criterion: Any = nn.CrossEntropyLoss()
    config, ema = TrainConfig(normalize=None), None
    if plan.get("modern"):  # warm-up + cosine per step, EMA, Mixup/CutMix, soft FocalLoss, clipping
        scheduler = warmup_schedule(optimizer, epochs=3, steps_per_epoch=len(loader),
                                    warmup_epochs=1.5)  # fmt: skip
        ema = model_ema(model, decay=0.8)
        criterion = FocalLoss(gamma=2.0, smooth=0.1)
        config = TrainConfig(normalize=None, clip_grad_norm=1.0, batch_transform=FeatureMix(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            history = fit(
                model, loader, optimizer, criterion=criterion,
                epochs=plan.get("epochs", 3), scheduler=scheduler, checkpoints=manager,
                resume=plan.get("resume", False), config=config, ema=ema,
                report=ReportConfig(progress=False),
                faults=FaultConfig(hang_timeout=plan.get("hang_timeout")),
            )  # fmt: skip
            outcome["records"] = history.records
        except Preempted as e:
            outcome["preempted"] = (e.signal_name, e.step, e.checkpoint, e.code)
        except Exception as e:  # reported to the test, which asserts on it
            outcome["error"] = (type(e).__name__, str(e))
    outcome["warnings"] = [str(w.message) for w in caught]
    outcome["steps"] = optimizer.count
    outcome["position"] = manager.position
    outcome["weights"] = {k: v.clone() for k, v in model.module.state_dict().items()}
    if ema is not None:
        outcome["ema"] = {k: v.clone() for k, v in ema.state_dict().items()}
    return outcome


def resumed_then_fresh(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, Any]:
    """``faulty_run`` resuming ``plan``, then afresh in ``plan["fresh"]``: one start-up for both.

    Returns the resumed run's outcome, the fresh run's weights as ``reference``.
    """
    outcome = faulty_run(rank, world_size, {**plan, "resume": True})
    fresh = faulty_run(rank, world_size, {**plan, "dir": plan["fresh"], "resume": False})
    return {**outcome, "reference": fresh["weights"], "fresh_steps": fresh["steps"]}


def killed_and_resumed(
    run: Callable[[dict[str, Any]], list[dict[str, Any]]],
    plan: dict[str, Any],
    directory: Path,
    kill_at: tuple[int, int] = (1, 9),
) -> list[dict[str, Any]]:
    """``run(plan)`` with rank ``kill_at[0]`` SIGKILLed after step ``kill_at[1]``, then resumed.

    The kill waits for the checkpoint of the step before it to be on disk.
    """
    import pytest

    from ddpkit import RankFailedError

    step = kill_at[1]
    killing = {**plan, "dir": str(directory), "kill_at": kill_at, "saved_before_kill": step - 1}
    with pytest.raises(RankFailedError, match="exited with code -9"):
        run(killing)
    return run({**plan, "dir": str(directory), "resume": True})


def assert_same_weights(results: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    """Each rank's ``weights`` (and ``rng``, when given) ``torch.equal`` to the reference's."""
    for rank, (result, expected) in enumerate(zip(results, reference, strict=True)):
        for key, value in expected["weights"].items():
            assert torch.equal(result["weights"][key], value), f"rank {rank}: {key}"
        if "rng" in expected:
            assert torch.equal(result["rng"], expected["rng"]), f"rank {rank}: the RNG"
