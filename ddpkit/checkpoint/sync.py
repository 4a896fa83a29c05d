"""Ranks agreeing about checkpoints: which one to resume from (load, send), how a save went.

Without a shared file system only some ranks hold the newest checkpoint (the
node that wrote it). Every rank lists what it holds; all agree on the newest
complete one; its holders load it, checking every CRC; one of them sends it
to the others over the process group (``ddpkit.checkpoint.transfer``). A file that does
not load is reported and the next newest tried, so a damaged ``latest.pth``
costs one checkpoint, not the run.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddpkit._docs import see
from ddpkit.checkpoint.background import BackgroundWriter
from ddpkit.checkpoint.files import (
    LATEST,
    Found,
    check_position,
    describe_run,
    newest_first,
    read_header,
    run_files,
    scan,
)
from ddpkit.checkpoint.serialization import CheckpointError, MapLocation, load_checkpoint
from ddpkit.checkpoint.transfer import broadcast_state
from ddpkit.distributed.comm import all_gather_object, get_rank, get_world_size
from ddpkit.distributed.rank0 import Rank0Error
from ddpkit.position import Position
from ddpkit.rng import check_rng_state, restore_rng_state

logger = logging.getLogger("ddpkit")

if TYPE_CHECKING:
    from ddpkit.checkpoint.state import TrainingState

__all__ = [
    "Agreed",
    "Restored",
    "check_extra",
    "check_fits",
    "claim_directory",
    "describe_error",
    "load_newest",
    "newest_extra",
    "next_generation",
    "raise_earlier_failure",
    "rank0_state",
    "restore_state",
    "share_outcome",
]


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on, as this rank sees it.

    Attributes:
        state: the loaded state (the same on every rank), or None when no rank
            holds a checkpoint.
        found: its header, or None.
        source: the rank whose file was read (and sent to the others).
        generation: the newest generation any rank's directory holds (0: none).
        latest_damaged: this rank's ``latest.pth`` exists but cannot be loaded.
        file: the file this rank read itself, or None (it was sent the state).
    """

    state: dict[str, Any] | None
    found: Found | None
    source: int
    generation: int
    latest_damaged: bool
    file: Path | None


def load_newest(directory: Path, path: Path | None, map_location: MapLocation) -> Agreed:
    """Agree on the newest complete checkpoint (or the file ``path``) and load it on every rank.

    All ranks must call this, or it deadlocks.

    Raises:
        CheckpointError: ``path`` is readable on no rank, or checkpoints exist
            and none of them loads on any rank.
    """
    found, bad = scan(directory)
    explicit, what = _header_at(path) if path is not None else (None, "")
    views = all_gather_object((found, bad, explicit, what))
    generation = max((f.generation for v in views for f in v[0]), default=0)
    damaged = any(name == LATEST for name, _ in bad)
    _warn_unreadable(views, directory)
    if path is not None:
        held = [
            (f, [r for r, v in enumerate(views) if v[2] == f])
            for f in dict.fromkeys(v[2] for v in views if v[2] is not None)
        ]
        if not held:
            said = dict.fromkeys(v[3] for v in views)  # each rank's finding, once
            raise CheckpointError(
                f"resume: {path} is not a checkpoint on any rank: {'; '.join(said)}. Resume "
                f"from a checkpoint ddpkit wrote: latest.pth, interrupted.pth or step-*.pth in "
                "the checkpoint directory (or no path: the newest there). " + see("checkpoints")
            )
        candidates = held[:1]
    else:
        candidates = newest_first([v[0] for v in views])
    if not candidates:
        unreadable = [
            f"{name} on rank {r} ({reason})" for r, v in enumerate(views) for name, reason in v[1]
        ]
        if unreadable:
            raise CheckpointError(
                f"no checkpoint in {directory} (or the other ranks' directories) is loadable: "
                + "; ".join(unreadable)
                + ". "
                + see("checkpoints")
            )
        return Agreed(None, None, 0, generation, damaged, None)
    rank, tried = get_rank(), []
    for header, holders in candidates:
        file = path if path is not None else directory / header.name
        state, error = None, "not held"
        if rank in holders:
            try:
                state, error = load_checkpoint(file, map_location), ""
            except (CheckpointError, OSError) as exc:
                error = str(exc)
                damaged |= path is None and header.name == LATEST
        outcome = all_gather_object(error)
        good = [r for r in holders if outcome[r] == ""]
        if not good:
            tried.append(f"{header.describe()}: {outcome[holders[0]]}")
            if rank == holders[0]:
                warnings.warn(
                    f"{outcome[holders[0]]}; trying an older checkpoint",
                    RuntimeWarning,
                    stacklevel=4,
                )
            continue
        source = good[0]
        if len(good) < get_world_size():
            # Each rank holds one state: those that read the file too take the sent one.
            state = broadcast_state(state if rank == source else None, source)
        assert state is not None
        return Agreed(state, header, source, generation, damaged, file if rank in good else None)
    raise CheckpointError(
        f"no checkpoint in {directory} (or the other ranks' directories) is loadable: "
        + "; ".join(tried)
        + ". "
        + see("checkpoints")
    )


