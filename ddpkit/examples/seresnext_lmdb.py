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
import math
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

import ddpkit
from ddpkit.data.shapes import make_shapes_dataset
from ddpkit.data.transforms import AUTO_AUGMENTS
from ddpkit.distributed.devices import cpu_share
from ddpkit.examples.seresnext_config import (
    apply_config,
    given_on_command_line,
    refuse,
    resolved,
)
from ddpkit.examples.seresnext_setup import (
    BALANCE_POWERS,
    batch_error,
    batch_line,
    check_resume_config,
    data_record,
    load_weights,
    model_record,
    processes_from_flags,
    weights_prefix,
    workers_per_process,
)
from ddpkit.training.config import parse_trackers
from ddpkit.training.trackers import missing_extra


def _number(kind: type, least: float, strict: bool) -> Any:
    """An argparse type: a ``kind`` above (``strict``) or at least ``least``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or not (value > least if strict else value >= least):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {least:g}")
        return value

    return parse


def _steps(text: str) -> tuple[int, int]:
    """An argparse type: ``A:B``, optimizer steps A to B - 1."""
    first, _, end = text.partition(":")
    try:
        steps = (int(first), int(end))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B (two step numbers)") from None
    if not 0 <= steps[0] < steps[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= A < B")
    return steps


def _tracker_names(text: str) -> tuple[str, ...]:
    """An argparse type: ``mlflow,wandb`` or ``"mlflow, wandb"``, names of ``TRACKERS``."""
    try:
        return parse_trackers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _AllNames(argparse.Action):
    """``--log-with a,b c``: every name of every word, each once, in order."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, tuple(dict.fromkeys(n for word in values for n in word)))


def _classes(data: str | None) -> int | None:
    """The training set's classes, read from its index (None: no data there yet)."""
    if data is None:
        return None
    try:
        return len(ddpkit.LazyLMDBDataset(Path(data) / "train.lmdb").classes)
    except (OSError, ValueError):  # no database: train() names the problem
        return None


