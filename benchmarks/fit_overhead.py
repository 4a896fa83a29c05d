"""fit() overhead: ddpkit's training loop against a hand-written minimal DDP loop.

Two Gloo processes on the CPU train the same model on the same data for the
same number of steps, once through ``ddpkit.fit`` and once through the
shortest correct DDP loop (set_epoch, forward, backward, step). The two
alternate round by round in the same processes, so load from other work falls
on both; the result is the ratio of the median time per step. Target: <= 1.03.

    python benchmarks/fit_overhead.py [--steps 60] [--rounds 5] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddpkit import ReportConfig, TrainConfig, fit, wrap_ddp
from ddpkit.testing import run_distributed


def _model() -> nn.Module:
    # Big enough that a step takes milliseconds, as a real step does.
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(512, 10),
    )


def _data(steps: int, batch: int, world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * batch * world
    return TensorDataset(
        torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )


def _loader(data: TensorDataset, batch: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    # The same loader for both loops: only the loop differs.
    return DataLoader(
        data, batch_size=batch, sampler=DistributedSampler(data, seed=0), drop_last=True
    )


def _hand_written(
    model: nn.Module, loader: DataLoader[tuple[torch.Tensor, ...]], epoch: int
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    model.train()
    for images, targets in loader:
        loss = criterion(model(images), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _with_fit(model: nn.Module, loader: DataLoader[tuple[torch.Tensor, ...]], epoch: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    fit(
        model,
        loader,
        opt,
        criterion=nn.CrossEntropyLoss(),
        epochs=1,
        config=TrainConfig(normalize=None),
        report=ReportConfig(progress=False),
    )


def _rank(
    rank: int, world_size: int, steps: int, batch: int, rounds: int
) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = wrap_ddp(_model())
    loader = _loader(_data(steps, batch, world_size), batch)
    loops = {"hand": _hand_written, "fit": _with_fit}
    times: dict[str, list[float]] = {k: [] for k in loops}
    for loop in loops.values():  # warm-up
        loop(model, loader, 0)
    for r in range(rounds):
        for name in list(loops) if r % 2 == 0 else list(loops)[::-1]:
            torch.distributed.barrier()
            start = time.perf_counter()
            loops[name](model, loader, r + 1)
            torch.distributed.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per round (60)")
    parser.add_argument("--batch-size", type=int, default=64, help="per process (64)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per loop (5)")
    args = parser.parse_args()
    out = run_distributed(_rank, 2, args=(args.steps, args.batch_size, args.rounds), timeout=1800)[
        0
    ]
    hand, fitted = statistics.median(out["hand"]), statistics.median(out["fit"])
    ratios = [f / h for f, h in zip(out["fit"], out["hand"], strict=True)]
    shape = f"{args.steps} steps x batch {args.batch_size}, {args.rounds} rounds"
    print(f"2 Gloo processes on CPU, {shape}")
    print(f"hand-written DDP loop   {hand * 1000:8.2f} ms/step")
    print(f"ddpkit.fit              {fitted * 1000:8.2f} ms/step")
    ratio = statistics.median(ratios)
    per_round = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"fit / hand-written      {ratio:8.3f}   (per-round: {per_round})")
    print(f"target fit / hand <= 1.03: {'PASS' if ratio <= 1.03 else 'FAIL'}")


if __name__ == "__main__":
    main()
