"""Jobs of the GPU battery (tests/gpu/test_gpu.py, ``make gpu-check``): NCCL, SyncBN, fit on CUDA.

Each runs in processes of its own (``ddpkit.spawn`` with NCCL, or one process
started by the test) and writes what it measured to a JSON or ``.pt`` file
the test reads: a CUDA context and a process group never live in pytest's
own process.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fault_jobs import Hooked
from torch import nn
from torch.utils.data import Dataset

import ddpkit

BATCH = 8  # per process


def nccl_info(info: ddpkit.DistInfo, out: str) -> None:
    """What init_distributed set up: the backend, this rank's device, one all-reduce on it."""
    value = torch.full((1,), float(info.rank + 1), device=info.device)
    dist.all_reduce(value)
    record = {
        "rank": info.rank,
        "world_size": info.world_size,
        "backend": dist.get_backend(),
        "device": str(info.device),
        "current_device": torch.cuda.current_device(),
        "local_rank": info.local_rank,
        "sum": float(value.item()),
    }
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(record))


def _bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def sync_bn(info: ddpkit.DistInfo, out: str) -> None:
    """wrap_ddp(sync_bn=True): one step on this rank's half of one batch; what it gives."""
    torch.manual_seed(0)
    net = _bn_net()
    plain = _bn_net()
    plain.load_state_dict(net.state_dict())
    model = ddpkit.wrap_ddp(net.to(info.device), sync_bn=True)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH * info.world_size, 3, 8, 8, generator=g)
    targets = torch.randint(0, 3, (BATCH * info.world_size,), generator=g)
    mine = slice(info.rank * BATCH, (info.rank + 1) * BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = nn.functional.cross_entropy(
        model(images[mine].to(info.device)), targets[mine].to(info.device)
    )
    loss.backward()
    optimizer.step()
    inner = ddpkit.unwrap_model(model)
    # One process over the whole batch, with a plain BatchNorm: the statistics SyncBN must equal.
    plain.train()(images)
    torch.save(
        {
            "sync_bn": sum(isinstance(m, nn.SyncBatchNorm) for m in inner.modules()),
            "plain_bn": sum(type(m) is nn.BatchNorm2d for m in inner.modules()),
            "weights": {k: v.cpu() for k, v in inner.state_dict().items()},
            "running_mean": inner[1].running_mean.cpu(),
            "running_var": inner[1].running_var.cpu(),
            "expected_mean": plain[1].running_mean,
            "expected_var": plain[1].running_var,
        },
        Path(out, f"rank{info.rank}.pt"),
    )


class Blobs(Dataset[tuple[torch.Tensor, int]]):
    """64 uint8 images of 3 classes: a colour per class, noise seeded per index."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = index % 3
        g = torch.Generator().manual_seed(index)
        image = torch.randint(0, 100, (3, 20, 20), generator=g, dtype=torch.uint8)
        image[label] += 120
        return image, label


def fit_on_gpu(info: ddpkit.DistInfo, plan: dict[str, Any]) -> None:
    """fit() on CUDA as ``plan`` says (amp, channels_last, compile, a kill); the final weights."""
    torch.use_deterministic_algorithms(True, warn_only=True)  # a warning names any other
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.AvgPool2d(10),  # deterministic backward on CUDA (adaptive pooling's is not)
        nn.Flatten(),
        nn.Linear(64, 3),
    ).to(info.device)
    if plan.get("channels_last"):
        net = net.to(memory_format=torch.channels_last)
    model: nn.Module = ddpkit.wrap_ddp(net)
    if plan.get("compile"):
        model = torch.compile(model)  # type: ignore[assignment]
    train = ddpkit.build_loader(
        Blobs(), batch_size=BATCH, train=True, info=info, workers=plan.get("workers", 0)
    )
    optimizer = Hooked(model.parameters(), plan, info.rank)
    ddpkit.fit(
        model,
        train,
        optimizer,
        criterion=nn.CrossEntropyLoss(),
        epochs=2,
        config=ddpkit.TrainConfig(
            amp=plan.get("amp"), channels_last=bool(plan.get("channels_last"))
        ),
        checkpoints=ddpkit.CheckpointManager(plan["dir"], every_steps=2),
        resume=plan.get("resume", False),
        report=ddpkit.ReportConfig(progress=False),
    )
    weights = {k: v.cpu() for k, v in ddpkit.unwrap_model(model).state_dict().items()}
    torch.save(weights, Path(plan["dir"], f"weights{info.rank}.pt"))


def loader_on_gpu(info: ddpkit.DistInfo, out: str) -> None:
    """build_loader on a CUDA rank: pinned batches, copied without blocking."""
    loader = ddpkit.build_loader(Blobs(), batch_size=BATCH, train=False, info=info, workers=2)
    images, targets = next(iter(loader))
    on_gpu = images.to(info.device, non_blocking=True)
    torch.cuda.synchronize()
    record = {
        "pin_memory": loader.pin_memory,
        "pinned": images.is_pinned(),
        "equal": torch.equal(on_gpu.cpu(), images),
        "targets": targets.tolist(),
    }
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(record))


def env_for_determinism() -> dict[str, str]:
    """What cuBLAS needs for deterministic algorithms, for the processes a test starts."""
    return {"CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")}


def comm_hooks(info: ddpkit.DistInfo, out: str) -> None:
    """Each comm hook over NCCL: 6 steps, the bytes counted; PowerSGD stopped and resumed."""
    from ddpkit.distributed.compression import comm_hook_of

    def wrapped(hook: str | None) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 36, 10))
        extra: dict[str, Any] = {"powersgd_warmup": 2} if hook == "powersgd" else {}
        model = ddpkit.wrap_ddp(net, comm_hook=hook, bucket_cap_mb=0.01, **extra)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
        g = torch.Generator().manual_seed(100 * i + info.rank)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        nn.functional.cross_entropy(model(x.to(info.device)), y.to(info.device)).backward()
        optimizer.step()
        optimizer.zero_grad()

    record: dict[str, Any] = {}
    for hook in (None, "bf16", "fp16", "powersgd"):
        model, optimizer = wrapped(hook)
        for i in range(6):
            step(model, optimizer, i)
        counter = comm_hook_of(model)
        assert counter is not None
        record[str(hook)] = {"full": counter.full_bytes, "per_step": counter.bytes_per_step()}
    model, optimizer = wrapped("powersgd")
    for i in range(4):
        step(model, optimizer, i)
    # Copies, as a checkpoint file holds: state dicts hold the live tensors.
    hook = comm_hook_of(model)
    assert hook is not None
    saved = copy.deepcopy([hook.state_dict(), model.state_dict(), optimizer.state_dict()])
    for i in range(4, 8):
        step(model, optimizer, i)
    reference = [p.detach().clone() for p in model.parameters()]
    model, optimizer = wrapped("powersgd")
    model.load_state_dict(saved[1])
    optimizer.load_state_dict(saved[2])
    record["loaded"] = comm_hook_of(model).load_state_dict(saved[0])  # type: ignore[union-attr]
    for i in range(4, 8):
        step(model, optimizer, i)
    after = [p.detach() for p in model.parameters()]
    record["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(after, reference, strict=True))
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(record))
