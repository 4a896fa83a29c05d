"""The SE-ResNeXt example's flags, declared once in :data:`FLAGS`, and the checks between them.

A wrong value is argparse's ``error:`` line and exit status 2, before anything is built.
"""

# ruff: noqa: SIM905 - lists of flag names read best as one line of text
from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import ddpkit

__all__ = ["BALANCE_POWERS", "FLAGS", "batch_error", "parse_args", "warn_changed_settings"]


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


class _Trackers(argparse.Action):
    """``--log-with a,b c``: every tracker name of every word, each once, in order."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        try:
            names = [name for word in values for name in ddpkit.parse_trackers(word)]
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, tuple(dict.fromkeys(names)))


# --balance: the power of the class sizes the draws follow (None: the plain shuffle).
BALANCE_POWERS: dict[str, float | None] = {"none": None, "sqrt": 0.5, "class": 1.0}
_f, _number = ddpkit.CommandLine.flag, ddpkit.CommandLine.number
INT0, INT1, FLOAT0 = _number(int, 0), _number(int, 1), _number(float, 0)
POSITIVE, EPOCH = _number(float, 0, strict=True), _number(int, 0, strict=True)
SHARE, ODDS = _number(float, 0, strict=True, most=1), _number(float, 0, most=1)


# Every flag in --help's order: its names and add_argument's keywords (one_of: the group of flags
# it excludes). NOTES, after the list in --help, says more of some.
FLAGS = (
    _f("--config", metavar="FILE", help="a YAML or TOML file of the flags' defaults (below)"),
    _f("--data", metavar="DIR", help="directory with train.lmdb and val.lmdb"),
    _f("--arch", default="legacy_seresnext101_32x4d", help="a timm model name"),
    _f("--pretrained", metavar="PATH", help="local weights file (nothing is downloaded)"),
    _f("--num-classes", type=INT1, metavar="N", help="default: the training set's classes"),
    _f("--requires-grad", action="store_true", one_of="layers", help="train all layers"),
    _f("--freeze-backbone", action="store_true", one_of="layers", help="train only the head"),
    _f("-b", "--batch-size", type=INT1, default=256, metavar="N", help="the GLOBAL batch (below)"),
    _f("-j", "--workers", type=INT0, metavar="N", help="data workers per node (below)"),
    _f("--decode", choices=("tensor", "cuda"), default="tensor", help="where images decode"),
    _f("--worker-start", choices=("fork", "forkserver", "spawn"), help="how data workers start"),
    _f("--balance", choices=tuple(BALANCE_POWERS), default="none", help="how classes are drawn"),
    _f("--aug-repeats", type=INT1, default=1, metavar="N", help="each drawn image N times (below)"),
    _f("--auto-augment", choices=ddpkit.AUTO_AUGMENTS, help="RandAugment, TrivialAugment, AugMix"),
    _f("--aug-magnitude", type=INT0, default=9, metavar="M", help="rand: 0..30; augmix: 1..10"),
    _f("--random-erase", type=ODDS, default=0.0, metavar="P", help="Random Erasing odds"),
    _f("--epochs", type=INT1, default=90),
    _f("--lr", type=POSITIVE, default=0.1, one_of="rate", help="the peak learning rate"),
    _f("--lr-base", type=POSITIVE, metavar="LR", one_of="rate", help="--lr per 256 images (below)"),
    _f("--momentum", type=FLOAT0, default=0.9),
    _f("--wd", "--weight-decay", dest="weight_decay", type=FLOAT0, default=1e-4),
    _f("--sched", choices=["step", "cosine"], default="step", help="after the warm-up (below)"),
    _f("--milestones", type=EPOCH, nargs="*", default=[30, 60], help="with step: x0.1 at these"),
    _f("--warmup-epochs", type=FLOAT0, default=0.0, metavar="E", help="warm-up from 1%% of --lr"),
    _f("--model-ema", action="store_true", help="evaluate a moving average of the weights too"),
    _f("--model-ema-decay", type=POSITIVE, default=0.9998, metavar="D", help="its decay per step"),
    _f("--mixup", type=FLOAT0, default=0.0, metavar="ALPHA", help="Beta(ALPHA, ALPHA); 0: off"),
    _f("--cutmix", type=FLOAT0, default=0.0, metavar="ALPHA", help="Beta(ALPHA, ALPHA); 0: off"),
    _f("--grad-accum-steps", type=INT1, default=1, metavar="N", help="micro-batches per step"),
    _f("--clip-grad", type=POSITIVE, metavar="NORM", help="clip the gradients' total norm"),
    _f("--compile", action="store_true", help="torch.compile the model"),
    _f("--amp", choices=["bf16", "fp16"], help="mixed precision"),
    _f("--comm-hook", choices=["bf16", "fp16", "powersgd"], help="compress gradients (below)"),
    _f("--powersgd-rank", type=INT1, metavar="R", help="PowerSGD's rank (default 1)"),
    _f("--powersgd-warmup", type=_number(int, 2), metavar="STEPS", help="default 1000 (below)"),
    _f("--no-powersgd-error-feedback", action="store_true", help="PowerSGD without it"),
    _f("--min-crop", type=SHARE, default=0.08, metavar="AREA", help="the crop's least area"),
    _f("--seed", type=INT0, default=0),
    _f("--checkpoints", default="checkpoints", metavar="DIR|URL", help="or s3://bucket/prefix"),
    _f(
        "--log-dir",
        metavar="DIR",
        help="where rank 0 writes metrics.jsonl (default: --checkpoints, or its local side)",
    ),
    _f("--log-with", nargs="+", action=_Trackers, metavar="NAMES", help="trackers (below)"),
    _f("--project", default="ddpkit", help="the MLflow experiment and W&B project"),
    _f("--keep-last", type=INT1, default=3, metavar="N", help="weight files kept, and the best"),
    _f("-e", "--evaluate", action="store_true", help="evaluate on val.lmdb and exit (below)"),
    _f("--overwrite", action="store_true", help="a fresh run deletes another run's files"),
    _f("--resume", nargs="?", const=True, default=False, metavar="PATH", help="continue (below)"),
    _f("--save-every-steps", type=_number(int, 0, True), metavar="N", help="a checkpoint every N"),
    _f("--save-every-minutes", type=POSITIVE, metavar="M", help="a checkpoint every M minutes"),
    _f("--save-on-each-node", action="store_true", help="each node's first process saves too"),
    _f("--on-data-change", choices=("error", "next-epoch"), default="error", help="(below)"),
    _f("--hang-timeout", type=POSITIVE, metavar="SECONDS", help="a rank stuck this long: exit 124"),
    _f("--profile-steps", type=_steps, metavar="A:B", help="profile steps A to B-1 (below)"),
    _f("--profile-ranks", type=INT0, nargs="+", metavar="RANK", help="only these (default all)"),
    _f("--max-restarts", type=INT0, default=0, metavar="N", help="with -m-d: restart, resuming"),
    _f("--network", metavar="NAME", help="the per-epoch weights' name prefix (default: --arch)"),
    _f(
        "--image-size", type=_number(int, 32), default=224, metavar="PIXELS", help="the crop's side"
    ),
    _f("--dist-url", help="tcp://<node 0 address>:<port>, env:// or file://"),
    _f("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"]),
    _f("--world-size", type=INT1, default=1, help="number of nodes"),
    _f("--rank", type=INT0, default=0, help="this node's rank"),
    _f("--multiprocessing-distributed", action="store_true", help="one process per GPU (-m-d)"),
    _f("--nprocs", type=INT1, metavar="N", help="processes per node with -m-d (CPU: required)"),
    _f("--gpu", type=INT0, help="the GPU of a one-process run"),
    _f("--demo", action="store_true", help="train on generated shapes, then resume"),
    _f("--debug", action="store_true", help="show an error's traceback (also DDPKIT_DEBUG=1)"),
    _f("--out", default="demo-out", help="the demo's directory"),
    _f("--demo-epochs", type=INT1, default=7, help="then one more, resumed"),
    _f("--demo-classes", type=_number(int, 2), default=6, help="colour x shape classes"),
    _f("--demo-per-class", type=INT1, default=250, help="training images per class"),
    _f("--demo-recipe", choices=["modern", "classic"], default="modern", help="(below)"),
)
NOTES = """\
-b is the GLOBAL batch: the sum over all processes of all nodes, divided among them,
  NOT per node as in the PyTorch ImageNet example: -b 256 on 2 nodes x 4 GPUs is 32 per
  process and 256 images per step (x --grad-accum-steps per optimizer step).
