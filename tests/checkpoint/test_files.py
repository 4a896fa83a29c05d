"""ddpkit.checkpoint.files: checkpoint names, headers read without tensors, ordering, pruning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.checkpoint.files import (
    FORMAT,
    INTERRUPTED,
    LATEST,
    VERSION,
    Found,
    averaged,
    newest_first,
    prune_steps,
    read_header,
    scan,
    step_name,
)
from ddpkit.checkpoint.serialization import save_checkpoint


def _save(path: Path, generation: int = 1, step: int = 0, kind: str = "step", epoch: int = 0,
          **extra: Any) -> Path:  # fmt: skip
    state = {"format": FORMAT, "version": VERSION, "kind": kind, "generation": generation,
             "epoch": epoch, "snapshot": f"g{generation}-s{step}-{kind}", "world_size": 2,
             "position": _position(epoch, step, kind), "w": torch.zeros(2), **extra}  # fmt: skip
    save_checkpoint(state, path)
    return path


def _position(epoch: int, step: int, kind: str) -> dict[str, int]:
    """A whole position: mid-epoch for step and interrupted files, an epoch's start otherwise."""
    done = 0 if kind == "epoch" else 1
    return {"epoch": epoch, "batches": done, "samples": 4 * done, "step": step, "world_size": 2}


def _found(name: str, generation: int, step: int, kind: str = "step") -> Found:
    return Found(name, f"g{generation}-s{step}-{kind}", generation, step, kind, 0, 1)


def test_step_names_are_zero_padded_so_they_sort_by_step() -> None:
    assert step_name(7) == "step-000000007.pth"
    assert sorted(step_name(s) for s in (100, 9, 10)) == [step_name(s) for s in (9, 10, 100)]


def test_a_header_is_read_as_saved(tmp_path: Path) -> None:
    path = _save(tmp_path / step_name(12), generation=3, step=12, epoch=4)
    assert read_header(path) == Found(step_name(12), "g3-s12-step", 3, 12, "step", 4, 2)
    old = tmp_path / "old.pth"  # 0.1's format: an epoch end before steps were counted
    save_checkpoint({"format": FORMAT, "version": 1, "epoch": 2, "model": {}}, old)
    assert read_header(old) == Found("old.pth", "v1:old.pth:2", 0, 0, "epoch", 3, 1)


def test_foreign_newer_and_damaged_files_are_value_errors(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.pth"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ValueError, match="not a ddpkit checkpoint"):
        read_header(foreign)
    torch.save([1, 2], foreign)
    with pytest.raises(ValueError, match="not a ddpkit checkpoint"):
        read_header(foreign)
    newer = _save(tmp_path / "newer.pth", version=VERSION + 1)
    with pytest.raises(ValueError, match=f"newer ddpkit \\(format version {VERSION + 1}\\)"):
        read_header(newer)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"PK\x03\x04 not a zip at all" * 10)
    with pytest.raises(ValueError, match=r"\w+Error: "):  # the loader's own reason
        read_header(garbage)
    with pytest.raises(FileNotFoundError):
        read_header(tmp_path / "missing.pth")


def test_scan_lists_the_checkpoints_and_the_unreadable(tmp_path: Path) -> None:
    assert scan(tmp_path / "missing") == ([], [])
    _save(tmp_path / LATEST, step=4, kind="epoch", epoch=1)
    _save(tmp_path / step_name(3), step=3)
    (tmp_path / step_name(5)).write_bytes(b"")  # a damaged step checkpoint
    _save(tmp_path / "m-epoch1-acc0.00.pth")  # weights and other files are not checkpoints
    found, bad = scan(tmp_path)
    assert [f.name for f in found] == [LATEST, step_name(3)]
    assert [name for name, _ in bad] == [step_name(5)]
    assert bad[0][1]  # with the reason


def test_newest_first_orders_one_generation_and_names_the_holders() -> None:
    epoch = _found(LATEST, 2, 8, "epoch")
    interrupted = _found(INTERRUPTED, 2, 8, "interrupted")
    step = _found(step_name(6), 2, 6)
    older_run = _found(step_name(50), 1, 50)  # more steps, but another run
    ordered = newest_first([[step, older_run, interrupted], [epoch, step], []])
    assert ordered == [(epoch, [1]), (interrupted, [0]), (step, [0, 1])]
    assert newest_first([[], []]) == []


def test_averaged_keeps_the_averaged_network_only() -> None:
    w = torch.ones(2)
    state = {"module.0.weight": w, "module.bn.running_mean": w, "n_averaged": torch.tensor(3)}
    assert averaged(state) == {"0.weight": w, "bn.running_mean": w}
    assert averaged({}) == {}


def test_prune_steps_keeps_the_newest_of_this_generation(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _save(tmp_path / step_name(step), generation=2, step=step)
    _save(tmp_path / step_name(1), generation=1, step=1)  # an earlier run's
    _save(tmp_path / INTERRUPTED, generation=2, step=5, kind="interrupted")
    prune_steps(tmp_path, keep=2, generation=2, newest_step=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(6), step_name(8)]
    prune_steps(tmp_path, keep=0, generation=2, newest_step=8)
    assert list(tmp_path.iterdir()) == []


def test_an_older_runs_later_steps_do_not_take_this_runs_places(tmp_path: Path) -> None:
    _save(tmp_path / step_name(50), generation=1, step=50)  # the earlier run got further
    _save(tmp_path / step_name(2), generation=2, step=2)  # the new run's first step checkpoint
    prune_steps(tmp_path, keep=1, generation=2, newest_step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(2)]


@pytest.mark.parametrize(("step", "kept"), [(9, True), (8, True), (7, False)])
def test_interrupted_stays_until_a_later_checkpoint_exists(
    tmp_path: Path, step: int, kept: bool
) -> None:
    _save(tmp_path / INTERRUPTED, generation=1, step=step, kind="interrupted")
    prune_steps(tmp_path, keep=3, generation=1, newest_step=8)
    assert (tmp_path / INTERRUPTED).exists() is kept


def test_a_damaged_interrupted_checkpoint_is_pruned(tmp_path: Path) -> None:
    (tmp_path / INTERRUPTED).write_bytes(b"\0" * 100)
    prune_steps(tmp_path, keep=3, generation=1, newest_step=0)
    assert not (tmp_path / INTERRUPTED).exists()