def build_parser() -> argparse.ArgumentParser:
    """The example's flags; :func:`parse_args` adds ``--config`` and the checks between flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a YAML or TOML file of flag: value (at most 1 MiB), the\n"
        "defaults of the flags (batch_size: 512); the command line wins",
    )
    p.add_argument("--data", metavar="DIR", help="directory with train.lmdb and val.lmdb")
    p.add_argument("--arch", default="legacy_seresnext101_32x4d", help="a timm model name")
    p.add_argument(
        "--pretrained", metavar="PATH", help="local weights file (nothing is downloaded)"
    )
    p.add_argument(
        "--num-classes",
        type=_number(int, 1, False),
        metavar="N",
        help="default: the training set's classes",
    )
    layers = p.add_mutually_exclusive_group()
    layers.add_argument(
        "--requires-grad", action="store_true", help="train all layers, with --pretrained too"
    )
    layers.add_argument(
        "--freeze-backbone",
        action="store_true",
        help="train only the head, as the recipe did; the default with\n"
        "--pretrained, refused without it (random features)",
    )
    p.add_argument(
        "-b",
        "--batch-size",
        type=_number(int, 1, False),
        default=256,
        metavar="N",
        help="the GLOBAL batch: the sum over all processes of all nodes,\n"
        "divided among them. NOT per node as in the PyTorch ImageNet\n"
        "example: -b 256 on 2 nodes x 4 GPUs is 32 per process, and\n"
        "256 (not 512) images per step",
    )
    p.add_argument(
        "-j",
        "--workers",
        type=_number(int, 0, False),
        metavar="N",
        help="data workers per node, divided over its processes rounded\n"
        "up (-j 4 on 8 GPUs: 1 each); default: a CPU share, at most 8",
    )
    p.add_argument(
        "--worker-start",
        choices=("fork", "forkserver", "spawn"),
        help="how data workers start (default: Python's; fork on Linux\n"
        "before 3.14). forkserver: never a copy of this multi-\n"
        "threaded process, about 2 s once per process",
    )
    p.add_argument(
        "--balance",
        choices=tuple(BALANCE_POWERS),
        default="none",
        help="draw classes as they are (none), by the square root of their\n"
        "size (sqrt) or equally often (class), with replacement",
    )
    p.add_argument(
        "--aug-repeats",
        type=_number(int, 1, False),
        default=1,
        metavar="N",
        help="each drawn image N times an epoch, on different processes,\n"
        "augmented apart (repeated augmentation; epochs N times longer)",
    )
    p.add_argument(
        "--auto-augment",
        choices=AUTO_AUGMENTS,
        help="RandAugment (rand), TrivialAugmentWide (trivial) or AugMix\n(augmix) after the crop",
    )
    p.add_argument(
        "--aug-magnitude",
        type=_number(int, 0, False),
        default=9,
        metavar="M",
        help="--auto-augment's strength: rand 0..30, M/30 of each op's\nstrongest (timm's "
        "rand-m9 is about 27; default 9), augmix's\nseverity 1..10",
    )
    p.add_argument(
        "--random-erase",
        type=_number(float, 0, False),
        default=0.0,
        metavar="P",
        help="erase a random rectangle of a crop with probability P (timm's\nreprob 0.25)",
    )
    p.add_argument("--epochs", type=_number(int, 1, False), default=90)
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--lr",
        type=_number(float, 0, True),
        default=0.1,
        help="the peak learning rate (default 0.1)",
    )
    rate.add_argument(
        "--lr-base",
        type=_number(float, 0, True),
        metavar="LR",
        help="the learning rate per 256 images, scaled by -b (linear\n"
        "scaling rule): --lr-base 0.1 -b 1024 is --lr 0.4",
    )
    p.add_argument("--momentum", type=_number(float, 0, False), default=0.9)
    p.add_argument(
        "--wd", "--weight-decay", dest="weight_decay", type=_number(float, 0, False), default=1e-4
    )
    p.add_argument(
        "--sched",
        choices=["step", "cosine"],
        default="step",
        help="after the warm-up: x0.1 at --milestones (step), or a cosine\n"
        "to 0 at the last epoch; stepped after every optimizer step",
    )
    p.add_argument(
        "--milestones",
        type=_number(int, 0, True),
        nargs="*",
        default=[30, 60],
        help="with --sched step: x0.1 at the start of these epochs",
    )
    p.add_argument(
        "--warmup-epochs",
        type=_number(float, 0, False),
        default=0.0,
        metavar="E",
        help="linear warm-up from 1%% of the rate over E epochs",
    )
    p.add_argument(
        "--model-ema",
        action="store_true",
        help="keep an exponential moving average of the weights, evaluated\n"
        "beside them each epoch; the better is the epoch's weights",
    )
    p.add_argument(
        "--model-ema-decay",
        type=_number(float, 0, True),
        default=0.9998,
        metavar="D",
        help="the average's decay per optimizer step (default 0.9998)",
    )
    p.add_argument(
        "--mixup",
        type=_number(float, 0, False),
        default=0.0,
        metavar="ALPHA",
        help="Mixup with Beta(ALPHA, ALPHA) (0: off; 0.8 is common)",
    )
    p.add_argument(
        "--cutmix",
        type=_number(float, 0, False),
        default=0.0,
        metavar="ALPHA",
        help="CutMix with Beta(ALPHA, ALPHA) (0: off; 1.0 is common); with\n"
        "--mixup each batch gets one of the two",
    )
    p.add_argument(
        "--clip-grad",
        type=_number(float, 0, True),
        metavar="NORM",
        help="clip the gradients' total norm to NORM",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (the first steps compile: slower)",
    )
    p.add_argument("--amp", choices=["bf16", "fp16"], help="mixed precision")
    p.add_argument(
        "--min-crop",
        type=_number(float, 0, True),
        default=0.08,
        metavar="AREA",
        help="RandomResizedCrop's smallest area, a share in (0, 1]",
    )
    p.add_argument("--seed", type=_number(int, 0, False), default=0)
    p.add_argument("--checkpoints", default="checkpoints", metavar="DIR")
    p.add_argument(
        "--log-dir",
        metavar="DIR",
        help="where rank 0 writes metrics.jsonl (default: --checkpoints)",
    )
    p.add_argument(
        "--log-with",
        type=_tracker_names,
        nargs="+",
        action=_AllNames,
        metavar="NAMES",
        help="trackers rank 0 logs the run to, comma-separated: tensorboard,\n"
        "mlflow, wandb (pip install 'ddpkit[mlflow]' ...); a resumed\n"
        "run continues the same tracker run",
    )
    p.add_argument(
        "--project",
        default="ddpkit",
        help="the MLflow experiment and W&B project (default ddpkit)",
    )
    p.add_argument(
        "--keep-last",
        type=_number(int, 1, False),
        default=3,
        metavar="N",
        help="per-epoch weight files kept (the best stays too)",
    )
    p.add_argument(
        "-e",
        "--evaluate",
        action="store_true",
        help="evaluate on val.lmdb and exit: the weights of --resume PATH,\n"
        "else the newest checkpoint in --checkpoints (any node's),\n"
        "else --pretrained",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="a fresh run deletes another run's files in --checkpoints\n(default: refuse)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="PATH",
        help="continue from the newest complete checkpoint (epoch, step or\n"
        "interrupted) any node holds, or from the file PATH",
    )
    p.add_argument(
        "--save-every-steps",
        type=_number(int, 0, True),
        metavar="N",
        help="a step checkpoint every N",
    )
    p.add_argument(
        "--save-every-minutes",
        type=_number(float, 0, True),
        metavar="M",
        help="a checkpoint when M minutes passed since the last",
    )
    p.add_argument(
        "--save-on-each-node",
        action="store_true",
        help="each node's first process writes its own copy too",
    )
    p.add_argument(
        "--on-data-change",
        choices=("error", "next-epoch"),
        default="error",
        help="a mid-epoch checkpoint of a training set since changed:\n"
        "refuse it (error), or start the next epoch on the new data",
    )
    p.add_argument(
        "--hang-timeout",
        type=_number(float, 0, True),
        metavar="SECONDS",
        help="a rank without progress this long: stacks logged, exit 124",
    )
    p.add_argument(
        "--profile-steps",
        type=_steps,
        metavar="A:B",
        help="record optimizer steps A to B-1 with torch.profiler into\n"
        "LOG_DIR/profile (Perfetto, TensorBoard); off by default",
    )
    p.add_argument(
        "--profile-ranks",
        type=_number(int, 0, False),
        nargs="+",
        metavar="RANK",
        help="with --profile-steps: only these ranks (default all)",
    )
    p.add_argument(
        "--max-restarts",
        type=_number(int, 0, False),
        default=0,
        metavar="N",
        help="with --multiprocessing-distributed: restart failed processes\n"
        "up to N times, resuming (torchrun: its own --max-restarts)",
    )
    p.add_argument(
        "--network", metavar="NAME", help="name prefix of the per-epoch weights (default: --arch)"
    )
    p.add_argument(
        "--image-size",
        type=_number(int, 32, False),
        default=224,
        metavar="PIXELS",
        help="the crop's side, at least 32 (the network downsamples x32)",
    )
    p.add_argument("--dist-url", help="tcp://<node 0 address>:<port>, env:// or file://")
    p.add_argument("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"])
    p.add_argument("--world-size", type=_number(int, 1, False), default=1, help="number of nodes")
    p.add_argument("--rank", type=_number(int, 0, False), default=0, help="this node's rank")
    p.add_argument(
        "--multiprocessing-distributed",
        action="store_true",
        help="one process per GPU on this node (or --nprocs CPU processes)",
    )
    p.add_argument(
        "--nprocs",
        type=_number(int, 1, False),
        metavar="N",
        help="processes per node with -m-d (CPU: required)",
    )
    p.add_argument("--gpu", type=_number(int, 0, False), help="the GPU of a one-process run")
    p.add_argument("--demo", action="store_true", help="train on generated shapes, then resume")
    p.add_argument("--out", default="demo-out", help="the demo's directory")
    p.add_argument(
        "--demo-epochs", type=_number(int, 1, False), default=7, help="then one more, resumed"
    )
    p.add_argument(
        "--demo-classes", type=_number(int, 2, False), default=6, help="colour x shape classes"
    )
    p.add_argument(
        "--demo-per-class",
        type=_number(int, 1, False),
        default=250,
        help="training images per class",
    )
    p.add_argument(
        "--demo-recipe",
        choices=["modern", "classic"],
        default="modern",
        help="modern: 1 warm-up epoch, cosine, EMA; classic: x0.1 for the last\n"
        "epoch, as the recipe",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_with_config(p, argv)
    if args.data is None and not args.demo:
        p.error("--data DIR is required (or --demo)")
    if args.max_restarts and not args.multiprocessing_distributed:
        p.error(
            "--max-restarts restarts the processes --multiprocessing-distributed starts; "
            "under torchrun use torchrun's own --max-restarts"
        )
    if args.gpu is not None and args.multiprocessing_distributed:
        p.error(
            "--gpu picks the GPU of a one-process run; with --multiprocessing-distributed "
            "each process takes the GPU of its local rank: drop --gpu"
        )
    if args.multiprocessing_distributed and args.nprocs is None and torch.cuda.device_count() == 0:
        p.error(
            "--multiprocessing-distributed starts one process per GPU and no GPU is "
            "visible: pass --nprocs N to run N CPU processes with Gloo"
        )
    if args.freeze_backbone and args.pretrained is None:
        p.error(
            "--freeze-backbone trains only the head on the backbone's features, which are "
            "random without --pretrained PATH: pass the weights, or drop --freeze-backbone "
            "to train all layers"
        )
    if args.network is not None and (not args.network or "/" in args.network):
        p.error(f"--network is the start of a file name, without '/': got {args.network!r}")
    missing = [m for m in map(missing_extra, args.log_with or ()) if m is not None]
    if missing:
        p.error(f"argument --log-with: {'; '.join(missing)}")
    if args.evaluate and args.demo:
        p.error("--evaluate measures a checkpoint of --data; --demo trains its own: pick one")
    if args.min_crop > 1:
        p.error(
            f"argument --min-crop: must be <= 1 (a share of the image's area), got "
            f"{args.min_crop:g}"
        )
    if args.rank >= args.world_size:
        p.error(f"argument --rank: must be below --world-size {args.world_size}, got {args.rank}")
    if args.mixup or args.cutmix:
        flag = "--mixup" if args.mixup else "--cutmix"
        classes = args.num_classes or (args.demo_classes if args.demo else _classes(args.data))
        if classes is not None and classes < 2:
            p.error(
                f"argument {flag}: mixes the targets of two classes and the model has "
                f"{classes}: pass --num-classes N >= 2 or data with two classes or more, or "
                f"drop {flag}"
            )
    if args.random_erase > 1:
        p.error(f"argument --random-erase: a probability, at most 1, got {args.random_erase:g}")
    if args.auto_augment is not None:
        low, high = (1, 10) if args.auto_augment == "augmix" else (0, 30)
        if not low <= args.aug_magnitude <= high:
            p.error(
                f"argument --aug-magnitude: --auto-augment {args.auto_augment} takes "
                f"{low}..{high}, got {args.aug_magnitude}"
            )
    if not 0 < args.model_ema_decay < 1:
        p.error(f"--model-ema-decay must lie between 0 and 1, got {args.model_ema_decay}")
    processes = processes_from_flags(args, torch.cuda.device_count())
    error = batch_error(args.batch_size, processes or 1) if not args.demo else None
    if error is not None:
        p.error(error)
    if args.warmup_epochs >= args.epochs and not args.demo:
        p.error(f"--warmup-epochs {args.warmup_epochs:g} leaves nothing of --epochs {args.epochs}")
    return args


def _parse_with_config(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` over ``--config FILE`` over the defaults; ``args._sources`` says which gave what."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config")
    named = first.parse_known_args(argv)[0].config
    builtin = {a.dest: a.default for a in p._actions}
    sources = apply_config(p, named) if named is not None else {}
    given = given_on_command_line(p, argv)
    for group in p._mutually_exclusive_groups:
        dests = {a.dest for a in group._group_actions}
        # A switch the file leaves off (requires_grad: false) excludes nothing, as on the
        # command line, where it is not given.
        switches = {a.dest for a in group._group_actions if a.nargs == 0}
        from_file = {
            d for d in dests & set(sources) if d not in switches or p.get_default(d) != builtin[d]
        }
        if dests & given:  # --lr on the command line drops the file's --lr-base
            p.set_defaults(**{d: builtin[d] for d in from_file - given})
            for d in from_file - given:
                del sources[d]
        elif len(from_file) > 1:
            flags = " and ".join(f"--{d.replace('_', '-')}" for d in sorted(from_file))
            refuse(p, f"--config {named}: sets {flags}, which exclude each other: keep one")
    args = p.parse_args(argv)
    args._sources = {**sources, **dict.fromkeys(given, "command line")}
    return args


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


def build_model(args: argparse.Namespace, num_classes: int) -> nn.Module:
    """The model to train; ``--evaluate`` loads its weights later (``load_for_evaluation``)."""
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
    prefix = weights_prefix(args)
    checkpoints = ddpkit.CheckpointManager(args.checkpoints, prefix=prefix, extra=record)
    with warnings.catch_warnings():
        # Evaluation draws no random numbers: RNG states saved by another
        # number of ranks do not matter here.
        warnings.filterwarnings("ignore", ".*RNG state", RuntimeWarning)
        checkpoints.resume(model, strict_rng=False)
    if checkpoints.position is not None:
        return str(checkpoints.resumed_from or f"the newest checkpoint in {args.checkpoints}")
    if args.pretrained:
        load_weights(model, args.pretrained, "--pretrained")
        return str(args.pretrained)
    raise ddpkit.CheckpointError(
        f"--evaluate: no checkpoint in {args.checkpoints} on any node and no --pretrained; "
        "pass the training run's --checkpoints DIR, --resume PATH or --pretrained PATH"
    )


def train(info: ddpkit.DistInfo, args: argparse.Namespace) -> dict[str, Any]:
    """One process's whole run; every rank calls it.

    Returns the last epoch's record, or with ``--evaluate`` the metrics.
    """
    logging.basicConfig(
        level=logging.INFO if info.is_main else logging.WARNING,
        format=f"[rank {info.rank}] %(asctime)s %(message)s",
        force=True,
    )
    error = batch_error(args.batch_size, info.world_size)
    if error is not None:  # before any data or model is built; rank 0 says why
        if info.is_main:
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
    if info.device.type == "cpu":  # share the cores instead of oversubscribing them
        torch.set_num_threads(cpu_share(info.local_world_size))
    torch.manual_seed(args.seed)
    size, data = args.image_size, Path(args.data)
    train_tf = ddpkit.train_transform(
        size,
        scale=(args.min_crop, 1.0),
        auto_augment=args.auto_augment,
        magnitude=args.aug_magnitude,
        random_erase=args.random_erase,
    )
    train_set = ddpkit.LazyLMDBDataset(data / "train.lmdb", transform=train_tf)
    val_tf = ddpkit.val_transform(size, round(size * 256 / 224))
    val_set = ddpkit.LazyLMDBDataset(data / "val.lmdb", transform=val_tf)
    classes = args.num_classes or len(train_set.classes)
    workers = workers_per_process(args.workers, info.local_world_size)
    kw: dict[str, Any] = {
        "workers": workers,
        "seed": args.seed,
        "info": info,
        "multiprocessing_context": args.worker_start,
    }
    val_batch = max(1, args.batch_size // info.world_size)
    val_loader = ddpkit.build_loader(val_set, batch_size=val_batch, train=False, **kw)
    criterion = ddpkit.FocalLoss(alpha=0.25, gamma=2, num_class=classes, smooth=0.1)
    record = model_record(args, classes)
    run_config = resolved(args, getattr(args, "_sources", {}))
    if args.evaluate:
        model = build_model(args, classes)
        return evaluate_only(info, args, model, val_loader, criterion, record)
    net = build_model(args, classes)
    cuda = info.device.type == "cuda"
    if cuda:  # the recipe's setting: cuDNN picks the fastest kernels for fixed input sizes
        torch.backends.cudnn.benchmark = True
        net = net.to(memory_format=torch.channels_last)  # with channels_last batches, below
    model = ddpkit.wrap_ddp(net, device=info.device)
    ema = ddpkit.model_ema(model, decay=args.model_ema_decay) if args.model_ema else None
    if args.compile:
        model = torch.compile(model)  # type: ignore[assignment]

    train_loader = ddpkit.build_loader(
        train_set,
        global_batch_size=args.batch_size,
        train=True,
        balance=BALANCE_POWERS[args.balance],
        repeats=args.aug_repeats,
        **kw,
    )
    logging.info(
        batch_line(
            args.batch_size, info.world_size, train_loader.batch_size or 0, train_loader.num_workers
        )
    )
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr if args.lr_base is None else ddpkit.linear_scaled_lr(args.lr_base, args.batch_size)
    optimizer = torch.optim.SGD(
        params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = ddpkit.warmup_schedule(
        optimizer,
        epochs=getattr(args, "schedule_epochs", None) or args.epochs,
        steps_per_epoch=len(train_loader),
        warmup_epochs=args.warmup_epochs,
        decay=args.sched,
        milestones=args.milestones if args.sched == "step" else (),
    )
    mix = None
    if args.mixup or args.cutmix:
        mix = ddpkit.mixup_cutmix(classes, mixup_alpha=args.mixup, cutmix_alpha=args.cutmix)
    config = ddpkit.TrainConfig(
        amp=args.amp, clip_grad_norm=args.clip_grad, batch_transform=mix, channels_last=cuda
    )
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
    # A restarted process (torchrun --max-restarts, --max-restarts) continues the run.
    resume = args.resume or info.restart_count > 0
    if resume is True:  # a named file may be of another run: its own flags are not compared
        check_resume_config(args.checkpoints, run_config)
    history = ddpkit.fit(
        model,
        train_loader,
        optimizer,
        criterion=criterion,
        epochs=args.epochs,
        val_loader=val_loader,
        scheduler=scheduler,
        ema=ema,
        config=config,
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train with ``spawn`` (-m-d) or ``init_distributed``; returns this node's first record."""
    if args.multiprocessing_distributed:
        records: list[dict[str, Any]] = ddpkit.spawn(
            train,
            args.nprocs,
            args=(args,),
            nnodes=args.world_size,
            node_rank=args.rank,
            init_method=args.dist_url,
            backend=args.dist_backend,
            max_restarts=args.max_restarts,
        )
        return records[0]
    with ddpkit.init_distributed(**init_arguments(args)) as info:
        return train(info, args)


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
    dirs = make_shapes_dataset(out / "shapes", classes=args.demo_classes, **sizes)
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
        # The schedule spans both jobs: the first stops after 7 of its 8 epochs.
        "schedule_epochs": args.demo_epochs + 1,
        **_DEMO_RECIPES[args.demo_recipe],
        "checkpoints": str(out / "checkpoints"),
        "multiprocessing_distributed": True,
        "nprocs": nprocs,
        "world_size": 1,
        "rank": 0,
        "dist_url": None,
    }
    sources = {**getattr(args, "_sources", {}), **dict.fromkeys(settings, "demo")}
    first = argparse.Namespace(**{**vars(args), **settings, "_sources": sources})
    run(first)
    # A second job continues from latest.pth for one more epoch: resume works.
    record = run(argparse.Namespace(**{**vars(first), "epochs": first.epochs + 1, "resume": True}))
    seconds, where = time.perf_counter() - start, f"{gpus} GPU" if gpus else "2 CPU"
    ema = f" (EMA {record['val_ema_acc1']:.2f}%)" if "val_ema_acc1" in record else ""
    print(
        f"demo: final val acc1 {record['val_acc1']:.2f}%{ema} after {first.epochs + 1} epochs, "
        f"total wall time {seconds:.1f} s ({where} processes)"
    )
    return record


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.demo:
        demo(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