-j is per node, divided over its processes rounded up (-j 4 on 8 GPUs: 1 each); default: a
  CPU share, at most 8. --worker-start forkserver never copies this multi-threaded process.
--decode tensor decodes in the data workers (CPU); cuda a batch at a time on the GPU (nvJPEG).
--balance: none (classes as they are), sqrt (by the root of their size), class (equally).
--aug-repeats N: each image N times an epoch on different processes, augmented apart.
--lr-base LR: the rate per 256 images, scaled by -b: --lr-base 0.1 -b 1024 is --lr 0.4.
--sched step: x0.1 at --milestones; cosine: to 0 at the last epoch; stepped every step.
--freeze-backbone is the default with --pretrained, and refused without it.
--log-with: tensorboard, mlflow, wandb, comma-separated (pip install 'ddpkit[mlflow]' ...);
  a resumed run continues the same tracker run.
--evaluate measures the weights of --resume PATH, else the newest checkpoint any node holds
  in --checkpoints, else --pretrained. --resume alone continues from the newest complete
  checkpoint (epoch, step or interrupted) any node holds.
--on-data-change: a mid-epoch checkpoint of a changed training set is refused (error), or
  the next epoch starts on the new data (next-epoch).
--comm-hook: what each step's all-reduce sends: bf16 / fp16 (half the bytes) or powersgd
  (a low-rank approximation, after --powersgd-warmup steps of plain all-reduce); each
  rank's PowerSGD state is in every checkpoint. Pays on slow links (docs/training.md).
