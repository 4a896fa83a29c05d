"""The example a pip user is told to run is in the wheel, and runs from outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_the_wheel_runs_the_example_from_any_directory(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
        capture_output=True,
        timeout=200,
    )
    (wheel,) = wheels.glob("ddpkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ddpkit/examples/seresnext_lmdb.py" in names
    assert "ddpkit/examples/seresnext_setup.py" in names
    # A fresh environment with the wheel alone; torch, timm ... come from this one's
    # site-packages through a .pth line, which does not run that directory's own .pth
    # files, so the editable ddpkit of this checkout is not seen there.
    # Without PYTHONPATH: pip would take this checkout for the package already installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=200,
        env=env,
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "shared.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env["OMP_NUM_THREADS"] = "1"
    outside = tmp_path / "elsewhere"
    (outside / "data").mkdir(parents=True)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), *argv], cwd=outside, env=env, capture_output=True, text=True, timeout=200
        )

    where = run("-c", "import ddpkit.examples.seresnext_lmdb as m; print(m.__file__)")
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    helped = run("-m", "ddpkit.examples.seresnext_lmdb", "--help")
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "--demo" in helped.stdout
    # What the docs tell a pip user, on tiny data: build the databases, train, evaluate.
    made = run(
        "-c",
        "import ddpkit; from ddpkit.data.shapes import make_shapes_dataset as m\n"
        "for split, src in zip(('train', 'val'), m('src', classes=2, train_per_class=4, "
        "val_per_class=2, size=32)):\n"
        "    ddpkit.build_lmdb(src, f'data/{split}.lmdb', progress=False)",
    )
    assert made.returncode == 0, made.stderr[-2000:]
    flags = ["--data", "data", "--arch", "test_resnet", "--image-size", "32", "-b", "4", "-j", "0"]
    trained = run("-m", "ddpkit.examples.seresnext_lmdb", *flags, "--epochs", "1")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "epoch 1/1: train_loss" in trained.stdout + trained.stderr
    assert (outside / "checkpoints" / "latest.pth").is_file()
    evaluated = run("-m", "ddpkit.examples.seresnext_lmdb", *flags, "--evaluate")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "acc1" in evaluated.stdout
