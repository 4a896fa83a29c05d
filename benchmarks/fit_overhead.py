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
work falls on both; every round's ratio is printed with their spread. A
round times the steps: from the first batch asked of the loader to the loader
running out, so the figure is the cost per step of a long job; what ``fit``
costs once per call (its set-up, the epoch's checkpoint and the wait for it,
the summary) is printed apart. The result is the median of the per-round
ratios, over 16 rounds by default, each of which runs the loops in the order
A B C C B A (then C B A A B C), 60 steps a call, so that a drift of a shared
machine's speed within a round falls on every loop alike; the medians of the
first and the second half of the rounds are printed too, and must agree
within 0.02 (a run that does not is too noisy to tell 2 % from 5 %: run it
again on a quieter machine). Target: fit / hand-written <= 1.03.

glibc's malloc gives the freed top of its heap back to the system and faults
it in again at the next step, more or less of it from loop to loop and round
to round depending on where small long-lived blocks happen to lie: on a
2-core VM that added 10-25 ms to a ~55 ms step, unevenly between the loops,
and moved the ratio by up to 0.15 from run to run. The ranks therefore run
with fixed thresholds (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), unless they are set already or
``--glibc-malloc-defaults`` is given; the minor page faults per step of each
loop are printed.

    python benchmarks/fit_overhead.py [--steps 60] [--rounds 16] [--batch-size 64]
                                      [--glibc-malloc-defaults] [--flight-recorder-off]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddpkit import CheckpointManager, FaultConfig, ReportConfig, TrainConfig, fit, wrap_ddp
from ddpkit.distributed.recorder import BUFFER_SIZE
from ddpkit.testing import run_distributed

TARGET = 1.03
STEADY = 0.02  # the two halves' medians must agree within this
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


class _TimedLoader(DataLoader[tuple[torch.Tensor, ...]]):
    """A DataLoader that notes when its first batch is asked for and when it runs out."""

    first = last = 0.0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        self.first = time.perf_counter()
        yield from super().__iter__()
        self.last = time.perf_counter()

    @property
    def seconds(self) -> float:
        """From the first batch asked for to the end: the steps, nothing around them."""
        return self.last - self.first


