"""The SE-ResNeXt example's flags and the checks between them.

:func:`parse_args` reads the example's command line: ``argv`` over ``--config
FILE`` over the built-in defaults (``seresnext_config``), then every check one
flag's type cannot make (``--rank`` below ``--world-size``, a ``-b`` the
processes can share, ``--freeze-backbone`` only with ``--pretrained`` ...).
A wrong value or combination is argparse's ``error:`` line and exit status 2,
before a dataset or a model is built. ``--help`` lists the flags (:func:`define`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

import ddpkit
from ddpkit.examples.seresnext_config import Flags, parse_with_config
from ddpkit.examples.seresnext_setup import BALANCE_POWERS, batch_error, processes_from_flags

__all__ = ["build_parser", "define", "parse_args"]


def parse_args(
    argv: Sequence[str] | None = None, description: str | None = None
) -> argparse.Namespace:
    """The flags of ``argv`` (default: ``sys.argv[1:]``) and ``--config FILE``, checked.

    The namespace holds every flag's value and ``sources``, the flags the file
    or the command line set (:func:`~ddpkit.examples.seresnext_config.parse_with_config`).
    ``description`` opens ``--help``. A value or a combination the example
    cannot train with ends the program: ``error: ...`` on stderr, exit status 2.
    """
    flags = define(description)
    args = parse_with_config(flags, list(sys.argv[1:] if argv is None else argv))
    _check(flags.parser, args)
    return args


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The parser of the example's flags, without ``--config`` files or the checks between flags."""
    return define(description).parser