--profile-steps A:B records optimizer steps A to B-1 with torch.profiler in LOG_DIR/profile.
--demo-recipe modern: a warm-up epoch, cosine, EMA; classic: x0.1 for the last epoch.
--config FILE: YAML or TOML, flag: value (batch_size: 512), at most 1 MiB; the command
  line wins, and every run records where each value came from.
"""


def parse_args(
    argv: Sequence[str] | None = None, description: str | None = None
) -> argparse.Namespace:
    """The flags of ``argv`` (default ``sys.argv[1:]``) and ``--config FILE``, checked.

    ``args.sources`` names the flags the file or the command line set. A value or
    a combination the example cannot train with ends the program: exit status 2.
    """
    flags = ddpkit.CommandLine.define(FLAGS, description, NOTES)
    args = flags.parse(argv)
    _check(flags.parser, args)
    return args


def batch_error(global_batch: int, processes: int) -> str | None:
    """Why ``-b global_batch`` cannot be shared equally by ``processes``, with the nearest ones."""
    if processes <= 1 or global_batch % processes == 0:
        return None
    low = global_batch // processes * processes
    choices = f"-b {low} or -b {low + processes}" if low else f"-b {processes}"
    return (
        f"-b {global_batch} is not divisible by {processes} processes (-b is the global batch, "
        f"shared equally among them): use {choices}"
    )


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks between flags, and of what only the data tell; ``p.error`` at the first."""
    mpd, gpus = args.multiprocessing_distributed, torch.cuda.device_count()
    if args.data is None and not args.demo:
        p.error("--data DIR is required (or --demo)")
    if args.max_restarts and not mpd:
        p.error("--max-restarts restarts what -m-d starts; under torchrun use its --max-restarts")
    if args.gpu is not None and mpd:
        p.error(
            "--gpu is a one-process run's GPU; with -m-d each takes its local rank's: drop --gpu"
        )
    if mpd and args.nprocs is None and gpus == 0:
        p.error("-m-d starts a process per GPU and none is visible: pass --nprocs N (CPU, Gloo)")
    if args.decode == "cuda" and not torch.cuda.is_available():
        p.error("--decode cuda decodes on the GPU and there is no CUDA device: use --decode tensor")
    if args.decode == "cuda" and (args.auto_augment is not None or args.random_erase):
        p.error(
            "--decode cuda crops, flips and resizes on the GPU; --auto-augment and "
            "--random-erase run in the workers on decoded images: use --decode tensor"
        )
    if args.freeze_backbone and args.pretrained is None:
        p.error(
            "--freeze-backbone trains only the head on the backbone's features, which are "
            "random without --pretrained PATH: pass the weights, or drop --freeze-backbone"
        )
    if args.network is not None and (not args.network or "/" in args.network):
        p.error(f"--network is the start of a file name, without '/': got {args.network!r}")
    missing = [m for m in map(ddpkit.missing_extra, args.log_with or ()) if m is not None]
    if missing:
        p.error(f"argument --log-with: {'; '.join(missing)}")
    if args.evaluate and args.demo:
        p.error("--evaluate measures a checkpoint of --data; --demo trains its own: pick one")
    if args.rank >= args.world_size:
        p.error(f"argument --rank: must be below --world-size {args.world_size}, got {args.rank}")
    flag = "--mixup" if args.mixup else "--cutmix"
    if args.mixup or args.cutmix:
        classes = args.num_classes or (args.demo_classes if args.demo else _classes(args.data))
        if classes is not None and classes < 2:
            p.error(
                f"argument {flag}: mixes the targets of two classes and the model has "
                f"{classes}: pass --num-classes N >= 2 or data of two classes or more"
            )
    low, high = (1, 10) if args.auto_augment == "augmix" else (0, 30)
    if args.auto_augment is not None and not low <= args.aug_magnitude <= high:
        p.error(
            f"argument --aug-magnitude: --auto-augment {args.auto_augment} takes "
            f"{low}..{high}, got {args.aug_magnitude}"
        )
    powersgd = [f for f in ("rank", "warmup") if getattr(args, f"powersgd_{f}") is not None]
    powersgd += ["no-error-feedback"] if args.no_powersgd_error_feedback else []
    if powersgd and args.comm_hook != "powersgd":
        p.error(f"--powersgd-{powersgd[0]} sets PowerSGD's options: add --comm-hook powersgd")
    if not 0 < args.model_ema_decay < 1:
        p.error(f"--model-ema-decay must lie between 0 and 1, got {args.model_ema_decay}")
    processes = (args.nprocs or gpus) * args.world_size if mpd else args.world_size
    error = batch_error(args.batch_size, processes or 1) if not args.demo else None
    if error is not None:
        p.error(error)
    if args.warmup_epochs >= args.epochs and not args.demo:
        p.error(f"--warmup-epochs {args.warmup_epochs:g} leaves nothing of --epochs {args.epochs}")


