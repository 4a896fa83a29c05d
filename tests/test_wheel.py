"""The wheel holds the whole package: every package, the command and the example run from it.

The editable install the suite runs on reads ddpkit/ from the source tree, so a
package left out of the wheel (a folder missing from the build's package list,
say) would pass every other test and fail every user. Here the wheel is built,
installed into a fresh virtual environment that sees the dependencies of this
one but not its ddpkit, and imported there, outside the source tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import ddpkit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(
    ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ddpkit").rglob("__init__.py")
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with ddpkit installed from a wheel built now."""
    where = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(where / "dist"),
            str(ROOT),
        ],
        check=True,
        timeout=300,
        cwd=where,
        env=_clean_env(),
    )
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    wheel = next((where / "dist").glob("ddpkit-*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--ignore-installed",
            "-q",
            str(wheel),
        ],
        check=True,
        timeout=300,
        env=_clean_env(),
    )
    # The dependencies come from this environment's site-packages: a path line in a
    # .pth file adds the folder but runs none of its own .pth files, so the editable
    # ddpkit of this environment stays out.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "ddpkit-test-dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    return venv


def _clean_env() -> dict[str, str]:
    """This environment without a PYTHONPATH that would put the source tree first."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = _clean_env()
    return subprocess.run(
        args, capture_output=True, text=True, timeout=300, env=env, cwd=venv.parent
    )


def test_the_wheel_lists_every_package_and_the_typing_marker(installed: Path) -> None:
    wheel = next((installed.parent / "dist").glob("ddpkit-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [p for p in PACKAGES if p.replace(".", "/") + "/__init__.py" not in names]
    assert missing == [], "packages left out of the wheel"
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ddpkit").rglob("*.py")}
    assert sorted(sources - names) == [], "modules left out of the wheel"
    assert "ddpkit/py.typed" in names


def test_every_package_imports_from_the_installed_wheel(installed: Path) -> None:
    code = (
        "import importlib, pathlib, sys\n"
        f"for name in {PACKAGES!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert not pathlib.Path(module.__file__).is_relative_to({str(ROOT)!r}), module\n"
        "    assert 'site-packages' in module.__file__, module.__file__\n"
        "import ddpkit\n"
        "missing = [n for n in ddpkit.__all__ if getattr(ddpkit, n, None) is None]\n"
        "assert not missing, missing\n"
        "print(ddpkit.__file__)\n"
    )
    done = _run(installed, str(installed / "bin" / "python"), "-c", code)
    assert done.returncode == 0, done.stderr
    assert str(installed) in done.stdout


def test_the_command_runs_from_the_installed_wheel(installed: Path) -> None:
    command = installed / "bin" / "ddpkit"
    assert command.is_file(), "the wheel installs no ddpkit command"
    for args in (["--version"], ["lmdb", "--help"], ["doctor", "--help"], ["plot", "--help"]):
        done = _run(installed, str(command), *args)
        assert done.returncode == 0, (args, done.stderr)
        assert done.stdout.strip(), args


@pytest.mark.timeout(600)
def test_the_wheel_runs_the_example_from_any_directory(installed: Path, tmp_path: Path) -> None:
    # What the docs tell a pip user, from a directory outside the checkout.
    python = installed / "bin" / "python"
    env = _clean_env()
    env["OMP_NUM_THREADS"] = "1"
    outside = tmp_path / "elsewhere"
    (outside / "data").mkdir(parents=True)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), *argv], cwd=outside, env=env, capture_output=True, text=True, timeout=200
        )

    # The databases, built here (the format is the wheel's too); then the example from the
    # wheel, in one fresh interpreter of the venv (seconds each: as few as show it).
    for split, source in zip(
        ("train", "val"),
        ddpkit.make_shapes_dataset(
            tmp_path / "src", classes=2, train_per_class=4, val_per_class=2, size=32
        ),
        strict=True,
    ):
        ddpkit.build_lmdb(source, outside / "data" / f"{split}.lmdb", progress=False)
    flags = ["--data", "data", "--arch", "test_resnet", "--image-size", "32", "-b", "4", "-j", "0"]
    trained = run(
        "-c",
        "import runpy, sys, ddpkit.examples.seresnext_lmdb as e\n"
        "print(e.__file__, flush=True)\n"
        f"sys.argv = ['seresnext_lmdb', *{flags!r}, '--epochs', '1']\n"
        "runpy.run_module('ddpkit.examples.seresnext_lmdb', run_name='__main__')",
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert Path(trained.stdout.splitlines()[0]).is_relative_to(installed), trained.stdout
    assert "epoch 1/1: train_loss" in trained.stdout + trained.stderr
    assert (outside / "checkpoints" / "latest.pth").is_file()
