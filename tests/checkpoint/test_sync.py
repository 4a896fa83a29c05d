"""ddpkit.checkpoint.sync: ranks agreeing on the checkpoint to resume from, and loading it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.checkpoint.files import FORMAT, LATEST, VERSION, step_name
from ddpkit.checkpoint.outcomes import share_outcome
from ddpkit.checkpoint.serialization import CheckpointError, save_checkpoint
from ddpkit.checkpoint.sync import claim_directory, load_newest, next_generation
from ddpkit.position import Position
from ddpkit.testing import run_distributed


def _state(step: int, kind: str, generation: int = 1, value: float = 0.0) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "kind": kind, "generation": generation,
            "epoch": 0, "snapshot": f"g{generation}-s{step}-{kind}", "world_size": 2,
            "position": _position(step, kind), "w": torch.full((3,), value)}  # fmt: skip


def _position(step: int, kind: str) -> dict[str, int]:
    """A whole position: the next epoch's start after an epoch file, mid-epoch otherwise."""
    if kind == "epoch":
        return Position(1, 0, 0, step, 2).as_dict()
    return Position(0, 1, 4, step, 2).as_dict()


def _agree(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each rank has its own directory (no shared file system); several agreements in a row."""
    mine = Path(root) / f"rank{rank}"
    out: dict[str, Any] = {}
    # 1. Only rank 0 holds the newest checkpoint: rank 1 is sent it.
    (mine / "a").mkdir(parents=True)
    if rank == 0:
        save_checkpoint(_state(8, "epoch", value=8.0), mine / "a" / LATEST)
    else:
        save_checkpoint(_state(6, "step", value=6.0), mine / "a" / step_name(6))
    got = load_newest(mine / "a", None, "cpu")
    assert got.state is not None
    assert got.found is not None
    out["a"] = (got.found.name, got.source, float(got.state["w"][0]), got.file is not None,
                got.generation, got.latest_damaged)  # fmt: skip
    # 2. Rank 0's latest.pth is damaged: the next newest, on rank 1, for everyone.
    (mine / "b").mkdir()
    if rank == 0:
        (mine / "b" / LATEST).write_bytes(b"\0" * 200)
    else:
        save_checkpoint(_state(6, "step", value=6.0), mine / "b" / step_name(6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = load_newest(mine / "b", None, "cpu")
    assert got.state is not None
    assert got.found is not None
    out["b"] = (got.found.name, got.source, float(got.state["w"][0]), got.latest_damaged,
                [str(w.message) for w in caught])  # fmt: skip
    # 3. Nothing anywhere: a fresh start; the next generation is 1 past any rank's.
    empty = load_newest(mine / "none", None, "cpu")
    out["c"] = (empty.state, empty.found, empty.generation)
    out["generation"] = next_generation(mine / "a")
    # 4. An explicit file that no rank can read.
    try:
        load_newest(mine / "a", mine / "missing.pth", "cpu")
    except CheckpointError as exc:
        out["d"] = str(exc)
    # 5. A failed blocking save reaches every rank.
    try:
        share_outcome(OSError("disk full") if rank == 1 else None, "epoch")
    except (CheckpointError, OSError) as exc:
        out["e"] = f"{type(exc).__name__}: {exc}"
    # 6. A torchrun job's workers started again: its own checkpoints continue only when every
    # directory holding a run's files holds the job's (rank 1's: another job's, then none).
    claims = []
    for case, other in (("f", "job-2"), ("g", None)):
        (mine / case).mkdir()
        job = "job-1" if rank == 0 else other
        if job is not None:
            save_checkpoint({**_state(4, "step"), "job": job}, mine / case / step_name(4))
        try:
            claims.append(claim_directory(mine / case, writes=True, overwrite=False, job="job-1"))
        except CheckpointError as exc:
            claims.append(str(exc))
    out["f"] = claims
    return out


@pytest.mark.timeout(180)
def test_two_ranks_with_their_own_directories_agree(tmp_path: Path) -> None:
    zero, one = run_distributed(_agree, 2, args=(str(tmp_path),), timeout=150)
    assert zero["a"] == (LATEST, 0, 8.0, True, 1, False)
    assert one["a"] == (LATEST, 0, 8.0, False, 1, False)  # sent by rank 0, not read
    assert zero["b"][:4] == (step_name(6), 1, 6.0, True)  # its own latest.pth is damaged
    assert one["b"][:4] == (step_name(6), 1, 6.0, False)
    assert any("is damaged and cannot be loaded" in w for w in zero["b"][4])
    assert one["b"][4] == []  # warned once, by the rank that found it
    assert zero["c"] == one["c"] == (None, None, 0)
    assert zero["generation"] == one["generation"] == 2
    assert "missing.pth" in zero["d"]
    assert "is not a checkpoint on any rank" in zero["d"]
    assert "is not a checkpoint on any rank" in one["d"]
    assert zero["e"] == (
        "CheckpointError: rank 1 could not write its copy of the epoch checkpoint: "
        "OSError: disk full"
    )
    assert one["e"] == "OSError: disk full"
    for claims in (zero["f"], one["f"]):  # every rank refuses, naming the rank
        refused, continued = claims
        assert "(on rank 1) holds another run's checkpoints: step-000000004.pth" in refused
        assert continued is True
