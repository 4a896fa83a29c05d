"""The example's ``--config FILE`` refuses what it cannot take, in one line, before any work.

Kinds: a value of every type for every flag (taken as the flag takes its text on the command
line, or refused naming the key); files that are not regular files (a device, a FIFO, a socket,
a directory, a dangling link), too large, empty, not UTF-8, unreadable or nested too deeply;
tracker names that are unknown, repeated or oddly spaced, on the command line, in a file and in
``ReportConfig``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from warm import warm_run  # type: ignore[import-not-found]

import ddpkit
from ddpkit import ReportConfig
from ddpkit.command_line import MAX_BYTES
from ddpkit.examples import seresnext_flags
from ddpkit.examples import seresnext_lmdb as example

# Every type a YAML file can give a value, and the odd values of each.
_VALUES: list[Any] = [
    True,
    False,
    None,
    0,
    7,
    -1,
    2.5,
    "7",
    "",
    "x y",
    "10:20",
    "mlflow, wandb",
    [],
    [3],
    [1, 2],
    ["a", "b"],
    [[1]],
    [None],
    [True],
    {"a": 1},
    datetime.date(2024, 1, 1),
]
_FLAGS = [
    a
    for a in ddpkit.CommandLine.define(seresnext_flags.FLAGS).actions
    if a.option_strings and a.dest not in ("help", "config")
]


def _parse(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[Any, list[str]]:
    """``(args, [])`` when ``argv`` parses, else ``(None, stderr's lines)`` after exit status 2."""
    code: object = None
    try:
        args = example.parse_args(argv)
    except SystemExit as exited:
        code = exited.code
    err = capsys.readouterr().err
    if code is None:
        return args, []
    assert code == 2, err
    assert "Traceback" not in err
    return None, err.splitlines()


def _text(item: Any) -> str | None:
    """The command-line text of one value, or None where the command line has none."""
    if isinstance(item, bool) or not isinstance(item, str | int | float):
        return None
    return item if isinstance(item, str) else repr(item)


def _command_line(action: argparse.Action, value: Any) -> list[str] | None:
    """What a person types for ``value``, or None where nothing typed says it."""
    flag = action.option_strings[-1]
    if value is None:
        return [] if action.default is None else None
    if action.nargs == 0 or (action.nargs == "?" and isinstance(value, bool)):
        if not isinstance(value, bool):
            return None
        return [flag] if value else ([] if not action.default else None)
    if isinstance(value, list):
        texts = [_text(v) for v in value]
        if action.nargs not in ("*", "+") or None in texts:
            return None
        return [flag, *texts]  # type: ignore[list-item]
    text = _text(value)
    return None if text is None else [f"{flag}={text}"]


@pytest.mark.parametrize("action", _FLAGS, ids=[a.dest for a in _FLAGS])
def test_every_flag_takes_any_value_as_its_text_or_refuses_it_naming_the_key(
    action: argparse.Action, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [] if action.dest == "data" else ["--data", "d"]
    file = tmp_path / "c.yaml"
    for value in _VALUES:
        file.write_text(yaml.safe_dump({action.dest: value}))
        args, err = _parse([*base, "--config", str(file)], capsys)
        typed = _command_line(action, value)
        said = f"value {value!r}: {err}"
        if args is not None:  # taken: as the command line's text would be
            assert typed is not None, said
            expected, _ = _parse([*base, *typed], capsys)
            assert expected is not None, said
            assert getattr(args, action.dest) == getattr(expected, action.dest), said
            continue
        if err[-1].split("error: ", 1)[-1].startswith("--config"):  # the file's value: one line
            assert len(err) == 1, said
            assert f"key '{action.dest}'" in err[0], said
        else:  # a check between flags, as on the command line
            assert typed is not None, said
            _, typed_err = _parse([*base, *typed], capsys)
            assert typed_err[-1:] == err[-1:], said


def _config_error(path: Path | str, capsys: pytest.CaptureFixture[str]) -> str:
    args, err = _parse(["--data", "d", "--config", str(path)], capsys)
    assert args is None
    assert len(err) == 1, err  # one line, no usage
    assert f"error: --config {path}" in err[0]
    return err[0]


def test_a_link_to_a_device_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "null.yaml").symlink_to(os.devnull)
    said = _config_error(tmp_path / "null.yaml", capsys)
    assert f"(a link to {os.devnull}): is a character device, not a regular file" in said


def test_a_directory_a_socket_and_a_missing_file_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "d.yaml").mkdir()
    assert "is a directory; name the .yaml or .toml file in it" in _config_error(
        tmp_path / "d.yaml", capsys
    )
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "s.yaml"))
        assert "is a socket, not a regular file" in _config_error(tmp_path / "s.yaml", capsys)
    assert "not found; check the path" in _config_error(tmp_path / "none.yaml", capsys)
    (tmp_path / "gone.yaml").symlink_to(tmp_path / "nowhere.yaml")
    said = _config_error(tmp_path / "gone.yaml", capsys)
    assert "is a link to" in said
    assert "which does not exist" in said


