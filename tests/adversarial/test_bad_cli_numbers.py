"""Every numeric flag of every ``ddpkit`` command, given 0, -1, huge and non-numbers.

Refused by argparse before any work: exit code 2, the flag named, no traceback. The
library functions behind the flags refuse the same values with a ValueError or TypeError.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from corpus import image_tree

from ddpkit.cli import MAX_MAP_SIZE, MAX_THREADS, MIN_MAP_SIZE, build_parser, main
from ddpkit.data import build_lmdb, verify_report
from ddpkit.data.lmdb_build import MAX_MAP_SIZE as LIBRARY_MAX_MAP_SIZE
from ddpkit.data.lmdb_build import MIN_MAP_SIZE as LIBRARY_MIN_MAP_SIZE
from ddpkit.data.threads import MAX_WORKERS

# The positional arguments each command needs to reach its options.
_COMMANDS = {
    ("lmdb", "build"): ["SRC", "OUT"],
    ("lmdb", "verify"): ["DB"],
    ("lmdb", "info"): ["DB"],
    ("doctor",): [],
    ("plot",): ["RUN"],
}
HUGE = "99999999999999999999999"
# Flags with no upper bound: a huge value is a valid (if odd) request.
UNBOUNDED = {"--max-side", "--world-size", "--max-pixels"}


def _subparser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _numeric_flags() -> list[tuple[tuple[str, ...], str]]:
    """``(command, flag)`` of every option that parses a number, found in the parser itself."""
    found = []
    for path in _COMMANDS:
        for action in _subparser(path)._actions:
            if action.option_strings and action.type not in (None, str):
                found.append((path, action.option_strings[-1]))
    return found


def test_the_numeric_flags_are_found() -> None:
    flags = {flag for _, flag in _numeric_flags()}
    assert {"--workers", "--map-size", "--quality", "--master-port", "--timeout"} <= flags


def _refused(
    path: tuple[str, ...], flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> str:
    with pytest.raises(SystemExit) as stop:
        main([*path, *_COMMANDS[path], flag, value])
    err = capsys.readouterr().err
    assert stop.value.code == 2, (flag, value, err)
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("path", "flag"), _numeric_flags())
def test_zero_negative_and_junk_are_refused_naming_the_flag(
    path: tuple[str, ...], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    values = ["0", "-1", "abc", "1.5x", ""]
    if flag not in UNBOUNDED:
        values.append(HUGE + ("T" if flag == "--map-size" else ""))
    if flag == "--timeout":
        values += ["1e300", "inf", "nan"]
    for value in values:
        err = _refused(path, flag, value, capsys)
        assert f"argument {flag}" in err or f"/{flag}:" in err, (flag, value, err)
        assert "error: argument" in err


def test_the_issues_examples(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(("lmdb", "verify"), "-j", "-1", capsys)
    assert "argument -j/-w/--workers: -1 is out of range: use 1..1024" in err
    assert "max_workers" not in err
    err = _refused(("lmdb", "build"), "--map-size", "99999T", capsys)
    assert "argument --map-size: '99999T'" in err
    assert "use 4K to 64T" in err


def test_the_cli_limits_are_the_librarys() -> None:
    assert (MAX_THREADS, MIN_MAP_SIZE, MAX_MAP_SIZE) == (
        MAX_WORKERS,
        LIBRARY_MIN_MAP_SIZE,
        LIBRARY_MAX_MAP_SIZE,
    )


def test_the_largest_map_size_builds(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs", per_class=1)
    assert (
        main(
            ["lmdb", "build", str(tree), str(tmp_path / "db"), "--map-size", "64T", "--no-progress"]
        )
        == 0
    )


@pytest.mark.parametrize("size", [0, -1, 4095, MAX_MAP_SIZE + 1, 99999 << 40])
def test_build_lmdb_refuses_a_map_size_out_of_range(tmp_path: Path, size: int) -> None:
    tree = image_tree(tmp_path / "imgs", per_class=1)
    expected = rf"map_size must lie in 4096\.\.{MAX_MAP_SIZE} .*got {size}"
    with pytest.raises(ValueError, match=expected):
        build_lmdb(tree, tmp_path / "db", map_size=size, progress=False)
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize(
    ("workers", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (MAX_WORKERS + 1, ValueError),
        (2**70, ValueError),
        (True, TypeError),
        (1.5, TypeError),
        ("4", TypeError),
    ],
)
def test_build_and_verify_refuse_a_thread_count_out_of_range(
    tmp_path: Path, workers: Any, error: type[Exception]
) -> None:
    tree = image_tree(tmp_path / "imgs", per_class=1)
    with pytest.raises(error, match="workers must"):
        build_lmdb(tree, tmp_path / "db", workers=workers, progress=False)
    build_lmdb(tree, tmp_path / "db", progress=False)
    with pytest.raises(error, match="workers must"):
        verify_report(tmp_path / "db", workers=workers)
