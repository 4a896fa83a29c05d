"""Models, data and jobs that the training tests run in other processes."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info
from warm import share_server  # type: ignore[import-not-found]

from ddpkit import (
    CheckpointManager,
    DistInfo,
    FaultConfig,
    ReportConfig,
    TrainConfig,
    build_loader,
    evaluate,
    fit,
    load_checkpoint,
    model_ema,
    wrap_ddp,
)
from ddpkit.training.reporting import epoch_line


class NoisyBlobs(Dataset[tuple[torch.Tensor, int]]):
    """Learnable 3-class data with random augmentation drawn in the worker's RNGs."""

    def __init__(self, n: int = 48, seed: int = 0, augment: bool = True) -> None:
        self.augment = augment
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (n,), generator=g)
        self.base = (
            torch.randn(n, 8, generator=g) + 2.0 * nn.functional.one_hot(self.labels, 8).float()
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not self.augment:
            return self.base[index], int(self.labels[index])
        x = self.base[index] + 0.3 * torch.randn(8)  # the "augmentation"
        if torch.rand(()) < 0.5:
            x = x.flip(0)
        return x, int(self.labels[index])


def worker_start(dataset: Dataset[object]) -> str:
    """How the training jobs start their DataLoader workers: from a forkserver.

    ``fork`` copies a rank whose Gloo threads may be entering or leaving Python
    at that very moment, which CPython 3.11 can answer with a child stuck inside
    ``fork()`` for ever (a rare hang at the first batch). A forkserver forks
    from a one-threaded server that imported torch and the dataset's module
    once per rank (about 2 s), so each worker still starts in milliseconds. A
    rank of ``run_distributed`` uses the suite's server (``warm.share_server``),
    which imported those already.
    """
    if not share_server():
        preload = ["torch", "ddpkit", type(dataset).__module__]
        multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"


class WorkerParents(Dataset[int]):
    """Each sample is the pid of the process that started the worker reading it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return os.getppid()


def worker_parents(rank: int, world_size: int) -> dict[str, Any]:
    """Where a rank's forkserver-started workers come from, and how many servers it ran."""
    data = WorkerParents()
    loader = DataLoader(
        data, batch_size=1, num_workers=2, multiprocessing_context=worker_start(data)
    )
    parents = {int(batch) for batch in loader}
    started = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    return {"parents": parents, "rank": os.getpid(), "server started": started}


def small_net() -> nn.Module:
    """BatchNorm and dropout: both must be restored exactly on resume."""
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)
    )