def test_a_file_over_the_limit_is_refused_and_one_at_it_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(2 * MAX_BYTES)  # sparse: no disk is used
    said = _config_error(big, capsys)
    assert f"holds {2 * MAX_BYTES} bytes, and a config file holds at most 1 MiB" in said
    line = b"epochs: 3\n"
    at_limit = tmp_path / "limit.yaml"
    at_limit.write_bytes(line + b"#" * (MAX_BYTES - len(line) - 1) + b"\n")
    assert example.parse_args(["--data", "d", "--config", str(at_limit)]).epochs == 3
    at_limit.write_bytes(at_limit.read_bytes() + b"\n")
    assert "at most 1 MiB" in _config_error(at_limit, capsys)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "is empty; write flag: value lines, or drop --config"),
        (b"  \n\n", "is empty"),
        (b"# nothing yet\n", "holds no flag: value"),
        (b"{}\n", "holds no flag: value"),
        (b"epochs: 3\narch: caf\xe9\n", "is not UTF-8 text (byte 0xe9 on line 2); save it as"),
        (b"\x00\x01\x02", "not valid YAML"),
        (b"epochs: [\n", "not valid YAML: expected the node content"),
        (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
        (b"epochs: !!python/object:os.system ls\n", "not valid YAML"),
        (b"when: 2024-02-30\n", "not valid YAML"),
    ],
)
def test_a_file_that_is_no_table_of_text_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, said: str
) -> None:
    (tmp_path / "c.yaml").write_bytes(content)
    assert said in _config_error(tmp_path / "c.yaml", capsys)


def test_a_byte_order_mark_is_read_past(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_bytes(b"\xef\xbb\xbfepochs = 3\n")
    assert example.parse_args(["--data", "d", "--config", str(tmp_path / "c.toml")]).epochs == 3


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_an_unreadable_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c.yaml").write_text("epochs: 3\n")
    (tmp_path / "c.yaml").chmod(0)
    assert "cannot be read: permission denied" in _config_error(tmp_path / "c.yaml", capsys)


def test_a_link_to_dev_zero_is_refused_without_reading_it(tmp_path: Path) -> None:
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    code = (
        "from ddpkit import load_config\n"
        "try:\n"
        f"    load_config({str(tmp_path / 'zero.yaml')!r})\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )

    def small_memory() -> None:  # reading /dev/zero would end in a MemoryError here
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=small_memory,
    )
    assert done.returncode == 0, done.stderr
    assert "(a link to /dev/zero): is a character device, not a regular file" in done.stdout


def test_a_fifo_config_ends_the_example_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)  # no writer: reading it would wait forever
    cmd = [sys.executable, "-m", "ddpkit.examples.seresnext_lmdb", "--data", str(tmp_path)]
    cmd += ["--config", str(fifo), "--checkpoints", str(tmp_path / "ck")]
    done = warm_run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"python -m ddpkit.examples.seresnext_lmdb: error: --config {fifo}: is a FIFO (named "
        "pipe), not a regular "
        "file; write the flags to a file and pass that"
    )
    assert not (tmp_path / "ck").exists()  # nothing started


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--log-with", "mlflow, wandb"], ("mlflow", "wandb")),
        (["--log-with", "mlflow,wandb"], ("mlflow", "wandb")),
        (["--log-with", "mlflow,", "wandb"], ("mlflow", "wandb")),  # the shell split the space
        (["--log-with", "MLflow,TensorBoard"], ("mlflow", "tensorboard")),
        (["--log-with", "wandb,wandb", "wandb"], ("wandb",)),
    ],
)
def test_tracker_names_are_read_however_they_are_spaced(
    argv: list[str], names: tuple[str, ...]
) -> None:
    assert example.parse_args(["--data", "d", *argv]).log_with == names


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--log-with", "mlflaw"], "unknown tracker 'mlflaw' (did you mean 'mlflow'?)"),
        (["--log-with", "mlflow, neptune"], "unknown tracker 'neptune'"),
        (["--log-with", ""], "'' names no tracker"),
        (["--log-with", " , "], "' , ' names no tracker"),
    ],
)
def test_an_unknown_tracker_is_refused_with_the_known_ones(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args, err = _parse(["--data", "d", *argv], capsys)
    assert args is None
    assert err[-1].endswith(
        f"argument --log-with: {said}; the trackers are tensorboard, mlflow, wandb"
    )


def test_a_tracker_that_is_not_installed_is_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec: not importable
    args, err = _parse(["--data", "d", "--log-with", "mlflow,wandb"], capsys)
    assert args is None
    assert err[-1].endswith(
        'argument --log-with: wandb is not installed: pip install "ddpkit[wandb]"'
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("log_with: mlflaw\n", "key 'log_with': 'mlflaw': --log-with: unknown tracker 'mlflaw'"),
        ("log_with: [mlflow, 5]\n", "--log-with: unknown tracker '5'"),
        ("log_with: [mlflow, true]\n", "--log-with takes NAMES, not true or false"),
        ("log_with: {mlflow: 1}\n", "--log-with takes NAMES, not a table"),
        ("log_with: []\n", "--log-with takes at least one value"),
    ],
)
def test_a_files_unknown_tracker_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str
) -> None:
    (tmp_path / "c.yaml").write_text(text)
    assert said in _config_error(tmp_path / "c.yaml", capsys)


@pytest.mark.parametrize(
    ("trackers", "said"),
    [
        (("neptune",), "unknown tracker 'neptune'"),
        ("mlflaw", "unknown tracker 'mlflaw' (did you mean 'mlflow'?)"),
        ("", "'' names no tracker"),
        (("mlflow", 5), "5 (int) is not a tracker name"),
        (5, "5 (int) is not a string or a tuple"),
        (b"mlflow", "(bytes) is not a string or a tuple"),
    ],
)
def test_report_config_refuses_tracker_names_fit_cannot_use(trackers: Any, said: str) -> None:
    with pytest.raises(ValueError, match="trackers must be a tuple of") as refused:
        ReportConfig(trackers=trackers)
    assert said in str(refused.value)
    assert "\n" not in str(refused.value)
