"""``ddpkit lmdb build / info / verify``."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import lmdb
import numpy as np
import pytest
from PIL import Image
from warm import warm_popen, warm_run  # type: ignore[import-not-found]

from ddpkit.cli import build_parser, main
from ddpkit.data.lmdb_format import read_index
from ddpkit.data.lmdb_index import sample_key


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Six small JPEG crops of a real photograph in two classes."""
    from sklearn.datasets import load_sample_images

    photo = load_sample_images().images[0]
    root = tmp_path / "tree"
    for i in range(6):
        (root / f"class{i % 2}").mkdir(parents=True, exist_ok=True)
        crop = photo[20 * i : 20 * i + 48, 30 * i : 30 * i + 64]
        Image.fromarray(np.ascontiguousarray(crop)).save(root / f"class{i % 2}" / f"{i}.jpg")
    return root


def _build(tree: Path, output: Path, *extra: str) -> int:
    return main(["lmdb", "build", str(tree), str(output), "--no-progress", *extra])


def test_build_info_verify(tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "db"
    assert _build(tree, db, "--workers", "2", "--map-size", "64K", "--check", "decode") == 0
    out = capsys.readouterr().out
    assert f"wrote 6 samples in 2 classes to {db}" in out
    assert "0 skipped" in out

    assert main(["lmdb", "info", str(db)]) == 0
    out = capsys.readouterr().out
    assert "samples:  6" in out
    assert "format:   ddpkit-lmdb version 1" in out
    assert "      0  class0  3" in out.splitlines()
    assert "      1  class1  3" in out.splitlines()

    assert main(["lmdb", "info", str(db), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["samples"] == 6
    assert info["classes"] == {"class0": 3, "class1": 3}

    assert main(["lmdb", "verify", str(db), "--workers", "2"]) == 0
    assert capsys.readouterr().out.strip() == "ok: 6 samples decode"


def test_verify_reports_each_bad_sample(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "db"
    assert _build(tree, db) == 0
    paths = list(read_index(db, columns=("path",)).columns["path"])
    env = lmdb.open(str(db), subdir=True)
    with env.begin(write=True) as txn:
        txn.put(sample_key(4), b"garbage")
    env.close()
    capsys.readouterr()

    assert main(["lmdb", "verify", str(db)]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"index 4 ({paths[4]}): not an image format PIL can identify"
    ]
    assert "1 bad sample(s)" in captured.err


def test_bad_images_fail_or_are_listed(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tree / "class1" / "9.jpg"
    broken.write_bytes(os.urandom(512))
    assert _build(tree, tmp_path / "db") == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {broken}: not an image format")
    assert "Traceback" not in captured.err
    assert not (tmp_path / "db").exists()

    assert _build(tree, tmp_path / "db", "--on-error", "skip") == 0
    out = capsys.readouterr().out
    assert f"skipped {broken}: not an image format PIL can identify" in out
    assert "wrote 6 samples" in out
    assert "1 skipped" in out


def test_existing_output_and_bad_paths(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "db"
    assert _build(tree, db) == 0
    capsys.readouterr()
    assert _build(tree, db) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert _build(tree, db, "--overwrite", "--max-side", "16") == 0
    capsys.readouterr()

    assert main(["lmdb", "info", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["lmdb", "verify", str(tree)]) == 1  # a directory without data.mdb
    assert capsys.readouterr().err.startswith("error: ")
    assert _build(tmp_path / "nowhere", tmp_path / "db2") == 1
    assert "no such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["12X", "M", "-1"])
def test_map_size_must_be_a_size(
    tree: Path, tmp_path: Path, size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _build(tree, tmp_path / "db", "--map-size", size)
    assert info.value.code == 2
    assert "is not a size" in capsys.readouterr().err


def test_console_script_info(tree: Path, tmp_path: Path) -> None:
    assert _build(tree, tmp_path / "db") == 0
    script = Path(sys.executable).with_name("ddpkit")
    out = subprocess.run(
        [str(script), "lmdb", "info", str(tmp_path / "db"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["samples"] == 6


def test_workers_short_aliases(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    for command in (["build", "src", "out"], ["verify", "db"]):
        for flag in ("-j", "-w", "--workers"):
            assert parser.parse_args(["lmdb", *command, flag, "3"]).workers == 3
    assert _build(tree, tmp_path / "db", "-j", "2") == 0
    assert main(["lmdb", "verify", str(tmp_path / "db"), "-w", "2"]) == 0
    assert capsys.readouterr().out.endswith("ok: 6 samples decode\n")


def _console(args: list[str], *, terminal: bool) -> tuple[int, str]:
    """Run ``ddpkit ARGS`` with stderr on a pseudo-terminal or a pipe: (exit code, stderr).

    As ``python -m ddpkit``, forked from the suite's preloaded server
    (tests/helpers/warm.py); test_console_script_info runs the console script itself.
    """
    command = [sys.executable, "-m", "ddpkit", *args]
    if not terminal:
        out = warm_run(command, capture_output=True, text=True, timeout=120)
        return out.returncode, out.stderr
    parent, child = pty.openpty()
    # 24 rows of 80 columns: a new pseudo-terminal has 0, and tqdm draws no bar in 0 columns.
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        process = warm_popen(command, stdout=subprocess.DEVNULL, stderr=child)
    finally:
        os.close(child)
    chunks = []
    try:
        while True:
            try:
                data = os.read(parent, 4096)
            except OSError:  # EIO: the script exited and closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(parent)
    return process.wait(timeout=120), b"".join(chunks).decode(errors="replace")


@pytest.mark.timeout(240)
def test_progress_bars_only_on_a_terminal(tree: Path, tmp_path: Path) -> None:
    build = ["lmdb", "build", str(tree)]
    code, err = _console([*build, str(tmp_path / "piped")], terminal=False)
    assert code == 0
    assert "\r" not in err
    assert "lmdb build" not in err
    code, err = _console([*build, str(tmp_path / "shown")], terminal=True)
    assert code == 0
    assert "lmdb build" in err
    assert "6/6" in err
    code, err = _console([*build, str(tmp_path / "quiet"), "--no-progress"], terminal=True)
    assert (code, err) == (0, "")

    verify = ["lmdb", "verify", str(tmp_path / "shown")]
    code, err = _console(verify, terminal=True)
    assert code == 0
    assert "lmdb verify" in err
    assert "6/6" in err
    assert _console([*verify, "--no-progress"], terminal=True) == (0, "")