def train_run(
    rank: int, world_size: int, directory: str, epochs: int, resume: bool
) -> dict[str, torch.Tensor]:
    """fit() on 2 ranks with 2 workers per rank; returns the final weights."""
    torch.manual_seed(1234)  # the same initial weights on every rank
    info = DistInfo(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo", True)
    model = wrap_ddp(small_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    torch.manual_seed(99 + rank)  # dropout masks differ per rank, as in a real job
    data = NoisyBlobs()
    loader = build_loader(
        data,
        batch_size=4,
        train=True,
        workers=2,
        seed=5,
        info=info,
        multiprocessing_context=worker_start(data),
    )
    fit(
        model,
        loader,
        optimizer,
        criterion=nn.CrossEntropyLoss(),
        epochs=epochs,
        scheduler=scheduler,
        checkpoints=CheckpointManager(directory, prefix="tiny"),
        resume=resume,
        config=TrainConfig(normalize=None),
        report=ReportConfig(progress=False),
    )
    return {k: v.clone() for k, v in model.module.state_dict().items()}


class SlowStart(Dataset[tuple[torch.Tensor, int]]):
    """NoisyBlobs whose every worker takes ``delay`` s to start, and which can hang for good.

    A worker unpickles its dataset first thing (from a forkserver as from
    ``spawn``): ``__setstate__`` stands for a slow import (``spawn`` importing
    torch), a network mount or a ``worker_init_fn``. In the worker
    ``hang_worker``, reads after its first batch (``hang_after`` reads) never
    return (a stuck file system): every worker started before the hang.
    """

    def __init__(
        self, delay: float, n: int = 48, hang_worker: int | None = None, hang_after: int = 4
    ) -> None:
        self.inner, self.delay, self.hang_worker = NoisyBlobs(n), delay, hang_worker
        self.hang_after, self.reads = hang_after, 0

    def __setstate__(self, state: dict[str, object]) -> None:
        time.sleep(state["delay"])  # type: ignore[arg-type]
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        worker = get_worker_info()
        self.reads += 1
        if worker is not None and worker.id == self.hang_worker and self.reads > self.hang_after:
            threading.Event().wait()
        return self.inner[index]


def slow_workers_run(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, Any]:
    """fit() with the hang watchdog on, train and validation workers that start slowly.

    ``plan``: ``hang_timeout``, ``delay`` (each worker's start, s), ``persistent``,
    ``epochs``, ``hang_val`` (a rank whose validation data hangs after its first batch).
    """
    faulthandler.dump_traceback_later(130, exit=True)  # below the test's limit
    torch.manual_seed(1234)
    info = DistInfo(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo", True)
    model = wrap_ddp(small_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    delay, persistent = plan["delay"], plan["persistent"]
    hang = 1 if plan.get("hang_val") == rank else None  # the worker of batches 2, 4, ...
    # From a forkserver that preloaded torch, a worker's start costs its ``delay`` alone.
    datasets = [SlowStart(delay, 16), SlowStart(delay, 32, hang, hang_after=4)]
    start = worker_start(datasets[0])
    loaders = [
        build_loader(
            dataset,
            batch_size=4,
            train=train,
            workers=2,
            seed=5,
            info=info,
            persistent_workers=persistent,
            multiprocessing_context=start,
        )
        for dataset, train in zip(datasets, (True, False), strict=True)
    ]
    history = fit(
        model,
        loaders[0],
        optimizer,
        criterion=nn.CrossEntropyLoss(),
        epochs=plan["epochs"],
        val_loader=loaders[1],
        config=TrainConfig(normalize=None),
        report=ReportConfig(progress=False),
        faults=FaultConfig(hang_timeout=plan["hang_timeout"]),
    )
    return {"epochs": [r["epoch"] for r in history.records]}


def bn_net() -> nn.Module:
    """BatchNorm without dropout: what a rank validates is a function of its weights and buffers."""
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def validated_run(rank: int, world_size: int, directory: str, ema: bool) -> dict[str, object]:
    """fit() with validation on plain BatchNorm (no SyncBN on CPU): figures and files to compare.

    Each rank trains on its own share of the data, so its BatchNorm running
    statistics differ from the others'. Returns the history's figures, what
    ``evaluate`` gives after ``fit`` on these ranks, and what it gives on these
    ranks for the epoch's weight files and ``best.pth`` loaded into a fresh model.
    """
    torch.manual_seed(1234)
    info = DistInfo(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo", True)
    model = wrap_ddp(bn_net())
    average = model_ema(model, decay=0.5) if ema else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    train = build_loader(
        NoisyBlobs(n=60, seed=1), batch_size=3, train=True, workers=0, seed=5, info=info
    )
    val = build_loader(
        NoisyBlobs(n=37, seed=2, augment=False), batch_size=4, train=False, workers=0, info=info
    )
    criterion = nn.CrossEntropyLoss()
    history = fit(
        model,
        train,
        optimizer,
        criterion=criterion,
        epochs=2,
        val_loader=val,
        ema=average,
        checkpoints=CheckpointManager(directory, prefix="bn"),
        config=TrainConfig(normalize=None),
        report=ReportConfig(progress=False),
    )
    after = evaluate(model, val, criterion=criterion, normalize=None)
    files: dict[str, dict[str, float]] = {}
    for path in sorted(Path(directory).glob("*.pth")):
        if path.name.startswith("bn-") or path.name == "best.pth":
            fresh = bn_net()
            fresh.load_state_dict(load_checkpoint(path))
            files[path.name] = evaluate(fresh, val, criterion=criterion, normalize=None)
    return {"records": history.records, "after": after, "files": files}


class SlowBlobs(NoisyBlobs):
    """NoisyBlobs that take ``seconds`` to read each sample: a slow disk."""

    def __init__(self, seconds: float) -> None:
        super().__init__(n=32, augment=False)
        self.seconds = seconds

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.seconds)
        return super().__getitem__(index)


def straggler_run(rank: int, world_size: int) -> list[list[Any]]:
    """fit() on 2 ranks: 3 balanced epochs, then 1 in which rank 1 reads 3x slower.

    Returns each run's records' ``straggler`` fields and epoch lines.
    """
    out = []
    for epochs, slow in ((3, 1.0), (1, 3.0)):
        seconds = 0.01 * (slow if rank == 1 else 1.0)
        loader = build_loader(SlowBlobs(seconds), 4, train=True, workers=0, seed=0)
        model = wrap_ddp(nn.Linear(8, 3), sync_bn=False)
        history = fit(
            model,
            loader,
            torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            epochs=epochs,
            config=TrainConfig(normalize=None),
            report=ReportConfig(progress=False, verbose=False),
        )
        out.append([[r["straggler"], r["rank_spread"], epoch_line(r)] for r in history.records])
    return out


def tracker_job(
    rank: int,
    world_size: int,
    directory: str,
    epochs: int,
    resume: bool,
    kill_at: int | None = None,
) -> None:
    """fit() logging to TensorBoard, MLflow and W&B (offline) in ``directory``/logs.

    With ``kill_at``, the process SIGKILLs itself once epoch ``kill_at`` is logged,
    before that epoch's checkpoint is written: the resumed job retrains that epoch.
    """
    import os
    import signal

    torch.manual_seed(1234)
    info = DistInfo(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo", True)
    model = wrap_ddp(small_net())
    # The global batch stays 16 on any number of ranks, so the global step means the same:
    # 2 steps an epoch.
    loader = build_loader(
        NoisyBlobs(n=32), global_batch_size=16, train=True, workers=0, seed=5, info=info
    )

    checkpoints = CheckpointManager(Path(directory) / "ckpt", prefix="tiny")

    def kill(record: dict[str, Any]) -> None:
        if record["epoch"] == kill_at:
            # The epoch before is saved (its write may still run in the background on a
            # busy machine): the job dies between two checkpoints, not before its first,
            # once every tracker received the epoch (they log on a thread of their own).
            checkpoints.wait()
            from mlflow import MlflowClient

            client, deadline = MlflowClient(), time.monotonic() + 60
            runs = client.search_runs(
                [client.get_experiment_by_name("trackers-test").experiment_id]
            )
            while time.monotonic() < deadline:  # MLflow (the second tracker) has the epoch
                history = client.get_metric_history(runs[0].info.run_id, "epoch")
                if any(m.value == kill_at for m in history):
                    break
                time.sleep(0.05)
            time.sleep(0.2)  # W&B (the third) had it handed over, perhaps not yet written
            os.kill(os.getpid(), signal.SIGKILL)

    fit(
        model,
        loader,
        torch.optim.SGD(model.parameters(), lr=0.05),
        criterion=nn.CrossEntropyLoss(),
        epochs=epochs,
        # validated, so a best checkpoint is picked and the trackers are told of it
        val_loader=build_loader(
            NoisyBlobs(n=8, seed=1, augment=False), batch_size=4, train=False, workers=0, info=info
        ),
        checkpoints=checkpoints,
        resume=resume,
        config=TrainConfig(normalize=None),
        report=ReportConfig(
            progress=False,
            verbose=False,
            log_dir=Path(directory) / "logs",
            trackers=("tensorboard", "mlflow", "wandb"),
            project="trackers-test",
            run_config={"lr": {"value": 0.05, "source": "default"}},
        ),
        callbacks=[kill],
    )


def tracker_end_job(directory: str, epochs: int, die_in_finish: bool) -> None:
    """fit() on one process logging to TensorBoard and MLflow in ``directory``.

    With ``die_in_finish`` the process SIGKILLs itself inside MLflow's end of the
    run (its best checkpoint and curves), as a job killed at that moment.
    """
    import os
    import signal

    from ddpkit.training import trackers

    if die_in_finish:
        trackers._Mlflow.finish = lambda *_: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    torch.manual_seed(1234)
    model = small_net()
    loader = DataLoader(NoisyBlobs(n=16), batch_size=8)
    fit(
        model,
        loader,
        torch.optim.SGD(model.parameters(), lr=0.05),
        criterion=nn.CrossEntropyLoss(),
        epochs=epochs,
        val_loader=DataLoader(NoisyBlobs(n=8), batch_size=8),
        checkpoints=CheckpointManager(Path(directory) / "ckpt", prefix="tiny"),
        resume=True,
        config=TrainConfig(normalize=None),
        report=ReportConfig(
            progress=False,
            verbose=False,
            log_dir=Path(directory) / "logs",
            trackers=("tensorboard", "mlflow"),
            project="tracker-end",
        ),
    )


def slow_tracker_run(rank: int, world_size: int, directory: str, delay: float) -> int:
    """2 epochs on 2 ranks with a 2 s hang watchdog, MLflow answering in ``delay`` s on rank 0."""
    from ddpkit.training import trackers

    original = trackers._Mlflow.log

    def slow(self: Any, values: dict[str, float], step: int) -> None:
        time.sleep(delay)  # a tracking server that takes this long to answer
        original(self, values, step)

    trackers._Mlflow.log = slow  # type: ignore[method-assign]
    torch.manual_seed(0)
    info = DistInfo(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo", True)
    model = wrap_ddp(small_net())
    loader = build_loader(NoisyBlobs(n=32), batch_size=4, train=True, workers=0, info=info)
    history = fit(
        model,
        loader,
        torch.optim.SGD(model.parameters(), lr=0.05),
        criterion=nn.CrossEntropyLoss(),
        epochs=2,
        config=TrainConfig(normalize=None),
        report=ReportConfig(
            progress=False,
            verbose=False,
            log_dir=Path(directory) / f"logs{rank}",
            trackers=("mlflow",),
            project="slow-tracker",
        ),
        faults=FaultConfig(hang_timeout=2.0),
    )
    return len(history.records)


def plain_loader_run(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, Any]:
    """A loop of one's own over the recipe's loader: ``DataLoader(sampler=DistributedSampler)``.

    ``NoisyBlobs`` draws each sample's augmentation from the torch RNG of the
    process that reads it (the rank, or a worker); ``plan`` says the workers,
    where to kill (``fault_jobs.Hooked``) and whether to resume.
    """
    import functools

    from fault_jobs import Hooked  # type: ignore[import-not-found]
    from stream_jobs import _end_with  # type: ignore[import-not-found]
    from torch.utils.data import DistributedSampler

    from ddpkit import StepGuard, TrainingState

    torch.manual_seed(1234)  # the same initial weights on every rank
    data = NoisyBlobs(40)
    workers = plan.get("workers", 0)
    start: dict[str, Any] = {}
    if workers:
        start["multiprocessing_context"] = worker_start(data)
        start["worker_init_fn"] = functools.partial(_end_with, os.getpid())
        start["persistent_workers"] = plan.get("persistent", False)
    sampler = plan.get("sampler", "distributed")
    order: Any = DistributedSampler(data, seed=3) if sampler == "distributed" else None
    loader = DataLoader(
        data, batch_size=4, sampler=order, shuffle=sampler == "random", num_workers=workers, **start
    )
    model = wrap_ddp(small_net())
    optimizer = Hooked(model.parameters(), plan, rank)
    state = TrainingState(model, optimizer)
    manager = CheckpointManager(plan["dir"], state=state, every_steps=plan.get("every_steps", 1))
    criterion = nn.CrossEntropyLoss()
    with StepGuard(manager) as guard, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = guard.resume(loader) if plan.get("resume") else 0
        start_step = guard.step
        for epoch in range(first, plan.get("epochs", 2)):
            model.train()
            part = guard.batches(loader, epoch)
            for x, y in part:
                with guard.forward(part):
                    loss = criterion(model(x), y)
                guard.backward(loss, part)
            guard.end_epoch(epoch)
    weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return {
        "weights": weights,
        "start": start_step,
        "rng": torch.random.get_rng_state(),
        "said": said,
    }
