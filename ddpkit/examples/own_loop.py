"""The seed recipe's training loop written by hand, with ddpkit's blocks and no ``fit``.

The forward and the loss are this file's own lines; the rest of each step is
the one call ``fit`` makes too (``guard.backward``): mixed precision, gradient
accumulation, clipping, the model's average, and the optimizer step. ddpkit
adds what a long job needs around them: LMDB data safe in DataLoader workers,
SyncBN and DDP, validation that counts each image once, checkpoints that any
node resumes bit-exactly, every rank stopping together on SIGTERM, and the
rest of an epoch after a kill. docs/own-loop.md walks through it against the
recipe.

    python -m ddpkit.examples.own_loop --data DIR --nproc-per-node 2     # 2 processes
    torchrun --nproc-per-node 8 -m ddpkit.examples.own_loop --data DIR   # the launcher's
    python -m ddpkit.examples.own_loop --data DIR --nproc-per-node 2 --resume
    python -m ddpkit.examples.own_loop --data DIR --amp bf16 --grad-accum-steps 2 \
        --clip-grad 1.0 --model-ema --model-ema-decay 0.999

``DIR`` holds ``train.lmdb`` and ``val.lmdb`` (``ddpkit lmdb build``); ``-b`` is
the global batch of all processes. A stop signal ends it with status 75 once a
checkpoint is written: run it again with ``--resume``. Needs timm:
``pip install "ddpkit[examples]"``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import timm
import torch

import ddpkit


def train(info: ddpkit.DistInfo, args: argparse.Namespace) -> dict[str, Any]:
    """One process's run of the recipe; every rank calls it. Returns the last validation."""
    torch.manual_seed(args.seed)
    # The data: LMDB read lazily in each worker, a seeded sampler and batch per rank.
    size, data = args.image_size, Path(args.data)
    train_set = ddpkit.LazyLMDBDataset(data / "train.lmdb", ddpkit.train_transform(size))
    val_set = ddpkit.LazyLMDBDataset(
        data / "val.lmdb", ddpkit.val_transform(size, round(size * 256 / 224))
    )
    train_loader = ddpkit.build_loader(
        train_set, global_batch_size=args.batch_size, train=True, seed=args.seed, info=info
    )
    val_loader = ddpkit.build_loader(
        val_set, batch_size=max(1, args.batch_size // info.world_size), train=False, info=info
    )
    # The model: SE-ResNeXt with a new head, SyncBN (on GPUs) and DDP.
    classes = len(train_set.classes)
    if not timm.is_model(args.arch):  # timm's own error names no way out
        raise ValueError(f"--arch {args.arch}: timm has no such model (timm.list_models())")
    model = ddpkit.wrap_ddp(
        timm.create_model(args.arch, num_classes=classes),
        sync_bn=True,
        comm_hook=args.comm_hook,  # compressed gradients: each rank's state in the checkpoints
        powersgd_rank=args.powersgd_rank,
        powersgd_warmup=args.powersgd_warmup,
        powersgd_error_feedback=False if args.no_powersgd_error_feedback else None,
    )
    traffic = ddpkit.comm_hook_of(model)  # what each step all-reduces (None: one process)
    # The recipe's loss, optimizer and schedule.
    criterion = ddpkit.FocalLoss(alpha=0.25, gamma=2, num_class=classes, smooth=0.1)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.milestones)
    ema = ddpkit.model_ema(model, decay=args.model_ema_decay) if args.model_ema else None
    # Everything a checkpoint holds, bound once; the files any node can resume from.
    manager = ddpkit.CheckpointManager(
        args.checkpoints,
        state=ddpkit.TrainingState(model, optimizer, scheduler, ema=ema),
        every_steps=args.save_every_steps,
        every_minutes=args.save_every_minutes,
        extra={"arch": args.arch},
    )
    # How each step runs: the same options, and the same step, as fit's.
    config = ddpkit.TrainConfig(
        amp=args.amp, grad_accum=args.grad_accum_steps, clip_grad_norm=args.clip_grad
    )
    val: dict[str, Any] = {}
    # The epochs. The guard resumes, hands out the rest of an epoch, takes each optimizer
    # step, saves when due, stops every rank together on a signal, and at the end of the
    # block waits until the last checkpoint is on disk.
    with ddpkit.StepGuard(manager, config=config) as guard:
        # A fresh run claims the directory (or store) now: another run's files, a wrong
        # bucket or credentials are refused before the first step; this same torchrun job's
        # (its workers started again after a server joined) are resumed.
        first = guard.resume(train_loader) if args.resume or manager.claim() else 0
        for epoch in range(first, args.epochs):
            model.train()
            sent = traffic.counted() if traffic is not None else (0, 0)
            part = guard.batches(train_loader, epoch)  # set_epoch, and where a resume stood
            for images, targets in part:
                images = ddpkit.normalize_batch(images.to(info.device))  # uint8 -> float
                with guard.forward(part):  # autocast; no all-reduce inside a window
                    loss = criterion(model(images), targets.to(info.device))
                guard.backward(loss, part)  # the step when the window closes; SIGTERM: exit 75
            scheduler.step()
            val = ddpkit.evaluate(model, val_loader, criterion=criterion)  # each image once
            metrics = {"acc1": val["acc1"], "loss": val["loss"]}
            if ema is not None:  # the weight file holds the better of the two
                averaged = ddpkit.evaluate(ema.module, val_loader, criterion=criterion)
                metrics["ema_acc1"] = averaged["acc1"]
            if info.is_main:
                per_step = traffic.bytes_per_step(sent) if traffic is not None else None
                comm = f", all-reduce {per_step / 1e6:.3g} MB/step" if per_step else ""
                print(
                    f"epoch {epoch + 1}/{args.epochs}: step {guard.step}, val acc1 "
                    f"{val['acc1']:.2f}%, loss {val['loss']:.4f}{comm}",
                    flush=True,
                )
            guard.end_epoch(epoch, metrics=metrics)
    return val