def define(description: str | None = None) -> Flags:
    """The example's flags on a new parser, and what the config code needs to know of them."""
    # Run with `python -m`, the script's file name is not what was typed: say the module.
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None and spec.name else None
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    flags = _Adder(parser)
    _add_flags(flags)
    # The same flags without defaults: a flag argv does not give is absent from what it parses.
    bare = _Raising(add_help=False, argument_default=argparse.SUPPRESS, exit_on_error=False)
    _add_flags(_Adder(bare, defaults=False))
    exclusive = tuple(tuple(group) for group in flags.exclusive)
    return Flags(parser=parser, actions=tuple(flags.actions), exclusive=exclusive, bare=bare)


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks between flags, and of values only the data tell; ``p.error`` at the first."""
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
    if args.decode == "cuda":
        if not torch.cuda.is_available():
            p.error(
                "--decode cuda decodes each batch on the GPU (TorchCodec's CUDA JPEG decoder, "
                "nvJPEG) and this machine has no CUDA device (torch.cuda.is_available() is "
                "False): drop it, or use --decode tensor (the workers decode on the CPU)"
            )
        if args.auto_augment is not None or args.random_erase:
            p.error(
                "--decode cuda crops, flips and resizes on the GPU; --auto-augment and "
                "--random-erase run in the workers on decoded images: use --decode tensor "
                "with them"
            )
    if args.freeze_backbone and args.pretrained is None:
        p.error(
            "--freeze-backbone trains only the head on the backbone's features, which are "
            "random without --pretrained PATH: pass the weights, or drop --freeze-backbone "
            "to train all layers"
        )
    if args.network is not None and (not args.network or "/" in args.network):
        p.error(f"--network is the start of a file name, without '/': got {args.network!r}")
    missing = [m for m in map(ddpkit.missing_extra, args.log_with or ()) if m is not None]
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


def _add_flags(flag: _Adder) -> None:
    """Every flag of the example, in ``--help``'s order."""
    flag(
        "--config",
        metavar="FILE",
        help="a YAML or TOML file of flag: value (at most 1 MiB), the\n"
        "defaults of the flags (batch_size: 512); the command line wins",
    )
    flag("--data", metavar="DIR", help="directory with train.lmdb and val.lmdb")
    flag("--arch", default="legacy_seresnext101_32x4d", help="a timm model name")
    flag("--pretrained", metavar="PATH", help="local weights file (nothing is downloaded)")
    flag(
        "--num-classes",
        type=_number(int, 1, False),
        metavar="N",
        help="default: the training set's classes",
    )
    layer = flag.one_of()
    layer("--requires-grad", action="store_true", help="train all layers, with --pretrained too")
    layer(
        "--freeze-backbone",
        action="store_true",
        help="train only the head, as the recipe did; the default with\n"
        "--pretrained, refused without it (random features)",
    )
    flag(
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
    flag(
        "-j",
        "--workers",
        type=_number(int, 0, False),
        metavar="N",
        help="data workers per node, divided over its processes rounded\n"
        "up (-j 4 on 8 GPUs: 1 each); default: a CPU share, at most 8",
    )
    flag(
        "--decode",
        choices=("tensor", "cuda"),
        default="tensor",
        help="where images decode: tensor (in the data workers, on the\n"
        "CPU) or cuda (a batch at a time on the GPU, nvJPEG; the\n"
        "workers only read bytes and draw the crops)",
    )
    flag(
        "--worker-start",
        choices=("fork", "forkserver", "spawn"),
        help="how data workers start (default: Python's; fork on Linux\n"
        "before 3.14). forkserver: never a copy of this multi-\n"
        "threaded process, about 2 s once per process",
    )
    flag(
        "--balance",
        choices=tuple(BALANCE_POWERS),
        default="none",
        help="draw classes as they are (none), by the square root of their\n"
        "size (sqrt) or equally often (class), with replacement",
    )
    flag(
        "--aug-repeats",
        type=_number(int, 1, False),
        default=1,
        metavar="N",
        help="each drawn image N times an epoch, on different processes,\n"
        "augmented apart (repeated augmentation; epochs N times longer)",
    )
    flag(
        "--auto-augment",
        choices=ddpkit.AUTO_AUGMENTS,
        help="RandAugment (rand), TrivialAugmentWide (trivial) or AugMix\n(augmix) after the crop",
    )
    flag(
        "--aug-magnitude",
        type=_number(int, 0, False),
        default=9,
        metavar="M",
        help="--auto-augment's strength: rand 0..30, M/30 of each op's\nstrongest (timm's "
        "rand-m9 is about 27; default 9), augmix's\nseverity 1..10",
    )
    flag(
        "--random-erase",
        type=_number(float, 0, False),
        default=0.0,
        metavar="P",
        help="erase a random rectangle of a crop with probability P (timm's\nreprob 0.25)",
    )
    flag("--epochs", type=_number(int, 1, False), default=90)
    rate = flag.one_of()
    rate(
        "--lr",
        type=_number(float, 0, True),
        default=0.1,
        help="the peak learning rate (default 0.1)",
    )
    rate(
        "--lr-base",
        type=_number(float, 0, True),
        metavar="LR",
        help="the learning rate per 256 images, scaled by -b (linear\n"
        "scaling rule): --lr-base 0.1 -b 1024 is --lr 0.4",
    )
    flag("--momentum", type=_number(float, 0, False), default=0.9)
    flag("--wd", "--weight-decay", dest="weight_decay", type=_number(float, 0, False), default=1e-4)
    flag(
        "--sched",
        choices=["step", "cosine"],
        default="step",
        help="after the warm-up: x0.1 at --milestones (step), or a cosine\n"
        "to 0 at the last epoch; stepped after every optimizer step",
    )
    flag(
        "--milestones",
        type=_number(int, 0, True),
        nargs="*",
        default=[30, 60],
        help="with --sched step: x0.1 at the start of these epochs",
    )
    flag(
        "--warmup-epochs",
        type=_number(float, 0, False),
        default=0.0,
        metavar="E",
        help="linear warm-up from 1%% of the rate over E epochs",
    )
    flag(
        "--model-ema",
        action="store_true",
        help="keep an exponential moving average of the weights, evaluated\n"
        "beside them each epoch; the better is the epoch's weights",
    )
    flag(
        "--model-ema-decay",
        type=_number(float, 0, True),
        default=0.9998,
        metavar="D",
        help="the average's decay per optimizer step (default 0.9998)",
    )
    flag(
        "--mixup",
        type=_number(float, 0, False),
        default=0.0,
        metavar="ALPHA",
        help="Mixup with Beta(ALPHA, ALPHA) (0: off; 0.8 is common)",
    )
    flag(
        "--cutmix",
        type=_number(float, 0, False),
        default=0.0,
        metavar="ALPHA",
        help="CutMix with Beta(ALPHA, ALPHA) (0: off; 1.0 is common); with\n"
        "--mixup each batch gets one of the two",
    )
    flag(
        "--grad-accum-steps",
        type=_number(int, 1, False),
        default=1,
        metavar="N",
        help="micro-batches per optimizer step: a step's batch is -b x N\n"
        "(all-reduced once per step)",
    )
    flag(
        "--clip-grad",
        type=_number(float, 0, True),
        metavar="NORM",
        help="clip the gradients' total norm to NORM",
    )
    flag(
        "--compile",
        action="store_true",
        help="torch.compile the model (the first steps compile: slower)",
    )
    flag("--amp", choices=["bf16", "fp16"], help="mixed precision")
    flag(
        "--min-crop",
        type=_number(float, 0, True),
        default=0.08,
        metavar="AREA",
        help="RandomResizedCrop's smallest area, a share in (0, 1]",
    )
    flag("--seed", type=_number(int, 0, False), default=0)
    flag("--checkpoints", default="checkpoints", metavar="DIR")
    flag(
        "--log-dir",
        metavar="DIR",
        help="where rank 0 writes metrics.jsonl (default: --checkpoints)",
    )
    flag(
        "--log-with",
        type=_tracker_names,
        nargs="+",
        action=_AllNames,
        metavar="NAMES",
        help="trackers rank 0 logs the run to, comma-separated: tensorboard,\n"
        "mlflow, wandb (pip install 'ddpkit[mlflow]' ...); a resumed\n"
        "run continues the same tracker run",
    )
    flag(
        "--project",
        default="ddpkit",
        help="the MLflow experiment and W&B project (default ddpkit)",
    )
    flag(
        "--keep-last",
        type=_number(int, 1, False),
        default=3,
        metavar="N",
        help="per-epoch weight files kept (the best stays too)",
    )
    flag(
        "-e",
        "--evaluate",
        action="store_true",
        help="evaluate on val.lmdb and exit: the weights of --resume PATH,\n"
        "else the newest checkpoint in --checkpoints (any node's),\n"
        "else --pretrained",
    )
    flag(
        "--overwrite",
        action="store_true",
        help="a fresh run deletes another run's files in --checkpoints\n(default: refuse)",
    )
    flag(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="PATH",
        help="continue from the newest complete checkpoint (epoch, step or\n"
        "interrupted) any node holds, or from the file PATH",
    )
    flag(
        "--save-every-steps",
        type=_number(int, 0, True),
        metavar="N",
        help="a step checkpoint every N",
    )
    flag(
        "--save-every-minutes",
        type=_number(float, 0, True),
        metavar="M",
        help="a checkpoint when M minutes passed since the last",
    )
    flag(
        "--save-on-each-node",
        action="store_true",
        help="each node's first process writes its own copy too",
    )
    flag(
        "--on-data-change",
        choices=("error", "next-epoch"),
        default="error",
        help="a mid-epoch checkpoint of a training set since changed:\n"
        "refuse it (error), or start the next epoch on the new data",
    )
    flag(
        "--hang-timeout",
        type=_number(float, 0, True),
        metavar="SECONDS",
        help="a rank without progress this long: stacks logged, exit 124",
    )
    flag(
        "--profile-steps",
        type=_steps,
        metavar="A:B",
        help="record optimizer steps A to B-1 with torch.profiler into\n"
        "LOG_DIR/profile (Perfetto, TensorBoard); off by default",
    )
    flag(
        "--profile-ranks",
        type=_number(int, 0, False),
        nargs="+",
        metavar="RANK",
        help="with --profile-steps: only these ranks (default all)",
    )
    flag(
        "--max-restarts",
        type=_number(int, 0, False),
        default=0,
        metavar="N",
        help="with --multiprocessing-distributed: restart failed processes\n"
        "up to N times, resuming (torchrun: its own --max-restarts)",
    )
    flag("--network", metavar="NAME", help="name prefix of the per-epoch weights (default: --arch)")
    flag(
        "--image-size",
        type=_number(int, 32, False),
        default=224,
        metavar="PIXELS",
        help="the crop's side, at least 32 (the network downsamples x32)",
    )
    flag("--dist-url", help="tcp://<node 0 address>:<port>, env:// or file://")
    flag("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"])
    flag("--world-size", type=_number(int, 1, False), default=1, help="number of nodes")
    flag("--rank", type=_number(int, 0, False), default=0, help="this node's rank")
    flag(
        "--multiprocessing-distributed",
        action="store_true",
        help="one process per GPU on this node (or --nprocs CPU processes)",
    )
    flag(
        "--nprocs",
        type=_number(int, 1, False),
        metavar="N",
        help="processes per node with -m-d (CPU: required)",
    )
    flag("--gpu", type=_number(int, 0, False), help="the GPU of a one-process run")
    flag("--demo", action="store_true", help="train on generated shapes, then resume")
    flag(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also DDPKIT_DEBUG=1); without\n"
        "it a mistake ddpkit explains is one line",
    )
    flag("--out", default="demo-out", help="the demo's directory")
    flag("--demo-epochs", type=_number(int, 1, False), default=7, help="then one more, resumed")
    flag("--demo-classes", type=_number(int, 2, False), default=6, help="colour x shape classes")
    flag(
        "--demo-per-class",
        type=_number(int, 1, False),
        default=250,
        help="training images per class",
    )
    flag(
        "--demo-recipe",
        choices=["modern", "classic"],
        default="modern",
        help="modern: 1 warm-up epoch, cosine, EMA; classic: x0.1 for the last\n"
        "epoch, as the recipe",
    )


