"""``make check``'s choice of tests: a change's part, its mirror, or everything."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from changed import paths_for  # type: ignore[import-not-found]


def test_a_change_in_a_part_runs_that_parts_tests() -> None:
    assert paths_for(["ddpkit/data/resume.py", "ddpkit/data/streams.py"]) == ["tests/data"]
    assert paths_for(["ddpkit/training/guard.py", "ddpkit/checkpoint/state.py"]) == [
        "tests/checkpoint",
        "tests/training",
    ]


def test_a_top_level_module_runs_its_mirror_else_everything() -> None:
    assert paths_for(["ddpkit/position.py"]) == ["tests/test_position.py"]
    assert paths_for(["ddpkit/__init__.py"]) == ["tests"]


def test_a_changed_test_runs_itself_and_anything_else_runs_everything() -> None:
    assert paths_for(["tests/data/test_streams.py"]) == ["tests/data/test_streams.py"]
    assert paths_for(["tests/conftest.py"]) == ["tests"]
    assert paths_for(["Makefile", "ddpkit/data/resume.py"]) == ["tests"]
    assert paths_for([]) == ["tests"]
    assert paths_for(["docs/data.md"]) == ["tests"]  # the docs run in make test
