"""Checkpoint stall: how long a save blocks training, written in the background or not.

One process, no process group: a model of ``--params`` million float32
parameters (square linear layers) and its SGD-with-momentum state, over 100 MB
together, saved as step checkpoints by ``CheckpointManager.checkpoint("step")`` into a
temporary directory. (a) A synchronous save (``block=True``): the call returns
once the file is written, fsynced and renamed. (b) A background save
(``block=False``): the call returns once the state is copied to host memory
and the write is handed to the writer thread; that call is what training
waits for. ``manager.wait()`` then lets the write finish outside the timed
region, so each save starts with no write in flight (when the file was
written, counted from the call, is shown too). Each round times one save
of each kind, the order alternating from round to round; every round's ratio
is printed with their spread, and the result is their median. (The first
background save, before the rounds, allocates the host copy that the later
ones copy into; its time is shown apart.)
Target: blocked / synchronous save <= 0.25.

The same rounds then run against an object store, moto's S3 server on
127.0.0.1 (``s3://checkpoint-stall/bench``, through s3fs): there the
synchronous save also uploads the file and commits its manifest; the
background save's call still blocks only for the copy to host memory.

    python benchmarks/checkpoint_stall.py [--params 30] [--rounds 5] [--dir PARENT] [--no-store]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit import CheckpointManager, Position, TrainingState

TARGET = 0.25
WIDTH = 2048  # each layer: WIDTH x WIDTH weights and WIDTH biases


def _model(millions: float) -> nn.Module:
    layers = max(1, round(millions * 1e6 / (WIDTH * WIDTH + WIDTH)))
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors(value)


def _megabytes(*states: Any) -> float:
    return sum(t.numel() * t.element_size() for s in states for t in _tensors(s)) / 1e6


def _timed_save(
    manager: CheckpointManager,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    block: bool,
) -> tuple[float, float]:
    """Seconds the call blocked, and seconds until the file was written."""
    assert manager.state is not None
    manager.state.advance(Position(epoch=0, batches=step, samples=step, step=step, world_size=1))
    start = time.perf_counter()
    manager.checkpoint("step", block=block)
    blocked = time.perf_counter() - start
    manager.wait()  # the background write finishes here, outside the timed call
    return blocked, time.perf_counter() - start


def _rounds(
    manager: CheckpointManager, model: nn.Module, optimizer: torch.optim.Optimizer, rounds: int
) -> dict[str, Any]:
    """Each round: one synchronous and one background save, the order alternating."""
    sync: list[float] = []
    blocked: list[float] = []
    background: list[float] = []
    step = 1
    _timed_save(manager, model, optimizer, step, True)  # untimed: it makes the directory
    step += 1
    # The first background save allocates the host copy that the later ones copy into.
    first, _ = _timed_save(manager, model, optimizer, step, False)
    for r in range(rounds):
        for block in (True, False) if r % 2 == 0 else (False, True):
            step += 1
            took, written = _timed_save(manager, model, optimizer, step, block)
            if block:
                sync.append(took)
            else:
                blocked.append(took)
                background.append(written)
    ratios = [b / s for b, s in zip(blocked, sync, strict=True)]
    return {"sync": sync, "blocked": blocked, "background": background, "first": first,
            "ratios": ratios}  # fmt: skip


def _report(title: str, r: dict[str, Any]) -> float:
    print(title)
    print("round   synchronous s   background: blocked s   file written after s   blocked / sync")
    rows = zip(r["sync"], r["blocked"], r["background"], r["ratios"], strict=True)
    for n, (s, b, w, q) in enumerate(rows):
        print(f"{n + 1:5d}   {s:13.3f}   {b:21.3f}   {w:20.3f}   {q:14.3f}")
    median = statistics.median
    print(f"synchronous save (block=True)           {median(r['sync']):7.3f} s (median)")
    print(f"background save: the call blocked       {median(r['blocked']):7.3f} s (median)")
    print(f"background save: the first call         {r['first']:7.3f} s (allocates the host copy)")
    print(f"background save: file written after     {median(r['background']):7.3f} s (median)")
    ratio = median(r["ratios"])
    spread = f"{min(r['ratios']):.3f}-{max(r['ratios']):.3f}"
    print(f"blocked / synchronous save              {ratio:7.3f}   (median; spread {spread})")
    print()
    return ratio


def _store() -> tuple[Any, str] | None:
    """moto's S3 server on 127.0.0.1 and a bucket on it, or None without moto."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )  # fmt: skip
    boto3.client("s3").create_bucket(Bucket="checkpoint-stall")
    return server, "s3://checkpoint-stall/bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=30.0, help="million parameters (30)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (5)")
    parser.add_argument("--dir", default=None, help="parent of the temporary directory")
    parser.add_argument("--no-store", action="store_true", help="leave out the object-store row")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(args.params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():  # one step, so the momentum buffers exist
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    size = _megabytes(model.state_dict(), optimizer.state_dict())
    load = os.getloadavg()[0]
    verdicts = {}
    with tempfile.TemporaryDirectory(prefix="ddpkit-checkpoint-stall-", dir=args.dir) as tmp:
        state = TrainingState(model, optimizer)
        manager = CheckpointManager(tmp, prefix="bench", keep_steps=2, state=state)
        local = _rounds(manager, model, optimizer, args.rounds)
        file_mb = max(p.stat().st_size for p in Path(tmp).glob("step-*.pth")) / 1e6
        where = str(Path(tmp).parent)
        print(
            f"state: {params / 1e6:.1f}M float32 parameters + SGD momentum = {size:.0f} MB "
            f"({file_mb:.0f} MB file); {args.rounds} rounds, one process; load average "
            f"{load:.2f} before the run\n"
        )
        verdicts["local directory"] = _report(
            f"step checkpoints in a directory under {where}", local
        )
        store = None if args.no_store else _store()
        if store is not None:
            server, url = store
            remote = CheckpointManager(
                url, prefix="bench", keep_steps=2, state=state, local_dir=Path(tmp, "side")
            )
            remote.claim()
            title = f"step checkpoints uploaded to {url} (moto's S3 server on 127.0.0.1)"
            verdicts["object store"] = _report(
                title, _rounds(remote, model, optimizer, args.rounds)
            )
            server.stop()
        elif not args.no_store:
            print("object store: moto is not installed (pip install 'moto[server]'); row left out")
    for name, ratio in verdicts.items():
        verdict = "PASS" if ratio <= TARGET else "FAIL"
        print(f"{name + ':':17s} blocked / synchronous save {ratio:.3f} <= {TARGET}: {verdict}")


if __name__ == "__main__":
    main()
