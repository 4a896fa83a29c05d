"""The files of a checkpoint directory: their names, what each holds, which is newest.

Every full checkpoint (epoch ends, step checkpoints, the one written when a
signal stops the job) holds the same state and a header: a format and
version, a ``generation`` (a run started afresh in a directory gets a new one,
so its checkpoints always outrank an older run's), the optimizer ``step`` and
a ``snapshot`` id shared by every copy of one save (on several nodes).
:func:`scan` reads the headers without loading the tensors; :func:`newest_first`
orders what every rank found.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.serialization import (
    CheckpointError,
    check_records,
    check_saveable,
    link_or_copy,
    payload_bytes,
    replace_atomic,
    save_checkpoint,
    write_file,
)
from ddpkit.files import remove_stale
from ddpkit.position import Position

__all__ = [
    "BEST",
    "FORMAT",
    "INTERRUPTED",
    "LATEST",
    "PREVIOUS",
    "VERSION",
    "Found",
    "averaged",
    "check_position",
    "checkpoint_name",
    "describe_run",
    "is_run_file",
    "newest_first",
    "prune_steps",
    "read_header",
    "run_files",
    "scan",
    "stale_steps",
    "stale_weights",
    "step_name",
    "weight_name",
    "write_files",
]

logger = logging.getLogger("ddpkit")

FORMAT, VERSION = "ddpkit-checkpoint", 2
LATEST, PREVIOUS, INTERRUPTED = "latest.pth", "previous.pth", "interrupted.pth"
_STEP_FILE = re.compile(r"step-(\d+)\.pth")
_STEP_TEMP = re.compile(r"\.step-\d+\.pth\.tmp-")
# Per-epoch weight files, whatever their prefix: "<prefix>-epoch<N>[-acc<acc1>].pth".
_WEIGHT_FILE = re.compile(r".+-epoch\d+(?:-acc(?:\d+\.\d+|nan))?\.pth")
BEST = "best.pth"
# Among checkpoints of one step, the one further along: an epoch end has also
# validated and stepped the scheduler.
_KIND_ORDER = {"step": 0, "interrupted": 1, "epoch": 2}


def step_name(step: int) -> str:
    """The file name of the step checkpoint taken after optimizer step ``step``."""
    return f"step-{step:09d}.pth"


def checkpoint_name(kind: str, step: int) -> str:
    """The file a checkpoint of ``kind`` taken after optimizer step ``step`` goes to."""
    return LATEST if kind == "epoch" else INTERRUPTED if kind == "interrupted" else step_name(step)


def weight_name(prefix: str, epoch: int, acc1: float | None) -> str:
    """The weight file of epoch ``epoch`` (from 0; named from 1), by its ``acc1`` when measured."""
    return f"{prefix}-epoch{epoch + 1}{'' if acc1 is None else f'-acc{acc1:.2f}'}.pth"


def is_run_file(name: str) -> bool:
    """Whether a training run writes files named ``name`` (:func:`run_files`' rule)."""
    return "/" not in name and bool(
        name in (LATEST, PREVIOUS, INTERRUPTED, BEST)
        or _STEP_FILE.fullmatch(name)
        or _WEIGHT_FILE.fullmatch(name)
    )


@dataclass(frozen=True)
class Found:
    """One checkpoint file as its header describes it; picklable, sent between ranks.

    Attributes:
        name: the file name in its directory.
        snapshot: the id of the save it comes from, the same in every copy.
        generation: the run it belongs to (a fresh run in the directory: one more).
        step: optimizer steps taken when it was saved.
        kind: ``"epoch"``, ``"step"`` or ``"interrupted"``.
        epoch: the epoch it resumes in.
        world_size: ranks that saved it.
        job: the launcher's name for the job that saved it
            (:func:`~ddpkit.distributed.launchers.launcher_job`), or None.
    """

    name: str
    snapshot: str
    generation: int
    step: int
    kind: str
    epoch: int
    world_size: int
    job: str | None = None

    @property
    def order(self) -> tuple[int, int, int]:
        """Sort key: the newest checkpoint is the greatest."""
        return (self.generation, self.step, _KIND_ORDER.get(self.kind, 0))

    def describe(self) -> str:
        where = (
            f"end of epoch {self.epoch}"  # self.epoch is the next one's index
            if self.kind == "epoch"
            else f"in epoch {self.epoch + 1}"
        )
        return f"{self.name} ({self.kind}: {where}, step {self.step})"


def read_header(path: Path) -> Found:
    """The header of the checkpoint at ``path``, read without loading its tensors.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a ddpkit checkpoint (or is damaged), with the reason.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except OSError:
        raise
    except Exception as exc:  # a damaged zip, a pickle torch refuses: not loadable
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("not a ddpkit checkpoint")
    version = int(state.get("version", 0))
    if version > VERSION:
        raise ValueError(f"written by a newer ddpkit (format version {version})")
    epoch = int(state["epoch"])
    if version < 2:  # 0.1's latest.pth / previous.pth: an epoch end, before steps were counted
        return Found(
            path.name,
            f"v1:{path.name}:{epoch}",
            0,
            0,
            "epoch",
            epoch + 1,
            int(state.get("world_size", 1)),
        )
    kind, position = check_position(state)
    return Found(
        name=path.name,
        snapshot=str(state["snapshot"]),
        generation=int(state["generation"]),
        step=position.step,
        kind=kind,
        epoch=position.epoch,
        world_size=position.world_size,
        job=state["job"] if isinstance(state.get("job"), str) else None,
    )


def check_position(state: Mapping[str, Any]) -> tuple[str, Position]:
    """The kind and position of a (version 2) checkpoint's state, checked against each other.

    Raises:
        ValueError: the kind is unknown, a field of the position is missing,
            of the wrong type or out of range (:meth:`Position.from_dict`), an
            epoch end sits mid-epoch, or the position's world size is not the
            checkpoint's; the message names the field and its value.
    """
    kind = state.get("kind")
    if kind not in _KIND_ORDER:
        raise ValueError(f"its kind is {kind!r}, not one of {', '.join(map(repr, _KIND_ORDER))}")
    position = Position.from_dict(state.get("position"))
    if kind == "epoch" and position.mid_epoch:
        raise ValueError(
            f"it is an epoch end but its position is mid-epoch (batches={position.batches}, "
            f"samples={position.samples})"
        )
    saved = state.get("world_size")
    if saved != position.world_size:
        raise ValueError(
            f"its world_size is {saved!r} but its position's world_size is {position.world_size}"
        )
    return str(kind), position


def scan(directory: Path) -> tuple[list[Found], list[tuple[str, str]]]:
    """The checkpoints in ``directory``, and the ``(name, reason)`` of those unreadable."""
    found: list[Found] = []
    bad: list[tuple[str, str]] = []
    if not directory.is_dir():
        return found, bad
    names = [LATEST, PREVIOUS, INTERRUPTED]
    names += sorted(p.name for p in directory.iterdir() if _STEP_FILE.fullmatch(p.name))
    for name in names:
        path = directory / name
        if not path.is_file():
            continue
        try:
            found.append(read_header(path))
        except (OSError, ValueError) as exc:
            bad.append((name, str(exc)))
    return found, bad


def run_files(directory: Path) -> list[str]:
    """The names of the files a training run leaves in ``directory``, sorted; [] when none.

    Full checkpoints (``latest.pth``, ``previous.pth``, ``interrupted.pth``,
    ``step-<n>.pth``), per-epoch weight files of any prefix and ``best.pth``;
    other files (``metrics.jsonl``, a user's notes) are not a run's.
    """
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.is_file() and is_run_file(p.name))


def describe_run(directory: Path, files: list[str]) -> str:
    """One line about the run whose ``files`` lie in ``directory``: how far it got, its best."""
    found, _ = scan(directory)
    newest = max(found, key=lambda f: f.order, default=None)
    if newest is None:
        return "no full checkpoint (weights only)"
    try:
        path = directory / newest.name
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # read_header read it a moment ago: describe what it told
        state = {}
    line = newest.describe()
    best, epoch = state.get("best_acc1"), state.get("best_epoch")
    if best is not None and epoch is not None:
        line += f", best acc1 {best:.2f}% at epoch {int(epoch) + 1}"
    return line


def newest_first(per_rank: list[list[Found]]) -> list[tuple[Found, list[int]]]:
    """Every distinct checkpoint the ranks found, newest first, with the ranks holding it.

    Only the newest generation counts: an older one is another run, which a
    resume must never fall back to silently.
    """
    holders: dict[str, list[int]] = {}
    first: dict[str, Found] = {}
    for rank, found in enumerate(per_rank):
        for f in found:
            first.setdefault(f.snapshot, f)
            if rank not in holders.setdefault(f.snapshot, []):
                holders[f.snapshot].append(rank)
    if not first:
        return []
    newest = max(f.generation for f in first.values())
    ordered = sorted(
        (f for f in first.values() if f.generation == newest), key=lambda f: f.order, reverse=True
    )
    return [(f, holders[f.snapshot]) for f in ordered]


def averaged(ema_state: dict[str, Any]) -> dict[str, Any]:
    """The network weights in an ``AveragedModel``'s state: ``module.`` dropped, no counter."""
    return {k.removeprefix("module."): v for k, v in ema_state.items() if k.startswith("module.")}


def write_files(
    directory: Path,
    state: dict[str, Any],
    *,
    prefix: str,
    keep_last: int,
    keep_steps: int,
    best: bool,
    rotate: bool,
) -> Path:
    """Write one checkpoint's files; return the checkpoint's path.

    An epoch checkpoint also writes the epoch's weight file (and ``best.pth``
    when ``best``), moves ``latest.pth`` to ``previous.pth`` (when
    ``rotate``: not a damaged one) and prunes old weight files. Every kind
    then prunes step checkpoints (:func:`prune_steps`).
    """
    clean = check_saveable(state)
    directory.mkdir(parents=True, exist_ok=True)
    kind, position = clean["kind"], clean["position"]
    full = functools.partial(write_file, clean)
    path = directory / checkpoint_name(kind, position["step"])
    # Two writers (on_each_node) that share the directory write the same bytes:
    # the second finds the first's file and leaves it, and everything else here
    # tolerates the other having done it first.
    if _holds(path, clean["snapshot"]):
        return path
    if kind == "epoch":
        epoch = clean["epoch"]
        # Files and reports count epochs from 1; without validation, named by the epoch alone.
        name = weight_name(prefix, epoch, clean["acc1"])
        epoch_path = directory / name
        weights = clean["model"] if clean.get("weights") != "ema" else averaged(clean["ema"])
        save_checkpoint(weights, epoch_path)
        if best:
            link_or_copy(epoch_path, directory / BEST)
        # latest.pth comes last, so the files it refers to exist whenever it does.
        if rotate:
            _rotate(path, clean["snapshot"])
        replace_atomic(path, full, payload_bytes(clean))
        best_epoch = clean["best_epoch"]
        _prune_weights(
            directory,
            prefix,
            keep_last,
            epoch + 1,
            name,
            None if best_epoch is None else best_epoch + 1,
        )
        logger.info("saved epoch %d: %s and %s", epoch + 1, path, epoch_path)
    else:
        replace_atomic(path, full, payload_bytes(clean))
        logger.info(
            "saved %s (in epoch %d, step %d)", path, position["epoch"] + 1, position["step"]
        )
    prune_steps(directory, keep_steps, clean["generation"], position["step"])
    return path


def _prune_weights(
    directory: Path, prefix: str, keep_last: int, epoch: int, current: str, best_epoch: int | None
) -> None:
    """Keep the weight files of the last ``keep_last`` epochs and the best (numbers from 1)."""
    names = [path.name for path in directory.iterdir()]
    for name in stale_weights(names, prefix, keep_last, epoch, current, best_epoch):
        (directory / name).unlink(missing_ok=True)


def stale_weights(
    names: Iterable[str],
    prefix: str,
    keep_last: int,
    epoch: int,
    current: str,
    best_epoch: int | None,
) -> list[str]:
    """The weight files among ``names`` that a save of epoch ``epoch`` (from 1) removes.

    Kept: the last ``keep_last`` epochs' (``current`` is this epoch's) and the best epoch's.
    """
    pattern = re.compile(rf"{re.escape(prefix)}-epoch(\d+)(?:-acc.*)?\.pth")
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        if match and int(match.group(1)) <= epoch:
            found.append((int(match.group(1)), name))
    keep = sorted({n for n, _ in found if n < epoch}, reverse=True)[: keep_last - 1]
    # Another file of this epoch comes from a run that resumed before it.
    return [
        name
        for number, name in found
        if (number != epoch and number not in keep and number != best_epoch)
        or (number == epoch and name != current)
    ]


def prune_steps(directory: Path, keep: int, generation: int, newest_step: int) -> None:
    """Remove step checkpoints beyond the ``keep`` newest, and those of other generations.

    Also removes ``interrupted.pth`` once a checkpoint of a later step exists,
    and temporaries of dead processes.
    """
    steps = {p.name: _generation(p) for p in directory.iterdir() if _STEP_FILE.fullmatch(p.name)}
    for name in stale_steps(steps, keep, generation):
        (directory / name).unlink(missing_ok=True)
    interrupted = directory / INTERRUPTED
    if interrupted.exists():
        try:
            header = read_header(interrupted)
            old = header.generation != generation or header.step < newest_step
        except (OSError, ValueError):
            old = True  # damaged: a newer checkpoint stands in for it
        if old:
            interrupted.unlink(missing_ok=True)
    # A step file is written once under its name, so nothing else clears what a kill left.
    for path in directory.iterdir():
        if _STEP_TEMP.match(path.name):
            remove_stale(directory / path.name[1:].split(".tmp-")[0], hidden=True)


def stale_steps(steps: Mapping[str, int | None], keep: int, generation: int) -> list[str]:
    """The step checkpoints (``{name: generation}``) beyond the ``keep`` newest of ``generation``.

    Only this run's files count towards ``keep``: another generation's go regardless.
    """
    ordered = sorted(steps, key=lambda name: int(name[5:-4]), reverse=True)
    this_run = [name for name in ordered if steps[name] == generation][:keep]
    return [name for name in ordered if name not in this_run]


def _rotate(latest: Path, snapshot: str) -> None:
    """Make ``previous.pth`` the ``latest.pth`` about to be replaced (if there is one).

    A writer sharing the directory may have just put this very snapshot
    there, which must not become the previous one.
    """

    def older(tmp: Path) -> bool:
        try:
            return read_header(tmp).snapshot != snapshot
        except (OSError, ValueError):
            return True

    link_or_copy(latest, latest.parent / PREVIOUS, older)


def _holds(path: Path, snapshot: str) -> bool:
    """Whether ``path`` is already a complete, undamaged checkpoint of ``snapshot``."""
    try:
        if read_header(path).snapshot != snapshot:
            return False
        check_records(path)  # every CRC, streamed: a damaged copy is written again
    except (OSError, ValueError, CheckpointError):
        return False
    return True


def _generation(path: Path) -> int | None:
    try:
        return read_header(path).generation
    except (OSError, ValueError):
        return None