def _loader(steps: int, batch: int, world: int) -> _TimedLoader:
    # The same loader for both loops: only the loop differs.
    g = torch.Generator().manual_seed(0)
    n = steps * batch * world
    data = TensorDataset(
        torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    return _TimedLoader(
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


def _with_fit(model: nn.Module, loader: Any, epoch: int, directory: Path) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    fit(
        model,
        loader,
        opt,
        criterion=nn.CrossEntropyLoss(),
        epochs=1,
        config=TrainConfig(normalize=None),
        checkpoints=CheckpointManager(directory, prefix="bench", every_steps=CHECKPOINT_EVERY),
        report=ReportConfig(progress=False, verbose=False),
        faults=FaultConfig(hang_timeout=HANG_TIMEOUT),
    )


class _Unsized:
    """The same batches as an iterable without a length, as a stream hands them over.

    Over 2 ranks, ``fit`` then agrees batch by batch whether every rank has the next
    one (one small all-reduce each): this loop measures that agreement's cost.
    """

    def __init__(self, loader: _TimedLoader, epoch: int) -> None:
        self.loader, self.epoch = loader, epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        self.loader.sampler.set_epoch(self.epoch)  # type: ignore[attr-defined]
        return iter(self.loader)


def _with_fit_unsized(
    model: nn.Module, loader: DataLoader[tuple[torch.Tensor, ...]], epoch: int, directory: Path
) -> None:
    assert isinstance(loader, _TimedLoader)
    _with_fit(model, _Unsized(loader, epoch), epoch, directory)  # type: ignore[arg-type]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rank(rank: int, world_size: int, steps: int, batch: int, rounds: int) -> tuple[Any, ...]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = wrap_ddp(_model())
    loader = _loader(steps, batch, world_size)
    loops = {"hand": _hand_written, "fit": _with_fit, "unsized": _with_fit_unsized}
    times: dict[str, list[float]] = {k: [] for k in loops}
    calls: dict[str, list[float]] = {k: [] for k in loops}  # a call's time beyond its steps
    faults: dict[str, list[float]] = {k: [] for k in loops}
    files: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-fit-overhead-") as tmp:
        # Untimed warm-up of both loops, through one step checkpoint.
        warm = _loader(min(steps, CHECKPOINT_EVERY + 10), batch, world_size)
        for name, loop in loops.items():
            loop(model, warm, 0, Path(tmp, f"warm-{name}"))
        for r in range(rounds):
            # A B C C B A, then C B A A B C: a drift of the machine's speed within a round
            # falls on every loop alike.
            order = list(loops) if r % 2 == 0 else list(loops)[::-1]
            spent: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in loops}
            for k, name in enumerate(order + order[::-1]):
                directory = Path(tmp, f"round-{r}-{k}")  # a fresh run's checkpoints each call
                torch.distributed.barrier()
                start, faulted = time.perf_counter(), _minor_faults()
                loops[name](model, loader, 2 * r + k, directory)
                torch.distributed.barrier()
                took = time.perf_counter() - start
                spent[name][0] += loader.seconds
                spent[name][1] += took - loader.seconds
                spent[name][2] += _minor_faults() - faulted
                if rank == 0 and name == "fit":
                    files = sorted(p.name for p in directory.iterdir())
            for name, (seconds, extra, faulted_pages) in spent.items():
                times[name].append(seconds / (2 * steps))
                calls[name].append(extra / 2)
                faults[name].append(faulted_pages / (2 * steps))
    return times, calls, faults, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--steps", type=int, default=60, help="optimizer steps per call of a loop (60)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="per process (64)")
    parser.add_argument(
        "--rounds", type=int, default=16, help="timed rounds, each loop twice in each (16)"
    )
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
    times, calls, faults, files = run_distributed(
        _rank, 2, args=shape, timeout=7200, env={"TORCH_FR_BUFFER_SIZE": recorder}
    )[0]
    hand, fitted, unsized = times["hand"], times["fit"], times["unsized"]
    ratios = [f / h for f, h in zip(fitted, hand, strict=True)]
    streams = [u / h for u, h in zip(unsized, hand, strict=True)]
    saves = len(range(CHECKPOINT_EVERY, args.steps, CHECKPOINT_EVERY))  # a call
    run = f"{args.steps} steps x batch {args.batch_size} a call, {args.rounds} rounds of 6 calls"
    print(f"2 Gloo processes on CPU, {run}; load average {load:.2f} before the run")
    print(
        f"fit runs with a step checkpoint every {CHECKPOINT_EVERY} steps ({saves} per call, "
        f"plus the epoch's) in a temporary directory, and the hang watchdog on "
        f"(hang_timeout={HANG_TIMEOUT:g} s)"
    )
    state = "off" if recorder == "0" else f"on ({recorder} collectives)"
    print(f"flight recorder (TORCH_FR_BUFFER_SIZE), both loops: {state}")
    print(f"files in the last fit call's checkpoint directory: {', '.join(files)}")
    print(f"glibc malloc: {malloc or 'its defaults'}")
    print(
        "fit, unsized: the same batches as an iterable without a length (a stream): the "
        "ranks agree batch by batch where the epoch ends"
    )
    print(
        "round   hand ms/step   fit ms/step   fit / hand   unsized / hand   "
        "page faults/step: hand     fit"
    )
    rows = zip(hand, fitted, ratios, streams, faults["hand"], faults["fit"], strict=True)
    for r, (h, f, q, u, hf, ff) in enumerate(rows):
        ms = f"{h * 1000:12.2f}   {f * 1000:11.2f}"
        print(f"{r + 1:5d}   {ms}   {q:10.3f}   {u:14.3f}   {hf:22.0f} {ff:7.0f}")
    print(f"hand-written DDP loop   {statistics.median(hand) * 1000:8.2f} ms/step (median)")
    print(f"ddpkit.fit              {statistics.median(fitted) * 1000:8.2f} ms/step (median)")
    print(f"ddpkit.fit, unsized     {statistics.median(unsized) * 1000:8.2f} ms/step (median)")
    once = statistics.median(f - h for f, h in zip(calls["fit"], calls["hand"], strict=True))
    print(
        f"fit's cost once per call, beyond its steps: {once * 1000:.0f} ms (median; set-up, the "
        "epoch's checkpoint and the wait for it, the summary)"
    )
    ratio = statistics.median(ratios)
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    print(f"fit / hand-written      {ratio:8.3f}   (median of the rounds; spread {spread})")
    half = len(ratios) // 2
    if half:
        first, second = statistics.median(ratios[:half]), statistics.median(ratios[half:])
        steady = abs(first - second) <= STEADY
        print(
            f"halves: rounds 1-{half} {first:.3f}, rounds {half + 1}-{len(ratios)} {second:.3f}: "
            f"{'steady' if steady else 'NOT steady'} (within {STEADY})"
        )
    agreement = statistics.median(u - f for u, f in zip(unsized, fitted, strict=True))
    print(
        f"unsized / hand-written  {statistics.median(streams):8.3f}   (median; spread "
        f"{min(streams):.3f}-{max(streams):.3f}): the agreement batch by batch costs "
        f"{agreement * 1000:.2f} ms/step over the sized loader (median of the rounds)"
    )
    print(f"target fit / hand <= {TARGET}: {'PASS' if ratio <= TARGET else 'FAIL'}")


if __name__ == "__main__":
    main()
