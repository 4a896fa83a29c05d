"""``make check``: which tests a change of the working tree touches, for the inner loop.

Prints the test paths for pytest, one per line: for each changed file (staged,
unstaged or new, against ``HEAD``) of ``ddpkit/<part>/...`` the tests of that
part (``tests/<part>``), of a top-level ``ddpkit/<module>.py`` its
``tests/test_<module>.py`` (or the whole of ``tests/`` when it has none, as for
``ddpkit/__init__.py``), and a changed test file itself. Nothing changed, or
a change elsewhere (the build, ``tests/conftest.py``, a helper): ``tests``,
every single-process test. ``make check`` runs them without the tests that
start several processes (marker ``serial``), which ``make test`` runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def changed_files() -> list[str]:
    """The files the working tree changes against HEAD, new ones included."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line[3:].split(" -> ")[-1] for line in out.splitlines() if len(line) > 3]


def paths_for(files: list[str]) -> list[str]:
    """The test paths that cover ``files``; ``["tests"]`` when one of them is not mapped."""
    paths: set[str] = set()
    for name in files:
        parts = Path(name).parts
        if name.endswith(".md") or parts[0] in ("benchmarks", "examples") or name == "CHANGELOG.md":
            continue  # the docs' and benchmarks' runs are multi-process: make test
        if parts[0] == "ddpkit" and len(parts) > 2 and (ROOT / "tests" / parts[1]).is_dir():
            paths.add(f"tests/{parts[1]}")
        elif parts[0] == "ddpkit" and len(parts) == 2:
            mirror = ROOT / "tests" / f"test_{Path(parts[1]).stem}.py"
            if not mirror.is_file():
                return ["tests"]
            paths.add(mirror.relative_to(ROOT).as_posix())
        elif parts[0] == "tests" and name.endswith(".py") and Path(name).name.startswith("test_"):
            if (ROOT / name).is_file():
                paths.add(name)
        else:
            return ["tests"]
    return sorted(paths) or ["tests"]


if __name__ == "__main__":
    print("\n".join(paths_for(sys.argv[1:] or changed_files())))
