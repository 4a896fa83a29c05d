"""Streams for fit: ranks whose data end apart, stateful loaders, a kill and a resume.

``stream_run`` trains ``train_jobs``' small net (BatchNorm, dropout) with
``fit`` on a stream of its ``plan["kind"]``; each rank's stream holds its own
number of batches (``plan["batches"][rank]``), so the ranks' epochs end apart.
Each sample is a function of its rank and index, never of a worker's random
state, so an exact resume is possible wherever the stream's place is kept.
"""

from __future__ import annotations

import functools
import os
import select
import threading
import time
from pathlib import Path
from typing import Any

import torch
from fault_jobs import Hooked
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from train_jobs import small_net, worker_start

import ddpkit.data.streams
from ddpkit import (
    CheckpointManager,
    FaultConfig,
    LazyLMDBDataset,
    ReportConfig,
    TrainConfig,
    fit,
    wrap_ddp,
)

BATCH = 4


def sample(salt: int, index: int) -> tuple[torch.Tensor, int]:
    """Sample ``index`` of stream ``salt``: 8 features around its label's centre."""
    g = torch.Generator().manual_seed(salt * 100_003 + index)
    label = int(torch.randint(0, 3, (1,), generator=g))
    return torch.randn(8, generator=g) + 2.0 * label, label


class Stream(IterableDataset[tuple[torch.Tensor, int]]):
    """``n`` samples, no length, no state: split among DataLoader workers by index."""

    def __init__(self, n: int, salt: int) -> None:
        self.n, self.salt, self.epoch, self.next = n, salt, 0, 0
        self.slow_from = n

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.next = epoch, 0  # a new epoch starts at the beginning

    def _mine(self) -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def __iter__(self) -> Any:
        worker, workers = self._mine()
        index = self.next
        while index < self.n:
            if index % workers == worker:
                self.next = index + 1  # before the sample leaves: the place after it
                if index >= self.slow_from:
                    time.sleep(0.15)  # a slow tail: a long read past the others' end
                yield sample(self.salt, index)
            index += 1
        self.next = self.n  # ended: a worker resumed here has nothing left of this epoch


class StatefulStream(Stream):
    """``Stream`` that keeps its place in ``state_dict()``."""

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.next = int(state["epoch"]), int(state["next"])


class SizedStatefulStream(StatefulStream):
    """``StatefulStream`` with a length: each rank's own (WebDataset's ``with_length``)."""

    def __len__(self) -> int:
        return self.n


def _end_with(trainer: int, worker_id: int) -> None:
    """A worker forked by a forkserver (the suite's) ends when its rank does, even killed.

    torch's workers watch their parent, which is then the server, not the rank: a
    killed rank would leave them (and the server, whose pipe they hold) for ever.
    """
    if os.getppid() == trainer:
        return

    def watch() -> None:
        try:  # readable once the process has ended
            select.select([os.pidfd_open(trainer)], [], [])
        except OSError:
            while os.path.exists(f"/proc/{trainer}"):
                time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def make_loader(kind: str, n: int, salt: int, workers: int, plan: dict[str, Any]) -> Any:
    data: Any = StatefulStream(n, salt) if kind.startswith("stateful") else Stream(n, salt)
    if kind == "stateful-sized":
        data, kind = SizedStatefulStream(n, salt), "stateful-dataset"
    data.slow_from = plan["slow_from"][salt] if "slow_from" in plan else n
    start: dict[str, Any] = {}
    if workers:
        start["multiprocessing_context"] = worker_start(data)
        start["worker_init_fn"] = functools.partial(_end_with, os.getpid())
    if kind in ("plain", "stateful-dataset"):
        return DataLoader(data, batch_size=BATCH, num_workers=workers, **start)
    if kind == "stateful-loader":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(data, batch_size=BATCH, num_workers=workers, **start)
    if kind == "sized":  # a list of batches: a length on every rank
        return [_batch([sample(salt, i) for i in range(b, b + BATCH)]) for b in range(0, n, BATCH)]
    if kind == "webdataset":
        return web_loader(plan["shards"], workers)
    raise ValueError(kind)