class _Adder:
    """Adds flags to a parser and keeps what argparse keeps private: each flag, each group.

    With ``defaults=False`` no flag gets its default: on a parser made with
    ``argument_default=argparse.SUPPRESS``, a flag not given is then not set at all.
    """

    def __init__(self, parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
        self.parser, self.defaults = parser, defaults
        self.actions: list[argparse.Action] = []
        self.exclusive: list[list[str]] = []

    def __call__(self, *names: str, **options: Any) -> None:
        self.actions.append(self.parser.add_argument(*names, **self.options(options)))

    def one_of(self) -> Callable[..., None]:
        """A new group of flags that exclude each other; each call of the answer adds one."""
        group = self.parser.add_mutually_exclusive_group()
        dests: list[str] = []
        self.exclusive.append(dests)

        def add(*names: str, **options: Any) -> None:
            action = group.add_argument(*names, **self.options(options))
            self.actions.append(action)
            dests.append(action.dest)

        return add

    def options(self, given: dict[str, Any]) -> dict[str, Any]:
        """``add_argument``'s keywords as given; without ``default`` when ``defaults`` is False."""
        return given if self.defaults else {k: v for k, v in given.items() if k != "default"}


class _Raising(argparse.ArgumentParser):
    """A parser whose every error raises ``ArgumentError`` (``exit_on_error=False`` misses some)."""

    def error(self, message: str) -> NoReturn:
        raise argparse.ArgumentError(None, message)


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
        return ddpkit.parse_trackers(text)
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
