"""Ranks agreeing about checkpoints: which one to resume from (load, send), whose directory.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ddpkit._docs import see
from ddpkit.checkpoint.files import (
    LATEST,
    Found,
    describe_run,
    newest_first,
    read_header,
    run_files,
    scan,
)
from ddpkit.checkpoint.serialization import CheckpointError, MapLocation, load_checkpoint
from ddpkit.checkpoint.transfer import broadcast_state
from ddpkit.distributed.comm import all_gather_object, get_rank, get_world_size

if TYPE_CHECKING:
    from ddpkit.checkpoint.store import ObjectStore

logger = logging.getLogger("ddpkit")
_T = TypeVar("_T")

__all__ = [
    "Agreed",
    "claim_directory",
    "load_newest",
    "load_remote",
    "newest_extra",
    "next_generation",
    "shared",
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


def shared(work: Callable[[], _T]) -> _T:
    """``work()`` on rank 0 (a store's requests), its result or its error on every rank.

    The other ranks wait in a patient gather (:data:`~ddpkit.distributed.comm.PATIENT_TIMEOUT`),
    so a slow store times out no collective. All ranks must call this, or it deadlocks.

    Raises:
        CheckpointError: on the other ranks, when ``work`` raised on rank 0
            (which raises its own error).
    """
    result: Any = None
    error: BaseException | None = None
    if get_rank() == 0:
        try:
            result = work()
        except Exception as exc:  # every rank raises it, so none waits for rank 0
            error = exc
    told = all_gather_object(
        (result, None if error is None else f"{type(error).__name__}: {error}"), patient=True
    )[0]
    if error is not None:
        raise error
    if told[1] is not None:
        raise CheckpointError(f"rank 0: {told[1]}")
    return told[0]  # type: ignore[no-any-return]


def load_remote(
    store: ObjectStore, path: str | None, local: Path, map_location: MapLocation
) -> Agreed:
    """Agree on the store's newest committed checkpoint (or ``path``, one of its files); load it.

    Rank 0 reads the manifests and downloads the file into ``local`` (checking
    its SHA-256, then every CRC), and sends the state to the others. All ranks
    must call this, or it deadlocks.

    Raises:
        CheckpointError: the store cannot be used, ``path`` is not one of its
            committed checkpoints, or none of them is intact.
    """
    name = None if path is None else path.removeprefix(store.url + "/")
    loaded: dict[str, Any] = {}

    def fetch() -> tuple[Found | None, int]:
        got = store.fetch(local, name)
        generation = max((int(e.get("generation", 0)) for e in store.files.values()), default=0)
        if got is None:
            return None, generation
        found, file = got
        try:
            loaded["state"] = load_checkpoint(file, map_location)
        finally:
            file.unlink(missing_ok=True)
        return found, generation

    found, generation = shared(fetch)
    if found is None:
        return Agreed(None, None, 0, generation, False, None)
    state = loaded.get("state")
    if get_world_size() > 1:
        state = broadcast_state(state, 0)
    assert state is not None
    return Agreed(state, found, 0, generation, False, None)


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
        extra = extra_of(directory / header.name) if rank in holders else None
        seen = [e for r, e in enumerate(all_gather_object(extra)) if r in holders and e is not None]
        if seen:
            return header.name, seen[0]
    return None


def extra_of(path: Path) -> dict[str, Any] | None:
    """The ``extra`` a ddpkit checkpoint at ``path`` records (its tensors left on disk)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # damaged or gone since the scan: the resume skips it too
        return None
    extra = state.get("extra") if isinstance(state, dict) else None
    return extra if isinstance(extra, dict) else {}


def claim_directory(
    directory: Path, *, writes: bool, overwrite: bool, job: str | None = None
) -> bool:
    """Refuse (or, with ``overwrite``, remove) another run's files in the writing ranks' directory.

    All ranks must call this, or it deadlocks; each rank that ``writes``
    looks in its own ``directory``, and a refusal is raised on every rank.

    Returns:
        True, touching nothing, when every writing rank that holds a run's
        files holds this same launcher ``job``'s (its newest checkpoint
        records it): the run continues, and is resumed instead; False when
        the directory is now this fresh run's.

    Raises:
        CheckpointError: a run's files are there and ``overwrite`` is False.
    """
    files = run_files(directory) if writes else []
    ours = False
    if files and job is not None:
        newest = max(scan(directory)[0], key=lambda f: f.order, default=None)
        ours = newest is not None and newest.job == job
    line = describe_run(directory, files) if files and not overwrite and not ours else None
    views = all_gather_object((get_rank(), files, line, ours))
    if any(view[3] for view in views) and all(view[3] for view in views if view[1]):
        return True  # every directory holding a run's files holds this job's
    taken = [(rank, names, what) for rank, names, what, mine in views if names and not mine]
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
    return False


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
        head = f.read(256)
    if head.startswith(b"\x89PNG") or head.startswith(b"%PDF") or head.startswith(b"<?xml"):
        return "it is an image (the learning curves ddpkit plot draws), not a checkpoint"
    if path.suffix == ".jsonl" or (_is_text(head) and head.lstrip().startswith(b"{")):
        return "it is a text file (metrics.jsonl, the epoch records fit writes), not a checkpoint"
    if reason == "not a ddpkit checkpoint" and _holds_weights(path):
        return (
            "it holds a model's weights alone (best.pth, <prefix>-epoch<N>-acc<a>.pth): no "
            "optimizer or position to resume. Start from them with load_pretrained "
            "(the example's --pretrained PATH)"
        )
    return f"it is not a ddpkit checkpoint ({reason})"


def _is_text(head: bytes) -> bool:
    """Whether a file's first bytes are UTF-8 text (a cut at the end of the read allowed):
    random bytes that happen to start with ``{`` are not."""
    text = head.decode("utf-8", errors="replace")
    return "\ufffd" not in text[:-3] and all(c.isprintable() or c in "\t\r\n" for c in text[:-3])


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