# -- WebDataset: shards written from a ddpkit LMDB, read on every rank ---------------------


def write_shards(lmdb: str, pattern: str, per_shard: int) -> list[str]:
    """WebDataset shards of ``lmdb``'s records: the stored bytes and the label, in order."""
    import webdataset as wds

    records = LazyLMDBDataset(lmdb, decode="bytes")
    Path(pattern).parent.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for index, (raw, label) in enumerate(records):
            sink.write({"__key__": f"{index:08d}", "img": raw, "cls": label})
    return sorted(str(p) for p in Path(pattern).parent.glob("*.tar"))


def _features(raw: bytes) -> torch.Tensor:
    """An image's 8 column means at 8 x 8: the small net's features."""
    from torchvision.io import decode_image
    from torchvision.transforms.v2.functional import resize

    image = decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return resize(image, [8, 8]).float().mean(dim=(0, 1)) / 255


def _label(raw: bytes) -> int:
    return int(raw)


def web_loader(shards: list[str], workers: int) -> Any:
    """Each rank reads its shards (split_by_node), each worker its part of them."""
    import webdataset as wds

    stream = (
        wds.WebDataset(
            shards, shardshuffle=False, nodesplitter=wds.split_by_node, empty_check=False
        )
        .to_tuple("img", "cls")
        .map_tuple(_features, _label)
    )
    start: dict[str, Any] = {}
    if workers:
        start["multiprocessing_context"] = worker_start(stream)
        start["worker_init_fn"] = functools.partial(_end_with, os.getpid())
    return wds.WebLoader(stream, batch_size=BATCH, num_workers=workers, **start)


def _batch(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def stream_run(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, Any]:
    """fit() on this rank's stream as ``plan`` says; the weights, records and resumed start."""
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = wrap_ddp(small_net())
    optimizer = Hooked(model.parameters(), plan, rank)
    batches = plan.get("batches", [0] * world_size)
    loader = make_loader(plan["kind"], batches[rank] * BATCH, rank, plan.get("workers", 0), plan)
    agreements = [0]
    every_rank_has = ddpkit.data.streams._every_rank_has

    def counted(flag: bool, world: int) -> bool:
        agreements[0] += 1
        return every_rank_has(flag, world)

    ddpkit.data.streams._every_rank_has = counted  # how often the ranks agree, batch by batch
    manager = None
    if "dir" in plan:
        manager = CheckpointManager(Path(plan["dir"]), every_steps=plan.get("every_steps", 2))
    steps: list[int] = []
    history = fit(
        model,
        loader,
        optimizer,
        criterion=torch.nn.CrossEntropyLoss(),
        epochs=plan.get("epochs", 2),
        config=TrainConfig(normalize=None, grad_accum=plan.get("grad_accum", 1)),
        checkpoints=manager,
        resume=plan.get("resume", False),
        report=ReportConfig(progress=False),
        faults=FaultConfig(hang_timeout=plan.get("hang_timeout")),
        step_callbacks=[lambda info: steps.append(info["batch"])],
    )
    weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {
        "weights": weights,
        "records": history.records,
        "steps": steps,
        "start": manager.position if manager is not None else None,
        "agreements": agreements[0],
    }


class Counted(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """``n`` samples, each read recorded: what a rank decoded."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.read += 1
        return torch.zeros(8), index % 3


def sized_apart_run(rank: int, world_size: int) -> dict[str, int]:
    """Rank 1's map-style loader holds 3 batches more than rank 0's: dropped, counted unread."""
    data = Counted(8 if rank == 0 else 20)
    part = ddpkit.epoch_batches(DataLoader(data, batch_size=4), 0)
    taken = sum(1 for _ in part)
    return {"taken": taken, "dropped": part.dropped, "read": data.read}
