"""What the SE-ResNeXt example settles before it builds anything: batch split, names, the model.

The checks here run before a dataset or a model exists, so a wrong flag costs
a second, not a model build: a global batch that does not divide over the
processes, a checkpoint trained with another ``--arch`` (``--num-classes``,
``--image-size``). Every checkpoint the example writes records those three
(``CheckpointManager(extra=...)``), and resuming or evaluating compares them.
"""

from __future__ import annotations

import argparse
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddpkit

__all__ = [
    "batch_error",
    "batch_line",
    "check_resume_config",
    "check_weights_file",
    "load_weights",
    "model_record",
    "processes_from_flags",
    "weights_prefix",
    "workers_per_process",
]


def weights_prefix(args: argparse.Namespace) -> str:
    """The start of the per-epoch weight files' names: ``--network``, else the arch."""
    if args.network is not None:
        return str(args.network)
    return re.sub(r"[^\w.-]+", "-", args.arch)  # hf-hub:org/name -> hf-hub-org-name


def workers_per_process(workers: int | None, nprocs: int) -> int | None:
    """``-j`` (per node) shared by the node's ``nprocs`` processes, rounded up as the
    recipe did, so any ``-j`` >= 1 leaves each process at least one worker."""
    return None if workers is None else (workers + nprocs - 1) // nprocs


def batch_line(global_batch: int, nprocs: int, per_process: int, workers: int) -> str:
    """The start-up line that says how ``-b`` and ``-j`` were shared out."""
    return (
        f"global batch {global_batch} (-b: all processes of all nodes, not per node) = "
        f"{nprocs} process{'es' if nprocs != 1 else ''} x {per_process} per process; "
        f"{workers} data worker{'s' if workers != 1 else ''} per process"
    )


def processes_from_flags(args: argparse.Namespace, gpus: int) -> int | None:
    """How many processes the flags start (``-m-d``, ``--world-size``); None: a launcher says."""
    if args.multiprocessing_distributed:
        return int((args.nprocs or gpus) * args.world_size)
    return int(args.world_size) if args.world_size > 1 else None


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


def model_record(args: argparse.Namespace, num_classes: int) -> dict[str, Any]:
    """What every checkpoint of the run records about the model, keyed by the flag that sets it."""
    return {"--arch": args.arch, "--num-classes": num_classes, "--image-size": args.image_size}


# --balance: the power of the class sizes the draws follow (None: the plain shuffle).
BALANCE_POWERS: dict[str, float | None] = {"none": None, "sqrt": 0.5, "class": 1.0}


def data_record(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that decide an epoch's draws and augmentations, as every checkpoint records them.

    A resume with other values is refused: the position of a mid-epoch
    checkpoint means something only in the order and augmentations it was taken in.
    """
    return {
        "--balance": args.balance,
        "--aug-repeats": args.aug_repeats,
        "--auto-augment": args.auto_augment or "none",
        "--aug-magnitude": args.aug_magnitude,
        "--random-erase": args.random_erase,
    }


def check_weights_file(path: str, record: dict[str, Any]) -> None:
    """Refuse a file to evaluate that was trained with other flags, before loading it.

    A full checkpoint records the flags itself; a weight file (``best.pth``,
    ``<prefix>-epoch<N>-acc<acc>.pth``) is its run's, whose ``latest.pth``
    lies beside it. A file without a record (another tool's) is not checked.

    Raises:
        ddpkit.CheckpointError: the file's run was trained with another ``--arch``,
            ``--num-classes`` or ``--image-size``.
    """
    file = Path(path)
    saved = _extra(file)
    if saved is None and file.name != "latest.pth":
        saved = _extra(file.parent / "latest.pth")
    differ = [k for k in record if saved is not None and k in saved and saved[k] != record[k]]
    if saved is not None and differ:
        was = ", ".join(f"{k} {saved[k]}" for k in differ)
        now = ", ".join(f"{k} {record[k]}" for k in differ)
        raise ddpkit.CheckpointError(
            f"{file} was trained with {was}; this run has {now}. Pass {was} to resume or "
            "evaluate it, or start a new run in another directory"
        )


def load_weights(
    model: nn.Module, path: str, flag: str, record: dict[str, Any] | None = None
) -> None:
    """Load the whole of ``path`` into ``model`` on every rank; a failure on one reaches all.

    A file whose run recorded another ``record`` (:func:`check_weights_file`)
    is refused before loading. All ranks must call this, or it deadlocks.
    """
    error = None
    try:
        if record is not None:
            check_weights_file(path, record)
        report = ddpkit.load_pretrained(model, path, strict=True)
        if report.skipped:
            error = (
                f"{path} has another head than the model ({', '.join(report.skipped)}); "
                "pass the --num-classes it was trained with"
            )
    except (OSError, ValueError, ddpkit.CheckpointError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    errors = [(rank, e) for rank, e in enumerate(ddpkit.all_gather_object(error)) if e]
    if errors:
        rank, first = errors[0]
        raise ddpkit.CheckpointError(f"--evaluate {flag} {path} (rank {rank}): {first}")


def check_resume_config(
    checkpoints: ddpkit.CheckpointManager | str, config: dict[str, Any]
) -> None:
    """Compare this run's resolved flags with those of ``directory``'s newest checkpoint.

    A changed ``-b``, ``--seed`` or ``--data`` would read other samples, or in
    another order, than the run being continued: refused on every rank. A
    changed learning rate, schedule, augmentation or precision is a warning on
    rank 0. A checkpoint without a record (before 0.3) is not compared. All
    ranks must call this, or it deadlocks.

    Raises:
        ddpkit.CheckpointError: a setting that breaks the resume changed (named,
            with both values).
    """
    from ddpkit.examples.seresnext_config import resume_changes

    # The checkpoint the resume takes (a step or interrupted file may be newer than latest.pth).
    if not isinstance(checkpoints, ddpkit.CheckpointManager):  # its directory
        checkpoints = ddpkit.CheckpointManager(checkpoints)
    directory = checkpoints.directory
    newest = checkpoints.newest_extra()
    name, saved = newest if newest is not None else ("latest.pth", None)
    record = saved.get("config") if saved is not None else None
    breaking, changing = resume_changes(record, config) if isinstance(record, dict) else ([], [])
    errors = [e for e in ddpkit.all_gather_object(breaking) if e]
    if errors:
        raise ddpkit.CheckpointError(
            f"--resume: {Path(directory) / name} was trained with other settings that decide "
            f"which samples come next ({', '.join(errors[0])}); set them back to resume, or "
            "start a new run in another --checkpoints (docs/troubleshooting.md: config files "
            "and changed settings on resume)"
        )
    if changing and ddpkit.get_rank() == 0:
        warnings.warn(
            f"--resume: settings changed since {Path(directory) / name} ({', '.join(changing)}); "
            "the rest of the run trains with the new ones, so it is not the uninterrupted run",
            RuntimeWarning,
            stacklevel=2,
        )


def _extra(path: Path) -> dict[str, Any] | None:
    """The ``extra`` a ddpkit checkpoint at ``path`` records (without reading its tensors)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # missing, damaged or foreign: the load that follows says what is wrong
        return None
    extra = state.get("extra") if isinstance(state, dict) else None
    return extra if isinstance(extra, dict) else None
