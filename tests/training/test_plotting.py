"""Learning curves: metrics.jsonl read back per run and epoch, drawn into one PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from warm import warm_run  # type: ignore[import-not-found]

from ddpkit.training.plotting import PlotUnavailable, plot_run, read_metrics


def _write(path: Path, lines: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _epoch(n: int, acc: float) -> dict[str, Any]:
    return {"epoch": n, "train_loss": 2.0 / n, "val_loss": 2.2 / n, "val_acc1": acc,
            "val_acc5": min(acc + 20, 100.0), "lr": 0.1 / n, "train_images_per_sec": 500.0 + n,
            "data_wait": 0.05}  # fmt: skip


def test_the_last_run_and_the_last_record_of_each_epoch_are_read(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [
        {"run": {"id": "old", "resumed": False}}, _epoch(1, 10.0), _epoch(2, 20.0),
        {"run": {"id": "new", "resumed": False}}, _epoch(1, 30.0), _epoch(2, 40.0),
        {"run": {"id": "new", "resumed": True}}, _epoch(2, 45.0), _epoch(3, 50.0),
    ])  # fmt: skip
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"epoch": 4, "train_lo')  # a line cut by a crash
    header, records = read_metrics(tmp_path)
    assert header["id"] == "new"
    assert [(r["epoch"], r["val_acc1"]) for r in records] == [(1, 30.0), (2, 45.0), (3, 50.0)]


def test_missing_and_empty_metrics_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl: no such file"):
        read_metrics(tmp_path)
    _write(tmp_path / "metrics.jsonl", [{"run": {"id": "x", "resumed": False}}])
    with pytest.raises(ValueError, match="holds no epoch"):
        plot_run(tmp_path)


def test_a_png_with_every_panel_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    epochs = [_epoch(n, 10.0 * n) for n in (1, 2, 3)]
    _write(tmp_path / "metrics.jsonl", [{"run": {"id": "abc", "resumed": False}}, *epochs])
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(out) as image:
        width, height = image.size
    assert 1.5 < width / height < 2.5  # five panels in two rows of three
    other = plot_run(tmp_path / "metrics.jsonl", tmp_path / "sub" / "c.png")
    assert other.is_file()


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [_epoch(1, 10.0)])
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from ddpkit.training.plotting import plot_run, PlotUnavailable\n"
        f"try:\n    plot_run({str(tmp_path)!r})\n"
        "except PlotUnavailable as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'ddpkit[plot]'" in done.stdout, done.stderr
    assert issubclass(PlotUnavailable, RuntimeError)


def test_the_cli_draws_a_run_and_names_what_is_missing(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _write(tmp_path / "metrics.jsonl", [_epoch(1, 10.0), _epoch(2, 20.0)])
    command = [sys.executable, "-m", "ddpkit", "plot", str(tmp_path), "-o", str(tmp_path / "c.png")]
    done = warm_run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "c.png")
    assert (tmp_path / "c.png").is_file()
    missing = warm_run([sys.executable, "-m", "ddpkit", "plot", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: ")
    assert "no such file" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_the_confusion_matrix_of_the_last_epoch_is_drawn_up_to_50_classes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    def inked(classes: int) -> float:
        """The share of non-white pixels in the bottom-right panel of the 2 x 3 grid."""
        confusion = [[5 if t == p else 1 for p in range(classes)] for t in range(classes)]
        records = [{**_epoch(n, 10.0 * n), "val_ema_acc1": 9.0 * n, "val_confusion": confusion}
                   for n in (1, 2)]  # fmt: skip
        run = tmp_path / str(classes)
        run.mkdir()
        _write(run / "metrics.jsonl", [{"run": {"id": "x", "classes": None}}, *records])
        with Image.open(plot_run(run)) as image:
            width, height = image.size
            corner = image.convert("L").crop((2 * width // 3, height // 2, width, height))
            pixels = torch.frombuffer(bytearray(corner.tobytes()), dtype=torch.uint8)
        return float((pixels < 250).float().mean())

    assert inked(4) > 0.2  # the matrix and its colour bar
    assert inked(60) < 0.01  # too many classes: the panel stays empty
    from ddpkit.training.plotting import _last_confusion

    assert _last_confusion([{"epoch": 1, "val_confusion": [[1]]}]) == ([[1]], 1)
    assert _last_confusion([{"epoch": 1, "val_confusion": [[0] * 51] * 51}]) is None
    for damaged in ([[1, 2], [3]], [[1, "x"], [0, 1]], [[1, -1], [0, 1]], [1, 2]):
        assert _last_confusion([{"epoch": 1, "val_confusion": damaged}]) is None, damaged


def _figure(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    header: dict[str, Any],
    records: list[dict[str, Any]],
) -> Any:
    """The matplotlib figure plot_run draws for ``records``, kept from being closed."""
    plt = pytest.importorskip("matplotlib.pyplot")
    drawn: list[Any] = []
    monkeypatch.setattr(plt, "close", drawn.append)
    _write(tmp_path / "metrics.jsonl", [{"run": {"id": "x", "resumed": False, **header}}, *records])
    plot_run(tmp_path)
    (figure,) = drawn
    return figure


def _panel(figure: Any, title: str) -> Any:
    return next(ax for ax in figure.axes if ax.get_visible() and ax.get_title() == title)


def test_a_validation_loss_spike_leaves_the_train_curve_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [_epoch(n, 10.0 * n) for n in (1, 2, 3, 4)]
    records[2]["val_loss"] = 400.0  # one diverged validation
    loss = _panel(_figure(tmp_path, monkeypatch, {}, records), "loss")
    assert loss.get_yscale() == "log"
    low, high = loss.get_ylim()
    # train_loss goes 2.0 -> 0.5: on the log axis it spans a visible share of the height.
    import math

    assert (math.log(2.0) - math.log(0.5)) / (math.log(high) - math.log(low)) > 0.15


@pytest.mark.parametrize(
    ("classes", "top5"), [(["a", "b", "c", "d"], False), (list("abcdef"), True)]
)
def test_top5_is_drawn_only_above_five_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, classes: list[str], top5: bool
) -> None:
    figure = _figure(tmp_path, monkeypatch, {"classes": classes}, [_epoch(n, 50.0) for n in (1, 2)])
    labels = [line.get_label() for line in _panel(figure, "validation accuracy (%)").get_lines()]
    assert labels == (["top-1", "top-5"] if top5 else ["top-1"])
