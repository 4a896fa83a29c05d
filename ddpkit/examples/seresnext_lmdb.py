"""Train an SE-ResNeXt on LMDB data with DDP, on one process, one node or several.

The same script runs every way a PyTorch ImageNet-example user expects
(``python examples/seresnext_lmdb.py`` in a checkout does the same as
``python -m ddpkit.examples.seresnext_lmdb``):

    python -m ddpkit.examples.seresnext_lmdb --data DIR              # one process (CPU or GPU)
    python -m ddpkit.examples.seresnext_lmdb --data DIR --multiprocessing-distributed \\
        --world-size 2 --rank 0 --dist-url tcp://10.0.0.1:23456      # node 0 of 2, 1 per GPU
    torchrun --nproc-per-node 8 -m ddpkit.examples.seresnext_lmdb --data DIR   # also srun
    torchrun --nproc-per-node 8 --max-restarts 3 -m ddpkit.examples.seresnext_lmdb --data DIR \\
        --save-every-minutes 10 --hang-timeout 600 --resume             # survives crashes
    python -m ddpkit.examples.seresnext_lmdb --data DIR --evaluate   # the newest checkpoint's acc
    python -m ddpkit.examples.seresnext_lmdb --demo                  # generated shapes, minutes

``DIR`` holds ``train.lmdb`` and ``val.lmdb`` (``ddpkit lmdb build``). Unlike the
PyTorch ImageNet example, ``-b`` is the global batch of all processes of all nodes.
Needs timm: ``pip install "ddpkit[examples]"``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

import ddpkit
from ddpkit.examples import seresnext_flags
from ddpkit.examples.seresnext_config import resolved
from ddpkit.examples.seresnext_setup import (
    BALANCE_POWERS,
    batch_error,
    batch_line,
    check_resume_config,
    data_record,
    load_weights,
    model_record,
    weights_prefix,
    workers_per_process,
)

__all__ = [
    "build_model",
    "build_parser",
    "demo",
    "evaluate_only",
    "init_arguments",
    "load_for_evaluation",
    "main",
    "parse_args",
    "run",
    "train",
]


def train(
    info: ddpkit.DistInfo, args: argparse.Namespace, schedule_epochs: int | None = None
) -> dict[str, Any]:
    """One process's whole run, the recipe's ``main_worker``; every rank calls it.

    ``schedule_epochs``: the epochs the learning-rate schedule spans (default
    ``--epochs``; more stops the run before its end, as the demo's first job).
    Returns the last epoch's record, or with ``--evaluate`` the metrics.
    """
    _start_process(info, args.batch_size)
    torch.manual_seed(args.seed)

    # The data: LMDB files each worker opens itself, each rank its share of every epoch.
    size, data = args.image_size, Path(args.data)
    train_tf = ddpkit.train_transform(
        size,
        scale=(args.min_crop, 1.0),
        auto_augment=args.auto_augment,
        magnitude=args.aug_magnitude,
        random_erase=args.random_erase,
    )
    decode = args.decode  # "cuda": each batch decodes on the GPU, the workers draw the crops
    train_set = ddpkit.LazyLMDBDataset(data / "train.lmdb", transform=train_tf, decode=decode)
    val_tf = ddpkit.val_transform(size, round(size * 256 / 224))
    val_set = ddpkit.LazyLMDBDataset(data / "val.lmdb", transform=val_tf, decode=decode)
    classes = args.num_classes or len(train_set.classes)
    loading: dict[str, Any] = {
        "workers": workers_per_process(args.workers, info.local_world_size),
        "seed": args.seed,
        "info": info,
        "multiprocessing_context": args.worker_start,
    }
    val_batch = max(1, args.batch_size // info.world_size)
    val_loader = ddpkit.build_loader(val_set, batch_size=val_batch, train=False, **loading)

    # The recipe's loss, and what every checkpoint records of the model it trains.
    criterion = ddpkit.FocalLoss(alpha=0.25, gamma=2, num_class=classes, smooth=0.1)
    record = model_record(args, classes)
    if args.evaluate:
        return evaluate_only(info, args, build_model(args, classes), val_loader, criterion, record)

    # The model: SyncBatchNorm and DDP when there are several processes, itself on one.
    net = build_model(args, classes)
    cuda = info.device.type == "cuda"
    if cuda:  # the recipe's setting: cuDNN picks the fastest kernels for fixed input sizes
        torch.backends.cudnn.benchmark = True
        net = net.to(memory_format=torch.channels_last)  # with channels_last batches, below
    model = ddpkit.wrap_ddp(net, device=info.device)
    ema = ddpkit.model_ema(model, decay=args.model_ema_decay) if args.model_ema else None
    if args.compile:
        model = torch.compile(model)  # type: ignore[assignment]

    # -b is the global batch: each process loads its share of it.
    train_loader = ddpkit.build_loader(
        train_set,
        global_batch_size=args.batch_size,
        train=True,
        balance=BALANCE_POWERS[args.balance],
        repeats=args.aug_repeats,
        **loading,
    )
    logging.info(
        batch_line(
            args.batch_size, info.world_size, train_loader.batch_size or 0, train_loader.num_workers
        )
    )

    # SGD with momentum; x0.1 at the milestones (or a cosine), stepped every optimizer step.
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr if args.lr_base is None else ddpkit.linear_scaled_lr(args.lr_base, args.batch_size)
    optimizer = torch.optim.SGD(
        params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = ddpkit.warmup_schedule(
        optimizer,
        epochs=schedule_epochs or args.epochs,
        steps_per_epoch=-(-len(train_loader) // args.grad_accum_steps),  # optimizer steps
        warmup_epochs=args.warmup_epochs,
        decay=args.sched,
        milestones=args.milestones if args.sched == "step" else (),
    )
    mix = None
    if args.mixup or args.cutmix:
        mix = ddpkit.mixup_cutmix(classes, mixup_alpha=args.mixup, cutmix_alpha=args.cutmix)

    # Training. fit binds the model, optimizer and schedule to the checkpoint manager once;
    # rank 0 saves every epoch (and --save-every-*); a resume takes the newest any node holds.
    checkpoints = ddpkit.CheckpointManager(
        args.checkpoints,
        prefix=weights_prefix(args),
        keep_last=args.keep_last,
        every_steps=args.save_every_steps,
        every_minutes=args.save_every_minutes,
        on_each_node=args.save_on_each_node,
        overwrite=args.overwrite,
        extra={**record, **data_record(args)},
    )
    run_config = resolved(args, args.sources)
    # A restarted process (torchrun --max-restarts, --max-restarts) continues the run.
    resume = args.resume or info.restart_count > 0
    if resume is True:  # a named file may be of another run: its own flags are not compared
        check_resume_config(checkpoints, run_config)
    history = ddpkit.fit(
        model,
        train_loader,
        optimizer,
        criterion=criterion,
        epochs=args.epochs,
        val_loader=val_loader,
        scheduler=scheduler,
        ema=ema,
        config=ddpkit.TrainConfig(
            amp=args.amp,
            grad_accum=args.grad_accum_steps,
            clip_grad_norm=args.clip_grad,
            batch_transform=mix,
            channels_last=cuda,
        ),
        checkpoints=checkpoints,
        resume=resume,
        report=ddpkit.ReportConfig(
            log_dir=args.log_dir or args.checkpoints,
            progress=not args.demo,  # a bar on rank 0, not in the demo
            profile_steps=args.profile_steps,
            profile_ranks=tuple(args.profile_ranks) if args.profile_ranks else None,
            run_config=run_config,
            trackers=args.log_with,
            project=args.project,
        ),
        faults=ddpkit.FaultConfig(
            hang_timeout=args.hang_timeout, on_data_change=args.on_data_change.replace("-", "_")
        ),
    )
    # Drawing curves.png can leave fit's frame, and with it the loaders, in a reference
    # cycle. Collected now, their persistent workers stop here, before the process group
    # goes, instead of at the interpreter's exit.
    gc.collect()
    return history.last if history.records else {}


def _start_process(info: ddpkit.DistInfo, global_batch: int) -> None:
    """Rank-prefixed logs, ``-b`` checked against the processes, this process's share of the CPU."""
    logging.basicConfig(
        level=logging.INFO if info.is_main else logging.WARNING,
        format=f"[rank {info.rank}] %(asctime)s %(message)s",
        force=True,
    )
    error = batch_error(global_batch, info.world_size)
    if error is not None:  # before any data or model is built; rank 0 says why
        if info.is_main:
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
    if info.device.type == "cpu":  # share the cores instead of oversubscribing them
        torch.set_num_threads(ddpkit.cpu_share(info.local_world_size))


def build_model(args: argparse.Namespace, num_classes: int) -> nn.Module:
    """The model to train; ``--evaluate`` loads its weights later (``load_for_evaluation``)."""
    if not timm.is_model(args.arch):  # timm's own error names no way out
        raise ValueError(
            f"--arch {args.arch}: timm has no such model; its names: "
            f"python -c \"import timm; print(timm.list_models('*{args.arch[:6]}*'))\""
        )
    model = timm.create_model(args.arch, pretrained=False, num_classes=num_classes)
    if args.pretrained and not args.evaluate:
        # The ImageNet head (1000 outputs) is skipped; ours stays fresh.
        ddpkit.load_pretrained(model, args.pretrained)
        # A frozen backbone only makes sense with learned features: without
        # --pretrained every layer trains (parse_args refuses --freeze-backbone).
        if not args.requires_grad:
            trainable = ddpkit.freeze_backbone(model)
            logging.info(
                "training only %s; --requires-grad trains all layers", ", ".join(trainable)
            )
    return model


def evaluate_only(
    info: ddpkit.DistInfo,
    args: argparse.Namespace,
    model: nn.Module,
    val_loader: Any,
    criterion: nn.Module,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``--evaluate``: the accuracy of a checkpoint, printed on rank 0. Every rank calls it."""
    source = load_for_evaluation(args, model, record)
    # evaluate() runs the plain model on each rank's share: no DDP wrapper is needed.
    metrics = ddpkit.evaluate(
        model.to(info.device), val_loader, criterion=criterion, amp=args.amp, device=info.device
    )
    if info.is_main:
        top5 = f" acc5 {metrics['acc5']:.3f}" if len(metrics["recall"]) > 5 else ""
        print(
            f"evaluate {source}: acc1 {metrics['acc1']:.3f}{top5} "
            f"loss {metrics['loss']:.6g} samples {metrics['samples']:.0f}"
        )
    return metrics


def load_for_evaluation(
    args: argparse.Namespace, model: nn.Module, record: dict[str, Any] | None = None
) -> str:
    """Load what ``--evaluate`` measures into ``model``; return where it came from.

    ``--resume PATH`` (any checkpoint or weights file, read on every node), else
    the newest complete checkpoint any node holds in ``--checkpoints``, else
    ``--pretrained``. A checkpoint trained with another ``record`` (``--arch``
    ...) is refused before loading. All ranks must call this, or it deadlocks.
    """
    if isinstance(args.resume, str):
        load_weights(model, args.resume, "--resume", record)
        return args.resume
    checkpoints = ddpkit.CheckpointManager(
        args.checkpoints,
        prefix=weights_prefix(args),
        extra=record,
        state=ddpkit.TrainingState(model),
    )
    with warnings.catch_warnings():
        # Evaluation draws no random numbers: RNG states saved by another
        # number of ranks do not matter here.
        warnings.filterwarnings("ignore", ".*RNG state", RuntimeWarning)
        checkpoints.resume(strict_rng=False)
    if checkpoints.position is not None:
        return str(checkpoints.resumed_from or f"the newest checkpoint in {args.checkpoints}")
    if args.pretrained:
        load_weights(model, args.pretrained, "--pretrained")
        return str(args.pretrained)
    raise ddpkit.CheckpointError(
        f"--evaluate: no checkpoint in {args.checkpoints} on any node and no --pretrained; "
        "pass the training run's --checkpoints DIR, --resume PATH or --pretrained PATH"
    )


def run(args: argparse.Namespace, schedule_epochs: int | None = None) -> dict[str, Any]:
    """Train with ``spawn`` (-m-d) or ``init_distributed``; returns this node's first record."""
    if args.multiprocessing_distributed:
        records: list[dict[str, Any]] = ddpkit.spawn(
            train,
            args.nprocs,
            args=(args, schedule_epochs),
            nnodes=args.world_size,
            node_rank=args.rank,
            init_method=args.dist_url,
            backend=args.dist_backend,
            max_restarts=args.max_restarts,
        )
        return records[0]
    with ddpkit.init_distributed(**init_arguments(args)) as info:
        return train(info, args, schedule_epochs)


def init_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """What ``init_distributed`` needs beyond the launcher's variables.

    The recipe's one-process-per-node mode (``--world-size N --rank R --dist-url``)
    passes the job explicitly; otherwise ``init_distributed`` finds torchrun,
    SLURM or Open MPI itself, or runs a single process.
    """
    device = None if args.gpu is None else f"cuda:{args.gpu}"
    if args.world_size > 1:
        return {
            "init_method": args.dist_url,
            "world_size": args.world_size,
            "rank": args.rank,
            "backend": args.dist_backend,
            "device": device,
        }
    return {"backend": args.dist_backend, "device": device}


# What --demo-recipe changes in the demo's training (benchmarks.md compares the two).
_DEMO_RECIPES: dict[str, dict[str, Any]] = {
    "classic": {"sched": "step"},
    "modern": {"sched": "cosine", "warmup_epochs": 1.0, "model_ema": True, "model_ema_decay": 0.98},
}


def demo(args: argparse.Namespace) -> dict[str, Any]:
    """Shapes -> LMDB -> a small SE-ResNeXt trained from scratch on 2 processes, then resumed."""
    start, out = time.perf_counter(), Path(args.out)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a fresh run, then its resume
    sizes = {"train_per_class": args.demo_per_class, "val_per_class": 50, "size": 32}
    dirs = ddpkit.make_shapes_dataset(out / "shapes", classes=args.demo_classes, **sizes)
    for split, source in zip(("train", "val"), dirs, strict=True):
        ddpkit.build_lmdb(source, out / f"{split}.lmdb", overwrite=True, progress=False)
    gpus = torch.cuda.device_count()
    nprocs, images = gpus or 2, args.demo_classes * args.demo_per_class
    settings: dict[str, Any] = {
        "data": str(out),
        "arch": "legacy_seresnext26_32x4d",
        "image_size": 32,
        "requires_grad": True,
        "min_crop": 0.7,
        "lr": 0.05,
        "epochs": args.demo_epochs,
        "batch_size": min(64, images // nprocs * nprocs),  # tiny test runs still take a step
        "milestones": [args.demo_epochs - 1],
        "workers": 0,
        "network": "demo",
        **_DEMO_RECIPES[args.demo_recipe],
        "checkpoints": str(out / "checkpoints"),
        "multiprocessing_distributed": True,
        "nprocs": nprocs,
        "world_size": 1,
        "rank": 0,
        "dist_url": None,
    }
    sources = {**args.sources, **dict.fromkeys(settings, "demo")}
    first = argparse.Namespace(**{**vars(args), **settings, "sources": sources})
    run(first, schedule_epochs=first.epochs + 1)  # the schedule spans both jobs: 7 of its 8
    # A second job continues from latest.pth for one more epoch: resume works.
    record = run(argparse.Namespace(**{**vars(first), "epochs": first.epochs + 1, "resume": True}))
    seconds, where = time.perf_counter() - start, f"{gpus} GPU" if gpus else "2 CPU"
    ema = f" (EMA {record['val_ema_acc1']:.2f}%)" if "val_ema_acc1" in record else ""
    print(
        f"demo: final val acc1 {record['val_acc1']:.2f}%{ema} after {first.epochs + 1} epochs, "
        f"total wall time {seconds:.1f} s ({where} processes)"
    )
    return record


def build_parser() -> argparse.ArgumentParser:
    """The example's parser, without ``--config`` files or the checks between flags."""
    return seresnext_flags.build_parser(description=__doc__)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The example's flags, checked (``seresnext_flags``); ``--help`` opens with this docstring."""
    return seresnext_flags.parse_args(argv, description=__doc__)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # A mistake (a missing --data, another --arch on --resume ...): one line, status 1.
    with ddpkit.expected_errors(debug=args.debug):
        if args.demo:
            demo(args)
        else:
            run(args)


if __name__ == "__main__":
    main()