def newest_extra(directory: Path) -> tuple[str, dict[str, Any]] | None:
    """The name and ``extra`` of the checkpoint a resume of ``directory`` takes, or None.

    The same choice as :func:`load_newest` (the newest of the newest generation
    any rank holds: ``latest.pth``, a step file or ``interrupted.pth``), read
    without its tensors on a rank that holds it; a file whose ``extra`` cannot be
    read gives way to the next newest, as the resume's load does. All ranks must
    call this, or it deadlocks.
    """
    views = all_gather_object(scan(directory)[0])
    rank = get_rank()
    for header, holders in newest_first(views):
        extra = _extra_of(directory / header.name) if rank in holders else None
        seen = [e for r, e in enumerate(all_gather_object(extra)) if r in holders and e is not None]
        if seen:
            return header.name, seen[0]
    return None


def _extra_of(path: Path) -> dict[str, Any] | None:
    """The ``extra`` a ddpkit checkpoint at ``path`` records (its tensors left on disk)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # damaged or gone since the scan: the resume skips it too
        return None
    extra = state.get("extra") if isinstance(state, dict) else None
    return extra if isinstance(extra, dict) else {}


def claim_directory(directory: Path, *, writes: bool, overwrite: bool) -> None:
    """Refuse (or, with ``overwrite``, remove) another run's files in the writing ranks' directory.

    All ranks must call this, or it deadlocks; each rank that ``writes``
    looks in its own ``directory``, and a refusal is raised on every rank.

    Raises:
        CheckpointError: a run's files are there and ``overwrite`` is False.
    """
    files = run_files(directory) if writes else []
    line = describe_run(directory, files) if files and not overwrite else None
    views = all_gather_object((get_rank(), files, line))
    taken = [(rank, names, what) for rank, names, what in views if names]
    if taken and not overwrite:
        rank, names, what = taken[0]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        raise CheckpointError(
            f"{directory} (on rank {rank}) holds another run's checkpoints: {what}; files: "
            f"{shown}. A fresh run would replace them. Continue that run (fit(resume=True), "
            "--resume), write to another directory, or pass CheckpointManager(overwrite=True) "
            f"(--overwrite) to delete them. {see('a-directory-holds-another-run')}"
        )
    for name in files:
        (directory / name).unlink(missing_ok=True)
    if files:
        logger.warning(
            "overwrite: removed the previous run's %s from %s", ", ".join(files), directory
        )


def next_generation(directory: Path) -> int:
    """One more than any generation in the directories of all ranks (a collective)."""
    found, _ = scan(directory)
    mine = max((f.generation for f in found), default=0)
    return max(all_gather_object(mine)) + 1


def _header_at(path: Path) -> tuple[Found | None, str]:
    """The header of the checkpoint at ``path``, or None and what the path is instead."""
    where = f"on rank {get_rank()}"
    if path.is_dir():
        return None, (
            f"{where} it is a directory; pass a file in it, such as {path / LATEST}, or "
            "resume without a path (fit(resume=True), the example's --resume without PATH, "
            "--checkpoints DIR) to take the newest"
        )
    if not path.exists():
        return None, f"{where} there is no such file (check the path on the node that wrote it)"
    try:
        return read_header(path), ""
    except OSError as exc:
        return None, f"{where} it cannot be read ({exc})"
    except ValueError as exc:
        return None, f"{where} {_what_file(path, str(exc))}"


def _what_file(path: Path, reason: str) -> str:
    """What a file that is not a checkpoint is, and what to do with it."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"\x89PNG") or head.startswith(b"%PDF") or head.startswith(b"<?xml"):
        return "it is an image (the learning curves ddpkit plot draws), not a checkpoint"
    if path.suffix == ".jsonl" or head.lstrip().startswith(b"{"):
        return "it is a text file (metrics.jsonl, the epoch records fit writes), not a checkpoint"
    if reason == "not a ddpkit checkpoint" and _holds_weights(path):
        return (
            "it holds a model's weights alone (best.pth, <prefix>-epoch<N>-acc<a>.pth): no "
            "optimizer or position to resume. Start from them with load_pretrained "
            "(the example's --pretrained PATH)"
        )
    return f"it is not a ddpkit checkpoint ({reason})"


