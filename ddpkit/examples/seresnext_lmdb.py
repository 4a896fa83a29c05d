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

# ruff: noqa: SIM905 - lists of flag names read best as one line of text
from __future__ import annotations

import argparse
import gc
import logging
import os
import re
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
from ddpkit.examples.seresnext_flags import BALANCE_POWERS, batch_error, warn_changed_settings


def train(
    info: ddpkit.DistInfo, args: argparse.Namespace, schedule_epochs: int | None = None
) -> dict[str, Any]:
    """One process's run, the recipe's ``main_worker``: the last epoch's record (``--evaluate``:
    the metrics). ``schedule_epochs``: the schedule's span, if more than ``--epochs``."""
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

    criterion = ddpkit.FocalLoss(alpha=0.25, gamma=2, num_class=classes, smooth=0.1)
    if args.evaluate:
        return evaluate_only(info, args, val_loader, classes, criterion)

    # The model: SyncBatchNorm and DDP when there are several processes, itself on one.
    net = build_model(args, classes)
    cuda = info.device.type == "cuda"
    if cuda:  # the recipe's setting: cuDNN picks the fastest kernels for fixed input sizes
        torch.backends.cudnn.benchmark = True
        net = net.to(memory_format=torch.channels_last)  # with channels_last batches, below
    model = ddpkit.wrap_ddp(
        net,
        device=info.device,
        comm_hook=args.comm_hook,  # compressed gradients: each rank's state in the checkpoints
        powersgd_rank=args.powersgd_rank,
        powersgd_warmup=args.powersgd_warmup,
        powersgd_error_feedback=False if args.no_powersgd_error_feedback else None,
    )
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
    per_process, workers = train_loader.batch_size or 0, train_loader.num_workers
    logging.info(batch_line(args.batch_size, info.world_size, per_process, workers))

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
        extra=record(args, classes, MODEL_FLAGS + SAMPLE_FLAGS),
    )
    run_config = ddpkit.CommandLine.resolved(args)
    # A restarted process (torchrun --max-restarts, --max-restarts) continues the run. After
    # a server joined, torchrun's count is the surviving servers' and the new one's is 0:
    # any rank's decides for all.
    resume = args.resume or any(ddpkit.all_gather_object(info.restart_count > 0))
    if resume is True:  # a named file may be of another run: its rates are its own
        warn_changed_settings(checkpoints, run_config)
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
            log_dir=args.log_dir or checkpoints.directory,  # with a URL: a local one
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
    # curves.png can leave the loaders in a reference cycle: their workers stop now, not at exit.
    gc.collect()
    return history.last if history.records else {}


def _start_process(info: ddpkit.DistInfo, global_batch: int) -> None:
    """Rank-prefixed logs, ``-b`` checked against the processes, this process's share of the CPU."""
    level, form = logging.INFO if info.is_main else logging.WARNING, "%(asctime)s %(message)s"
    logging.basicConfig(level=level, format=f"[rank {info.rank}] {form}", force=True)
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
        ddpkit.load_pretrained(model, args.pretrained)  # the 1000-class head is skipped
        if not args.requires_grad:  # without --pretrained every layer trains (random features)
            trainable = ddpkit.freeze_backbone(model)
            logging.info(
                "training only %s; --requires-grad trains all layers", ", ".join(trainable)
            )
    return model


def evaluate_only(
    info: ddpkit.DistInfo, args: argparse.Namespace, loader: Any, classes: int, loss: nn.Module
) -> dict[str, Any]:
    """``--evaluate``: the accuracy of a checkpoint, printed on rank 0. Every rank calls it."""
    model = build_model(args, classes)
    source = load_for_evaluation(args, model, record(args, classes, MODEL_FLAGS))
    # evaluate() runs the plain model on each rank's share: no DDP wrapper is needed.
    metrics = ddpkit.evaluate(
        model.to(info.device), loader, criterion=loss, amp=args.amp, device=info.device
    )
    if info.is_main:
        top5 = f" acc5 {metrics['acc5']:.3f}" if len(metrics["recall"]) > 5 else ""
        print(
            f"evaluate {source}: acc1 {metrics['acc1']:.3f}{top5} "
            f"loss {metrics['loss']:.6g} samples {metrics['samples']:.0f}"
        )
    return metrics


def load_for_evaluation(
    args: argparse.Namespace, model: nn.Module, expected: dict[str, Any] | None = None
) -> str:
    """Load what ``--evaluate`` measures into ``model`` and say where it came from: ``--resume
    PATH``, else the newest checkpoint any node holds, else ``--pretrained``. One trained with
    other ``expected`` values is refused before loading. All ranks must call this."""
    if isinstance(args.resume, str):
        load_weights(model, args.resume, "--resume", expected)
        return args.resume
    checkpoints = ddpkit.CheckpointManager(
        args.checkpoints,
        prefix=weights_prefix(args),
        extra=expected,
        state=ddpkit.TrainingState(model),
    )
    with warnings.catch_warnings():  # evaluation draws no random numbers
        warnings.filterwarnings("ignore", ".*RNG state", RuntimeWarning)
        checkpoints.resume(strict_rng=False)
    if checkpoints.position is not None:
        return str(checkpoints.resumed_checkpoint or f"the newest in {checkpoints.location}")
    if args.pretrained:
        load_weights(model, args.pretrained, "--pretrained", None)
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
    """What ``init_distributed`` needs beyond a launcher's variables: the recipe's job
    (``--world-size N --rank R --dist-url``), else nothing (torchrun, SLURM, one process)."""
    job = {"init_method": args.dist_url, "world_size": args.world_size, "rank": args.rank}
    device = None if args.gpu is None else f"cuda:{args.gpu}"
    return {**(job if args.world_size > 1 else {}), "backend": args.dist_backend, "device": device}


