"""The ``ddpkit`` console script."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import ddpkit
from ddpkit.cli import main


def _console_script() -> str:
    # The script pip installed beside this interpreter (the venv's bin/).
    candidate = Path(sys.executable).with_name("ddpkit")
    found = str(candidate) if candidate.exists() else shutil.which("ddpkit")
    assert found, "the ddpkit console script is not installed"
    return found


def test_console_script_version() -> None:
    out = subprocess.run(
        [_console_script(), "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ddpkit {ddpkit.__version__}"


def test_version_is_the_installed_one_and_has_a_changelog_section() -> None:
    assert importlib.metadata.version("ddpkit") == ddpkit.__version__
    version = Version(ddpkit.__version__)  # a valid PEP 440 version
    changelog = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    # A release has its own section; a development version collects under Unreleased.
    heading = "## [Unreleased]" if version.is_devrelease else f"## [{version}]"
    assert heading in changelog


def test_python_dash_m_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ddpkit", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: ddpkit")


def test_main_without_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "usage: ddpkit" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "command", "unknown"),
    [
        (["lmdb", "build", "a", "b", "--bogus"], "lmdb build", "--bogus"),
        (["lmdb", "verify", "db", "--bogus", "x"], "lmdb verify", "--bogus x"),
        (["lmdb", "info", "db", "extra"], "lmdb info", "extra"),
        (["doctor", "--bogus"], "doctor", "--bogus"),
        (["--bogus"], "", "--bogus"),  # before any sub-command: the top level's usage
    ],
)
def test_unknown_arguments_print_the_usage_of_the_command_given(
    argv: list[str], command: str, unknown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = f"ddpkit {command}".strip()
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} [-h]")
    assert err.endswith(f"{prog}: error: unrecognized arguments: {unknown}\n")


def test_unknown_option_from_the_console_script() -> None:
    out = subprocess.run(
        [_console_script(), "lmdb", "build", "a", "b", "--bogus"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith("usage: ddpkit lmdb build [-h]")
    assert "ddpkit lmdb build: error: unrecognized arguments: --bogus" in out.stderr
    assert "Traceback" not in out.stderr


# Run the command in a fresh interpreter, then say which heavy libraries it imported.
_IMPORTED = (
    "import sys; from ddpkit.cli import main; status = main(sys.argv[1:]); "
    "print(*sorted(m for m in ('torch', 'torchvision', 'timm') if m in sys.modules)); "
    "sys.exit(status)"
)


def test_reading_commands_start_without_torch(tmp_path: Path) -> None:
    # `ddpkit lmdb info` reads the index, `ddpkit plot` the metrics: neither needs torch
    # (each costs seconds to import); `ddpkit lmdb verify` decodes, so it does.
    pytest.importorskip("matplotlib")
    from ddpkit.data import make_shapes_dataset

    train, _ = make_shapes_dataset(
        tmp_path / "images", classes=2, train_per_class=2, val_per_class=1, size=16
    )
    assert main(["lmdb", "build", str(train), str(tmp_path / "db"), "--no-progress"]) == 0
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        '{"epoch": 1, "train_loss": 1.0, "val_loss": 1.1, "val_acc1": 50.0, "lr": 0.1}\n'
    )
    commands = {
        "info": (["lmdb", "info", str(tmp_path / "db"), "--json"], ""),
        "plot": (["plot", str(tmp_path / "run"), "-o", str(tmp_path / "c.png")], ""),
        "verify": (["lmdb", "verify", str(tmp_path / "db"), "--no-progress"], "torch"),
    }
    for name, (args, imported) in commands.items():
        done = subprocess.run(
            [sys.executable, "-c", _IMPORTED, *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{name}: {done.stderr}"
        assert done.stdout.splitlines()[-1] == imported, name
