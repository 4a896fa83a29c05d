"""rank0_only and rank0_first, with and without a process group."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ddpkit import Rank0Error, rank0_first, rank0_only, save_checkpoint
from ddpkit.distributed.comm import barrier, get_rank
from ddpkit.testing import run_distributed


@rank0_only
def _plain() -> str:
    return f"ran on {get_rank()}"


@rank0_only(sync=True)
def _write_into(path: str) -> str:
    save_checkpoint({"a": 1}, path)
    return "written"


def _rank0_helpers(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {"plain": _plain()}
    out["synced"] = _write_into(os.path.join(directory, f"ok{rank}.pth"))
    with rank0_first():
        marker = Path(directory, "first")
        out["saw_marker"] = marker.exists()
        if rank == 0:
            marker.write_text("rank 0 was here")
    try:
        # The parent is a regular file: fails for everyone, root included.
        _write_into(os.path.join(directory, "first", "ckpt.pth"))
        out["error"] = None
    except Rank0Error as e:
        out["error"] = ("Rank0Error", e.exc_type, str(e), e.remote_traceback)
    except OSError as e:
        out["error"] = ("own", type(e).__name__, str(e), "")
    barrier()  # every rank got here: nobody hangs in the next collective
    return out


@pytest.fixture(scope="module")
def two_rank_helpers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    directory = tmp_path_factory.mktemp("helpers")
    return directory, run_distributed(_rank0_helpers, 2, args=(str(directory),), timeout=90)


def test_rank0_only_inside_a_process_group(two_rank_helpers: tuple[Path, list[Any]]) -> None:
    tmp_path, (r0, r1) = two_rank_helpers
    assert (r0["plain"], r1["plain"]) == ("ran on 0", None)
    assert (r0["synced"], r1["synced"]) == ("written", None)
    assert (tmp_path / "ok0.pth").exists()
    assert not (tmp_path / "ok1.pth").exists()
    assert (r0["saw_marker"], r1["saw_marker"]) == (False, True)
    assert r0["error"][:2] == ("own", "NotADirectoryError")
    kind, exc_type, message, remote = r1["error"]
    assert (kind, exc_type) == ("Rank0Error", "NotADirectoryError")
    assert "rank 0 raised NotADirectoryError" in message
    assert "not a directory" in message
    assert "save_checkpoint" in remote


def test_rank0_only_without_a_process_group(tmp_path: Path) -> None:
    assert _plain() == "ran on 0"
    assert _write_into(str(tmp_path / "a.pth")) == "written"
    with pytest.raises(FileNotFoundError):
        _write_into(str(tmp_path / "missing" / "a.pth"))