def weights_prefix(args: argparse.Namespace) -> str:
    """The start of the per-epoch weight files' names: ``--network``, else the arch."""
    # hf-hub:org/name -> hf-hub-org-name
    return str(args.network) if args.network is not None else re.sub(r"[^\w.-]+", "-", args.arch)


def workers_per_process(workers: int | None, nprocs: int) -> int | None:
    """``-j`` (per node) shared by its ``nprocs`` processes, rounded up as the recipe did."""
    return None if workers is None else (workers + nprocs - 1) // nprocs


def batch_line(global_batch: int, nprocs: int, per_process: int, workers: int) -> str:
    """The start-up line that says how ``-b`` and ``-j`` were shared out."""
    return (
        f"global batch {global_batch} (-b: all processes of all nodes, not per node) = "
        f"{nprocs} process{'es' if nprocs != 1 else ''} x {per_process} per process; "
        f"{workers} data worker{'s' if workers != 1 else ''} per process"
    )


# What every checkpoint records (CheckpointManager(extra=)): the model's flags, checked on
# --evaluate and --resume, and those that decide the samples, their order and augmentations.
MODEL_FLAGS = ["arch", "image_size"]
SAMPLE_FLAGS = (
    "batch_size seed data balance aug_repeats auto_augment aug_magnitude random_erase"
).split()


def record(args: argparse.Namespace, num_classes: int, flags: Sequence[str]) -> dict[str, Any]:
    """``{"--num-classes": num_classes, "--arch": ..., ...}``: the values of ``flags``."""
    values = {f: getattr(args, f) for f in flags}
    if "data" in values:  # the same directory however it is written
        values["data"] = os.path.realpath(values["data"])
    named = {f"--{f.replace('_', '-')}": "none" if v is None else v for f, v in values.items()}
    return {"--num-classes": num_classes, **named}


def load_weights(model: nn.Module, path: str, flag: str, expected: dict[str, Any] | None) -> None:
    """Load the whole of ``path`` into ``model`` on every rank, refused before loading if its run
    recorded other ``expected`` values; a failure on one reaches all. All ranks must call this."""
    error = None
    try:
        if ddpkit.load_pretrained(model, path, strict=True, expected_extra=expected).skipped:
            error = f"{path} has another head than the model: pass its --num-classes"
    except (OSError, ValueError, ddpkit.CheckpointError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    errors = [(rank, e) for rank, e in enumerate(ddpkit.all_gather_object(error)) if e]
    if errors:
        rank, first = errors[0]
        raise ddpkit.CheckpointError(f"--evaluate {flag} {path} (rank {rank}): {first}")


_MODERN = {"sched": "cosine", "warmup_epochs": 1.0, "model_ema": True, "model_ema_decay": 0.98}


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
        # --demo-recipe: modern (warm-up, cosine, EMA) or classic (x0.1 for the last epoch)
        **({"sched": "step"} if args.demo_recipe == "classic" else _MODERN),
        "checkpoints": str(out / "checkpoints"),
        "multiprocessing_distributed": True,
        "nprocs": nprocs,
        "world_size": 1,
        "rank": 0,
        "dist_url": None,
    }
    if args.comm_hook == "powersgd" and args.powersgd_warmup is None:
        # PyTorch's 1000 steps of plain all-reduce outlast the demo: one epoch's, as the rate's
        settings["powersgd_warmup"] = max(2, images // settings["batch_size"])
    sources = {**args.sources, **dict.fromkeys(settings, "demo")}
    first = argparse.Namespace(**{**vars(args), **settings, "sources": sources})
    run(first, schedule_epochs=first.epochs + 1)  # the schedule spans both jobs: 7 of its 8
    # A second job continues from latest.pth for one more epoch: resume works.
    sources = {**first.sources, "resume": "demo"}
    second = {**vars(first), "epochs": first.epochs + 1, "resume": True, "sources": sources}
    record = run(argparse.Namespace(**second))
    seconds, where = time.perf_counter() - start, f"{gpus} GPU" if gpus else "2 CPU"
    ema = f" (EMA {record['val_ema_acc1']:.2f}%)" if "val_ema_acc1" in record else ""
    print(
        f"demo: final val acc1 {record['val_acc1']:.2f}%{ema} after {first.epochs + 1} epochs, "
        f"total wall time {seconds:.1f} s ({where} processes)"
    )
    return record


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
