"""fit() overhead: ddpkit's training loop, with its safety nets on, against a hand-written DDP loop.

Two Gloo processes on the CPU train the same model on the same data for the
same number of steps, once through ``ddpkit.fit`` and once through the
shortest correct DDP loop (set_epoch, forward, backward, step). ``fit`` runs
as a long job would: a step checkpoint every 50 steps (``CheckpointManager``
in a temporary directory, written in the background), the hang watchdog
on (``FaultConfig(hang_timeout=...)``, with its report signal) and, as
``init_distributed`` sets it, PyTorch's flight recorder of collectives
(``TORCH_FR_BUFFER_SIZE``; ``--flight-recorder-off`` to compare, which turns
it off for both loops: the recorder is per process). Each round times both loops in the
same processes, the order alternating from round to round, so load from other
work falls on both; every round's ratio is printed with their spread. The
result is the median of the per-round ratios. Target: fit / hand-written <= 1.03.

glibc's malloc gives the freed top of its heap back to the system and faults
it in again at the next step, more or less of it from loop to loop and round
to round depending on where small long-lived blocks happen to lie: on a
2-core VM that added 10-25 ms to a ~55 ms step, unevenly between the loops,
and moved the ratio by up to 0.15 from run to run. The ranks therefore run
with fixed thresholds (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), unless they are set already or
``--glibc-malloc-defaults`` is given; the minor page faults per step of each
loop are printed.

    python benchmarks/fit_overhead.py [--steps 200] [--rounds 5] [--batch-size 64]
                                      [--glibc-malloc-defaults] [--flight-recorder-off]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddpkit import CheckpointManager, FaultConfig, ReportConfig, TrainConfig, fit, wrap_ddp
from ddpkit.distributed.recorder import BUFFER_SIZE
from ddpkit.testing import run_distributed

TARGET = 1.03
CHECKPOINT_EVERY = 50  # optimizer steps between step checkpoints
HANG_TIMEOUT = 300.0  # seconds; far above a step, a snapshot or a save
# Read by glibc when a process starts: the spawned ranks get them from here.
# 32 MiB is the highest mmap threshold glibc accepts on 64-bit systems.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


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


def _loader(steps: int, batch: int, world: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    # The same loader for both loops: only the loop differs.
    g = torch.Generator().manual_seed(0)
    n = steps * batch * world
    data = TensorDataset(
        torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    return DataLoader(
        data, batch_size=batch, sampler=DistributedSampler(data, seed=0), drop_last=True
    )


def _hand_written(
    model: nn.Module, loader: DataLoader[tuple[torch.Tensor, ...]], epoch: int, _: Path
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


def _with_fit(
    model: nn.Module, loader: DataLoader[tuple[torch.Tensor, ...]], epoch: int, directory: Path
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    fit(
        model,
        loader,
        opt,
        criterion=nn.CrossEntropyLoss(),
        epochs=1,
        config=TrainConfig(normalize=None),
        checkpoints=CheckpointManager(directory, prefix="bench", every_steps=CHECKPOINT_EVERY),
        report=ReportConfig(progress=False),
        faults=FaultConfig(hang_timeout=HANG_TIMEOUT),
    )


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rank(
    rank: int, world_size: int, steps: int, batch: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[str]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = wrap_ddp(_model())
    loader = _loader(steps, batch, world_size)
    loops = {"hand": _hand_written, "fit": _with_fit}
    times: dict[str, list[float]] = {k: [] for k in loops}
    faults: dict[str, list[float]] = {k: [] for k in loops}
    files: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-fit-overhead-") as tmp:
        # Untimed warm-up of both loops, through one step checkpoint.
        warm = _loader(min(steps, CHECKPOINT_EVERY + 10), batch, world_size)
        for name, loop in loops.items():
            loop(model, warm, 0, Path(tmp, f"warm-{name}"))
        for r in range(rounds):
            directory = Path(tmp, f"round-{r}")  # a fresh run's checkpoints each round
            for name in list(loops) if r % 2 == 0 else list(loops)[::-1]:
                torch.distributed.barrier()
                start, faulted = time.perf_counter(), _minor_faults()
                loops[name](model, loader, r + 1, directory)
                torch.distributed.barrier()
                times[name].append((time.perf_counter() - start) / steps)
                faults[name].append((_minor_faults() - faulted) / steps)
            if rank == 0:
                files = sorted(p.name for p in directory.iterdir())
    return times, faults, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per round (200)")
    parser.add_argument("--batch-size", type=int, default=64, help="per process (64)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each loop (5)")
    parser.add_argument(
        "--glibc-malloc-defaults",
        action="store_true",
        help="keep glibc's own malloc thresholds in the ranks instead of fixed ones",
    )
    parser.add_argument(
        "--flight-recorder-off",
        action="store_true",
        help="TORCH_FR_BUFFER_SIZE=0 in the ranks, for both loops (default: on, as "
        "init_distributed sets it)",
    )
    args = parser.parse_args()
    recorder = "0" if args.flight_recorder_off else str(BUFFER_SIZE)
    if not args.glibc_malloc_defaults:
        for name, value in FIXED_MALLOC.items():
            os.environ.setdefault(name, value)
    malloc = " ".join(f"{k}={os.environ[k]}" for k in FIXED_MALLOC if k in os.environ)
    load = os.getloadavg()[0]
    shape = (args.steps, args.batch_size, args.rounds)
    times, faults, files = run_distributed(
        _rank, 2, args=shape, timeout=7200, env={"TORCH_FR_BUFFER_SIZE": recorder}
    )[0]
    hand, fitted = times["hand"], times["fit"]
    ratios = [f / h for f, h in zip(fitted, hand, strict=True)]
    saves = len(range(CHECKPOINT_EVERY, args.steps, CHECKPOINT_EVERY))
    run = f"{args.steps} steps x batch {args.batch_size}, {args.rounds} rounds"
    print(f"2 Gloo processes on CPU, {run}; load average {load:.2f} before the run")
    print(
        f"fit runs with a step checkpoint every {CHECKPOINT_EVERY} steps ({saves} per round, "
        f"plus the epoch's) in a temporary directory, and the hang watchdog on "
        f"(hang_timeout={HANG_TIMEOUT:g} s)"
    )
    state = "off" if recorder == "0" else f"on ({recorder} collectives)"
    print(f"flight recorder (TORCH_FR_BUFFER_SIZE), both loops: {state}")
    print(f"files in the last round's checkpoint directory: {', '.join(files)}")
    print(f"glibc malloc: {malloc or 'its defaults'}")
    print("round   hand ms/step   fit ms/step   fit / hand   page faults/step: hand     fit")
    rows = zip(hand, fitted, ratios, faults["hand"], faults["fit"], strict=True)
    for r, (h, f, q, hf, ff) in enumerate(rows):
        ms = f"{h * 1000:12.2f}   {f * 1000:11.2f}"
        print(f"{r + 1:5d}   {ms}   {q:10.3f}   {hf:22.0f} {ff:7.0f}")
    print(f"hand-written DDP loop   {statistics.median(hand) * 1000:8.2f} ms/step (median)")
    print(f"ddpkit.fit              {statistics.median(fitted) * 1000:8.2f} ms/step (median)")
    ratio = statistics.median(ratios)
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    print(f"fit / hand-written      {ratio:8.3f}   (median of the rounds; spread {spread})")
    print(f"target fit / hand <= {TARGET}: {'PASS' if ratio <= TARGET else 'FAIL'}")


if __name__ == "__main__":
    main()
