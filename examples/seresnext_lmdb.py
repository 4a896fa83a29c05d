"""Train an SE-ResNeXt on LMDB data with DDP, on one process, one node or several.

The same script runs every way a PyTorch ImageNet-example user expects:

    python seresnext_lmdb.py --data DIR                           # one process (CPU or GPU)
    python seresnext_lmdb.py --data DIR --multiprocessing-distributed \\
        --world-size 2 --rank 0 --dist-url tcp://10.0.0.1:23456    # node 0 of 2, a process per GPU
    torchrun --nproc-per-node 8 seresnext_lmdb.py --data DIR        # also srun under SLURM
    torchrun --nproc-per-node 8 --max-restarts 3 seresnext_lmdb.py --data DIR \\
        --save-every-minutes 10 --hang-timeout 600 --resume           # survives crashes
    python seresnext_lmdb.py --demo                               # generated shapes, minutes

``DIR`` holds ``train.lmdb`` and ``val.lmdb`` (``ddpkit lmdb build``).
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

import ddpkit
from ddpkit.data.shapes import make_shapes_dataset
from ddpkit.devices import cpu_share


def _number(kind: type, least: float, strict: bool) -> Any:
    """An argparse type: a ``kind`` above (``strict``) or at least ``least``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or not (value > least if strict else value >= least):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {least:g}")
        return value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", metavar="DIR", help="directory with train.lmdb and val.lmdb")
    p.add_argument("--arch", default="legacy_seresnext101_32x4d", help="a timm model name")
    p.add_argument(
        "--pretrained", metavar="PATH", help="local weights file (nothing is downloaded)"
    )
    p.add_argument("--num-classes", type=int, help="default: the training set's classes")
    p.add_argument("--requires-grad", action="store_true", help="train all layers, not the head")
    p.add_argument("-b", "--batch-size", type=int, default=256, help="global, over all processes")
    p.add_argument("-j", "--workers", type=int, help="data workers per node")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", "--weight-decay", dest="weight_decay", type=float, default=1e-4)
    p.add_argument("--milestones", type=int, nargs="*", default=[30, 60], help="x0.1 at these")
    p.add_argument("--amp", choices=["bf16", "fp16"], help="mixed precision")
    p.add_argument("--min-crop", type=float, default=0.08, help="RandomResizedCrop's smallest area")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoints", default="checkpoints", metavar="DIR")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH",
                   help="continue from the newest complete checkpoint (epoch, step or\n"
                        "interrupted) any node holds, or from the file PATH")  # fmt: skip
    p.add_argument(
        "--save-every-steps",
        type=_number(int, 0, True),
        metavar="N",
        help="a step checkpoint every N",
    )
    p.add_argument("--save-every-minutes", type=_number(float, 0, True), metavar="M",
                   help="a checkpoint when M minutes passed since the last")  # fmt: skip
    p.add_argument("--save-on-each-node", action="store_true",
                   help="each node's first process writes its own copy too")  # fmt: skip
    p.add_argument("--hang-timeout", type=_number(float, 0, True), metavar="SECONDS",
                   help="a rank without progress this long: stacks logged, exit 124")  # fmt: skip
    p.add_argument("--max-restarts", type=_number(int, 0, False), default=0, metavar="N",
                   help="with --multiprocessing-distributed: restart failed processes\n"
                        "up to N times, resuming (torchrun: its own --max-restarts)")  # fmt: skip
    p.add_argument("--network", default="seresnext", help="name prefix of the per-epoch weights")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--dist-url", help="tcp://<node 0 address>:<port>, env:// or file://")
    p.add_argument("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"])
    p.add_argument("--world-size", type=int, default=1, help="number of nodes")
    p.add_argument("--rank", type=int, default=0, help="this node's rank")
    p.add_argument("--multiprocessing-distributed", action="store_true",
                   help="one process per GPU on this node (or --nprocs CPU processes)")  # fmt: skip
    p.add_argument("--nprocs", type=int, help="processes per node with -m-d (CPU: required)")
    p.add_argument("--gpu", type=int, help="the GPU of a one-process run")
    p.add_argument("--demo", action="store_true", help="train on generated shapes, then resume")
    p.add_argument("--out", default="demo-out", help="the demo's directory")
    p.add_argument("--demo-epochs", type=int, default=7, help="then one more, resumed")
    p.add_argument("--demo-classes", type=int, default=6, help="colour x shape classes")
    p.add_argument("--demo-per-class", type=int, default=250, help="training images per class")
    args = p.parse_args(argv)
    if args.data is None and not args.demo:
        p.error("--data DIR is required (or --demo)")
    if args.max_restarts and not args.multiprocessing_distributed:
        p.error("--max-restarts restarts the processes --multiprocessing-distributed starts; "
                "under torchrun use torchrun's own --max-restarts")  # fmt: skip
    if args.gpu is not None and args.multiprocessing_distributed:
        p.error("--gpu picks the GPU of a one-process run; with --multiprocessing-distributed "
                "each process takes the GPU of its local rank: drop --gpu")  # fmt: skip
    return args


