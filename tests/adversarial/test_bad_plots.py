"""``ddpkit plot`` on what is not a run, and to where nothing should be: named, no traceback.

Two kinds: the input (bytes that are not text, an empty file, JSON that is not
fit's records, a directory without ``metrics.jsonl``) and the output (no
suffix, a suffix no format has, a directory, an empty name, a device that
refuses the write). Each is an ``error: ...`` line naming the file and what is
expected, exit status 1, and nothing written beside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from corpus import snapshot

from ddpkit.cli import main


def _good_run(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    records = [{"run": {"id": "r", "resumed": False}}]
    for n in (1, 2):
        records.append({"epoch": n, "train_loss": 1.0 / n, "val_acc1": 10.0 * n, "lr": 0.1})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def _random_bytes(path: Path) -> None:
    path.write_bytes(bytes([0x86, 0xFF, 0x00, 0x13]) + os.urandom(2048))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _blank_lines(path: Path) -> None:
    path.write_text("\n \n\t\n")


def _foreign_json(path: Path) -> None:
    path.write_text('{"loss": 0.5, "step": 10}\n[1, 2, 3]\n"text"\n{"epoch": "one"}\n')


def _csv(path: Path) -> None:
    path.write_text("epoch,loss\n1,0.5\n2,0.4\n")


_INPUTS: dict[str, Callable[[Path], None]] = {
    "random-bytes": _random_bytes,
    "empty": _empty,
    "blank-lines": _blank_lines,
    "foreign-json": _foreign_json,
    "csv": _csv,
}


def _plot(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plot", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", sorted(_INPUTS))
@pytest.mark.parametrize("given", ["file", "directory"])
def test_a_file_that_is_not_fits_metrics_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, given: str
) -> None:
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "metrics.jsonl"
    _INPUTS[kind](metrics)
    before = snapshot(tmp_path)
    code, out, err = _plot(capsys, str(metrics if given == "file" else tmp_path))
    assert code == 1, out
    assert err.startswith("error: "), err
    assert str(metrics) in err
    assert "metrics.jsonl that fit" in err  # what is expected
    assert "codec" not in err
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before  # no curves.png of nothing


def test_a_directory_without_metrics_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "other.txt").write_text("x")
    code, _, err = _plot(capsys, str(tmp_path))
    assert code == 1
    assert f"{tmp_path / 'metrics.jsonl'}: no such file" in err
    assert "writes metrics.jsonl into log_dir" in err


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("curves", "has no suffix"),
        ("curves.foo", "has suffix '.foo'"),
        ("curves.png.bak", "has suffix '.bak'"),
        (".png", "has no suffix"),  # a hidden file named .png, not a suffix
    ],
)
def test_an_output_without_a_known_format_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, said: str
) -> None:
    pytest.importorskip("matplotlib")
    run = _good_run(tmp_path / "run")
    before = snapshot(tmp_path)
    code, _, err = _plot(capsys, str(run), "-o", str(tmp_path / name))
    assert code == 1
    assert said in err, err
    assert ".png" in err
    assert ".pdf" in err
    assert ".svg" in err
    assert snapshot(tmp_path) == before  # nothing written, not even NAME.png


def test_an_output_that_is_a_directory_or_empty_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    run = _good_run(tmp_path / "run")
    (tmp_path / "out").mkdir()
    before = snapshot(tmp_path)
    for target, said in [
        (str(tmp_path / "out"), "is a directory"),
        (str(tmp_path / "new") + "/", "is a directory"),
        ("", "output path is empty"),
    ]:
        code, _, err = _plot(capsys, str(run), "-o", target)
        assert code == 1, target
        assert said in err, (target, err)
    assert snapshot(tmp_path) == before
    assert not Path(".png").exists()


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg", ".JPG"])
def test_the_exact_path_is_written_in_its_suffixs_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    pytest.importorskip("matplotlib")
    run = _good_run(tmp_path / "run")
    target = tmp_path / f"plot{suffix}"
    code, out, err = _plot(capsys, str(run), "-o", str(target))
    assert code == 0, err
    assert out.strip() == str(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run", target.name])
    magic = {".png": b"\x89PNG", ".pdf": b"%PDF", ".svg": b"<?xml", ".JPG": b"\xff\xd8"}
    assert target.read_bytes().startswith(magic[suffix])


def test_a_write_error_is_named_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    run = _good_run(tmp_path / "run")
    full = tmp_path / "full.png"
    full.symlink_to("/dev/full")
    code, _, err = _plot(capsys, str(run), "-o", str(full))
    assert code == 1
    assert err.startswith("error: "), err
    assert f"cannot write the plot to {full}" in err
    assert "No space left on device" in err
    assert "Traceback" not in err
    assert not Path("/dev/full.png").exists()