def _classes(data: str | None) -> int | None:
    """The training set's classes, read from its index (None: no data there yet)."""
    try:
        return len(ddpkit.LazyLMDBDataset(Path(data or "") / "train.lmdb").classes)
    except (OSError, ValueError):  # no database: train() names the problem
        return None


# Changed on --resume, these train the rest differently, which may be meant: a warning.
CHANGES_RESUME = (
    "min_crop mixup cutmix lr lr_base momentum weight_decay sched milestones warmup_epochs amp "
    "grad_accum_steps clip_grad model_ema model_ema_decay"
).split()


def warn_changed_settings(checkpoints: ddpkit.CheckpointManager, now: dict[str, Any]) -> None:
    """Warn on rank 0 when a setting of :data:`CHANGES_RESUME` differs from the one the
    checkpoint a resume takes recorded (``ddpkit.CommandLine.resolved``). All ranks call this."""
    name, saved = checkpoints.newest_extra() or ("latest.pth", {})
    was: dict[str, Any] = saved.get("config") or {}
    changed = [
        f"--{key.replace('_', '-')} {was[key]['value']} -> {now[key]['value']}"
        for key in CHANGES_RESUME
        if key in was and key in now and was[key]["value"] != now[key]["value"]
    ]
    if changed and ddpkit.get_rank() == 0:
        warnings.warn(
            f"--resume: settings changed since {checkpoints.location}/{name} "
            f"({', '.join(changed)}); the rest of the run trains with the new ones, so it is not "
            "the uninterrupted run",
            RuntimeWarning,
            stacklevel=2,
        )