def init_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """What ``init_distributed`` needs beyond the launcher's variables.

    The recipe's one-process-per-node mode (``--world-size N --rank R --dist-url``)
    passes the job explicitly; otherwise ``init_distributed`` finds torchrun,
    SLURM or Open MPI itself, or runs a single process.
    """
    device = None if args.gpu is None else f"cuda:{args.gpu}"
    if args.world_size > 1:
        return {"init_method": args.dist_url, "world_size": args.world_size,
                "rank": args.rank, "backend": args.dist_backend, "device": device}  # fmt: skip
    return {"backend": args.dist_backend, "device": device}


def build_model(args: argparse.Namespace, num_classes: int) -> nn.Module:
    model = timm.create_model(args.arch, pretrained=False, num_classes=num_classes)
    if args.pretrained:  # the ImageNet head (1000 outputs) is skipped; ours stays fresh
        ddpkit.load_pretrained(model, args.pretrained)
    if not args.requires_grad:
        ddpkit.freeze_backbone(model)  # layer0..layer4 frozen, last_linear trained
    return model


def train(info: ddpkit.DistInfo, args: argparse.Namespace) -> dict[str, Any]:
    """One process's whole run; every rank calls it. Returns the last epoch's record."""
    logging.basicConfig(
        level=logging.INFO if info.is_main else logging.WARNING,
        format=f"[rank {info.rank}] %(asctime)s %(message)s",
        force=True,
    )
    if info.device.type == "cpu":  # share the cores instead of oversubscribing them
        torch.set_num_threads(cpu_share(info.local_world_size))
    torch.manual_seed(args.seed)
    size, data = args.image_size, Path(args.data)
    train_tf = ddpkit.train_transform(size, scale=(args.min_crop, 1.0))
    train_set = ddpkit.LazyLMDBDataset(data / "train.lmdb", transform=train_tf)
    val_tf = ddpkit.val_transform(size, round(size * 256 / 224))
    val_set = ddpkit.LazyLMDBDataset(data / "val.lmdb", transform=val_tf)
    classes = args.num_classes or len(train_set.classes)
    model = ddpkit.wrap_ddp(build_model(args, classes), device=info.device)

    workers = None if args.workers is None else args.workers // info.local_world_size
    kw: dict[str, Any] = {"workers": workers, "seed": args.seed, "info": info}
    train_loader = ddpkit.build_loader(
        train_set, global_batch_size=args.batch_size, train=True, **kw
    )
    val_batch = max(1, args.batch_size // info.world_size)
    val_loader = ddpkit.build_loader(val_set, batch_size=val_batch, train=False, **kw)
    criterion = ddpkit.FocalLoss(alpha=0.25, gamma=2, num_class=classes, smooth=0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(
        params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.milestones, gamma=0.1)
    checkpoints = ddpkit.CheckpointManager(
        args.checkpoints, prefix=args.network, every_steps=args.save_every_steps,
        every_minutes=args.save_every_minutes, on_each_node=args.save_on_each_node,
    )  # fmt: skip
    # A restarted process (torchrun --max-restarts, --max-restarts) continues the run.
    resume = args.resume or info.restart_count > 0
    history = ddpkit.fit(
        model, train_loader, optimizer, criterion=criterion, epochs=args.epochs,
        val_loader=val_loader, scheduler=scheduler, config=ddpkit.TrainConfig(amp=args.amp),
        checkpoints=checkpoints, resume=resume,
        report=ddpkit.ReportConfig(progress=not args.demo),  # a bar on rank 0, not in the demo
        faults=ddpkit.FaultConfig(hang_timeout=args.hang_timeout),
    )  # fmt: skip
    return history.last if history.records else {}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train with ``spawn`` (-m-d) or ``init_distributed``; returns this node's first record."""
    if args.multiprocessing_distributed:
        return ddpkit.spawn(
            train, args.nprocs, args=(args,), nnodes=args.world_size, node_rank=args.rank,
            init_method=args.dist_url, backend=args.dist_backend, max_restarts=args.max_restarts,
        )[0]  # fmt: skip
    with ddpkit.init_distributed(**init_arguments(args)) as info:
        return train(info, args)


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
    first = argparse.Namespace(**{
        **vars(args), "data": str(out), "arch": "legacy_seresnext26_32x4d", "image_size": 32,
        "requires_grad": True, "min_crop": 0.7, "lr": 0.05, "epochs": args.demo_epochs,
        "batch_size": min(64, images // nprocs * nprocs),  # tiny test runs still take a step
        "milestones": [args.demo_epochs - 1], "workers": 0, "network": "demo",
        "checkpoints": str(out / "checkpoints"), "multiprocessing_distributed": True,
        "nprocs": nprocs, "world_size": 1, "rank": 0, "dist_url": None,
    })  # fmt: skip
    run(first)
    # A second job continues from latest.pth for one more epoch: resume works.
    record = run(argparse.Namespace(**{**vars(first), "epochs": first.epochs + 1, "resume": True}))
    seconds, where = time.perf_counter() - start, f"{gpus} GPU" if gpus else "2 CPU"
    print(f"demo: final val acc1 {record['val_acc1']:.2f}% after {record['epoch'] + 1} epochs, "
          f"total wall time {seconds:.1f} s ({where} processes)")  # fmt: skip
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