def _holds_weights(path: Path) -> bool:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # unreadable either way: read_header said why
        return False
    return isinstance(state, dict) and any(isinstance(v, torch.Tensor) for v in state.values())


def _warn_unreadable(views: list[Any], directory: Path) -> None:
    """Warn once per unreadable file, on the lowest rank that found it."""
    rank, seen = get_rank(), set()
    for r, (_, bad, _, _) in enumerate(views):
        for name, reason in bad:
            if (name, reason) in seen:
                continue
            seen.add((name, reason))
            if r == rank:
                warnings.warn(
                    f"{directory / name} is damaged and cannot be loaded ({reason}); use an "
                    "older checkpoint; trying an older checkpoint",
                    RuntimeWarning,
                    stacklevel=4,
                )


def describe_error(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def raise_earlier_failure(
    mine: BaseException | None, reports: list[str | None], writer: BackgroundWriter
) -> None:
    """Raise, on every rank, a background write that failed on any rank."""
    failed = [(r, text) for r, text in enumerate(reports) if text is not None]
    if not failed:
        return
    if mine is not None:
        writer.wait()  # raises it here, once
    rank, text = failed[0]
    raise CheckpointError(
        f"rank {rank} could not write its last checkpoint ({text}); the checkpoints before "
        "it are intact. " + see("checkpoints")
    )


def share_outcome(error: BaseException | None, kind: str) -> None:
    """A blocking save: every rank learns whether the writing ranks succeeded."""
    report = None if error is None else (type(error).__qualname__, str(error), "")
    verdicts = all_gather_object(report)
    if error is not None:
        raise error
    for rank, verdict in enumerate(verdicts):
        if verdict is None:
            continue
        if rank == 0:
            raise Rank0Error(
                f"rank 0 raised {verdict[0]}: {verdict[1]} (saving the {kind} checkpoint); rank "
                f"{get_rank()} stops too rather than wait for it. Rank 0's traceback has the cause",
                *verdict,
            )
        raise CheckpointError(
            f"rank {rank} could not write its copy of the {kind} checkpoint: "
            f"{verdict[0]}: {verdict[1]}"
        )


@dataclass(frozen=True)
class Restored:
    """What :func:`restore_state` read back besides the objects it loaded into."""

    position: Position
    loop: list[Any] | None
    best_acc1: float | None
    best_epoch: int | None
    extra: dict[str, Any] | None = None


def check_extra(name: str, saved: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose ``extra`` differs from ``expected`` in a key both hold.

    Raises:
        CheckpointError: names the key, the value it was trained with and this run's.
    """
    differ = [k for k in expected if k in saved and saved[k] != expected[k]]
    if differ:
        was = ", ".join(f"{k} {saved[k]}" for k in differ)
        now = ", ".join(f"{k} {expected[k]}" for k in differ)
        raise CheckpointError(
            f"{name} was trained with {was}; this run has {now}. Pass {was} to resume or "
            f"evaluate it, or start a new run in another directory. {see('checkpoints')}"
        )


def rank0_state(module: nn.Module, gather: bool) -> dict[str, Any]:
    """``module``'s state as rank 0 holds it (with ``gather``; a collective), else as it is.

    DDP keeps parameters equal on all ranks, but each rank updates its
    BatchNorm statistics with its own batch after rank 0's are broadcast (and
    an average of the model averages them): a copy written by another rank
    takes rank 0's buffers, or a resume from it would not be exact.
    """
    weights = module.state_dict()
    if not gather:
        return weights
    buffers = {name: weights[name] for name, _ in module.named_buffers() if name in weights}
    ours = broadcast_state(buffers if get_rank() == 0 else None, 0)
    if get_rank() != 0:
        weights.update(ours)  # a fresh dict from state_dict(): the module is not touched
    return weights


def restore_state(
    state: dict[str, Any],
    found: Found,
    training: TrainingState,
    strict_rng: bool,
    where: str | None = None,
    expected: Mapping[str, Any] | None = None,
) -> Restored:
    """Load ``state`` into every piece of ``training`` (None pieces are skipped).

    This rank's RNG state is restored when the world size is the one that saved.
    Everything is checked before anything is loaded: the position, the RNG
    states, and that the model (and its average) has the checkpoint's tensors.

    Args:
        where: the checkpoint's path, for messages; default: its file name.

    Raises:
        CheckpointError: a piece asked for is not in ``state``, the position or
            an RNG state is malformed, the model is not the one that saved
            (names the first keys and shapes that differ), the world size
            changed and ``strict_rng`` is True (with False: a warning), or
            ``state["extra"]`` holds another value than ``expected`` for one of
            its keys (another architecture, say); nothing is loaded then.
    """
    name = where or found.name
    check_extra(name, state.get("extra") or {}, expected or {})
    saved, now = state.get("world_size"), get_world_size()
    try:
        if int(state.get("version", 0)) >= 2:
            position = check_position(state)[1]
        else:  # 0.1's format: an epoch end
            position = Position(int(state["epoch"]) + 1, 0, 0, 0, int(saved or 1))
        _check_rng_list(state.get("rng"), position.world_size)
    except ValueError as exc:
        raise CheckpointError(
            f"{name} cannot be resumed: {exc}. The file was changed after it was written, or "
            "not by ddpkit; resume from another checkpoint. " + see("checkpoints")
        ) from None
    training.check(state, name)
    saved = position.world_size
    if saved != now:
        message = f"{name} holds RNG states for {saved} ranks and this job has {now}"
        if strict_rng:
            raise CheckpointError(f"{message}; pass strict_rng=False to resume without them")
        if get_rank() == 0:  # the same words from every rank say nothing more
            warnings.warn(
                f"{message}; resuming without restoring RNG state, so the run continues but "
                "is not bit-exact with an uninterrupted one",
                RuntimeWarning,
                stacklevel=4,
            )
    training.load(state)
    if saved == now:
        restore_rng_state(state["rng"][get_rank()])
    extra = state.get("extra")
    return Restored(
        position,
        state.get("loop"),
        state.get("best_acc1"),
        state.get("best_epoch"),
        extra if isinstance(extra, dict) else None,
    )


def _check_rng_list(rng: Any, world_size: int) -> None:
    """The checkpoint's ``rng``: one state of :func:`capture_rng_state` per saving rank."""
    if not isinstance(rng, list | tuple):
        raise ValueError(f"its 'rng' field is {rng!r:.60}, not a list of one RNG state per rank")
    if len(rng) != world_size:
        raise ValueError(
            f"its 'rng' field holds {len(rng)} RNG state(s), but {world_size} rank(s) saved it"
        )
    for rank, entry in enumerate(rng):
        try:
            check_rng_state(entry)
        except ValueError as exc:
            raise ValueError(f"its 'rng' field, entry {rank} (rank {rank}'s): {exc}") from None


def check_fits(module: nn.Module, weights: Any, name: str, what: str = "model") -> None:
    """Refuse ``weights`` that do not load into ``module``, naming the first differences.

    Raises:
        CheckpointError: keys missing from the file, keys the module lacks, or
            tensors of other shapes (the first few of each); or no state dict at all.
    """
    if not isinstance(weights, dict):
        raise CheckpointError(f"{name} holds no {what} state dict (a {type(weights).__name__})")
    mine = module.state_dict()
    missing = [k for k in mine if k not in weights]
    unexpected = [k for k in weights if k not in mine]
    shapes = [
        f"{k} (file {list(weights[k].shape)}, {what} {list(v.shape)})"
        for k, v in mine.items()
        if k in weights
        and isinstance(v, torch.Tensor)
        and isinstance(weights[k], torch.Tensor)
        and weights[k].shape != v.shape
    ]
    if not (missing or unexpected or shapes):
        return
    said = [
        f"{label}: {_first(items)}"
        for label, items in (
            ("shapes differ", shapes),
            (f"missing from the file ({len(missing)})", missing),
            (f"not in the {what} ({len(unexpected)})", unexpected),
        )
        if items
    ]
    raise CheckpointError(
        f"{name} was saved from another {what} than this one ({type(module).__name__}); "
        + "; ".join(said)
        + ". Resume with the model that wrote it (the same --arch and --num-classes), or start "
        "a new run in another checkpoint directory; to start from its weights, use "
        "load_pretrained (--pretrained) with a weight file. " + see("checkpoints")
    )


def _first(items: list[str], count: int = 3) -> str:
    more = f" and {len(items) - count} more" if len(items) > count else ""
    return ", ".join(items[:count]) + more