_f, _number = ddpkit.CommandLine.flag, ddpkit.CommandLine.number
INT1 = _number(int, 1)
# The flags, in --help's order (ddpkit.CommandLine: --config FILE gives their defaults).
FLAGS = (
    _f("--config", metavar="FILE", help="a YAML or TOML file of flag: value defaults"),
    _f("--data", metavar="DIR", help="holds train.lmdb, val.lmdb (required)"),
    _f("--arch", default="legacy_seresnext101_32x4d", metavar="NAME", help="a timm model"),
    _f("--image-size", type=INT1, default=224, metavar="PIXELS"),
    _f("-b", "--batch-size", type=INT1, default=256, metavar="GLOBAL_BATCH", help="(below)"),
    _f("--epochs", type=INT1, default=90, metavar="N"),
    _f("--lr", type=_number(float, 0, strict=True), default=0.1),
    _f("--milestones", type=_number(int, 0, strict=True), nargs="*", default=[30, 60, 80]),
    _f("--seed", type=_number(int, 0), default=0),
    _f("--amp", choices=["bf16", "fp16"], help="mixed precision (bf16 on CPUs)"),
    _f("--comm-hook", choices=["bf16", "fp16", "powersgd"], help="compress the gradients sent"),
    _f("--powersgd-rank", type=INT1, metavar="R", help="PowerSGD's rank (default 1)"),
    _f("--powersgd-warmup", type=_number(int, 2), metavar="STEPS", help="default 1000"),
    _f("--no-powersgd-error-feedback", action="store_true", help="PowerSGD without it"),
    _f("--grad-accum-steps", type=INT1, default=1, metavar="N", help="micro-batches per step"),
    _f("--clip-grad", type=_number(float, 0, strict=True), metavar="NORM", help="clip to"),
    _f("--model-ema", action="store_true", help="evaluate a moving average of the weights too"),
    _f("--model-ema-decay", type=_number(float, 0, strict=True), default=0.9998, metavar="D"),
    _f("--checkpoints", default="checkpoints", metavar="DIR|URL", help="or s3://bucket/prefix"),
    _f("--save-every-steps", type=INT1, metavar="N", help="a step checkpoint every N steps"),
    _f("--save-every-minutes", type=_number(float, 0, strict=True), metavar="M"),
    _f("--resume", action="store_true", help="continue from the newest checkpoint any node holds"),
    _f("--debug", action="store_true", help="the traceback of an error (or DDPKIT_DEBUG=1)"),
    _f("--nproc-per-node", type=INT1, default=1, metavar="N", help="processes here (below)"),
)
NOTES = """\
-b is the global batch of all processes together. --nproc-per-node N starts N processes on
this machine (CPU, or one per GPU); under torchrun or SLURM, the launcher's are used.
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (default ``sys.argv[1:]``) over ``--config FILE``, checked."""
    line = ddpkit.CommandLine.define(FLAGS, __doc__.split("\n")[0], NOTES)
    args = line.parse(argv)
    if args.data is None:
        line.parser.error("--data DIR is required")
    if not args.model_ema_decay < 1:
        line.parser.error(f"argument --model-ema-decay: must be < 1, got {args.model_ema_decay}")
    powersgd = (args.powersgd_rank, args.powersgd_warmup, args.no_powersgd_error_feedback or None)
    if any(o is not None for o in powersgd) and args.comm_hook != "powersgd":
        line.parser.error("--powersgd-* set PowerSGD's options: add --comm-hook powersgd")
    if args.batch_size % args.nproc_per_node:
        line.parser.error(
            f"-b {args.batch_size} is not divisible by --nproc-per-node {args.nproc_per_node}"
        )
    return args


def _rank(info: ddpkit.DistInfo, args: argparse.Namespace) -> dict[str, Any]:
    logging.basicConfig(
        level=logging.INFO if info.is_main else logging.WARNING,
        format=f"[rank {info.rank}] %(message)s",
        force=True,
    )
    return train(info, args)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with ddpkit.expected_errors(debug=args.debug):  # a mistake: one line, status 1
        if args.nproc_per_node > 1 and ddpkit.launched_by() is None:
            ddpkit.spawn(_rank, args.nproc_per_node, args=(args,))
        else:  # one process, or each of the launcher's
            with ddpkit.init_distributed() as info:
                _rank(info, args)


if __name__ == "__main__":
    main()
