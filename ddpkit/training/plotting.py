"""Learning curves from a run's ``metrics.jsonl``: one PNG a person can read at a glance.

``ddpkit plot RUN_DIR`` and the end of :func:`ddpkit.fit` (with ``log_dir``)
draw it. matplotlib is an optional extra (``pip install 'ddpkit[plot]'``);
without it :class:`PlotUnavailable` says how to install it.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Any

from ddpkit._docs import see

__all__ = ["PlotUnavailable", "plot_run", "read_metrics"]

# The panels: title, then (record key, label) of each curve.
_PANELS = (
    ("loss", (("train_loss", "train"), ("val_loss", "validation"))),
    (
        "validation accuracy (%)",
        (("val_acc1", "top-1"), ("val_acc5", "top-5"), ("val_ema_acc1", "top-1, EMA")),
    ),
    ("learning rate", (("lr", "lr"),)),
    ("training speed (images/s)", (("train_images_per_sec", "images/s"),)),
    ("waiting for data (% of step time)", (("data_wait", "data wait"),)),
)
# Panels whose axis starts at 0, so that noise does not look like a trend; the
# data-wait axis reaches at least 10 %, so 2 % looks as small as it is.
_FROM_ZERO = {"train_images_per_sec": 0.0, "data_wait": 10.0}
# The last epoch's confusion matrix is drawn up to this many classes.
CONFUSION_PLOT_MAX = 50


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


def read_metrics(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The last run's header and its epochs in ``metrics.jsonl``, one record per epoch.

    A resumed run repeats the epochs after its checkpoint: the last record of
    each epoch wins. Lines that are not JSON (a line cut by a crash) are skipped.

    Raises:
        FileNotFoundError: there is no such file (a directory: no ``metrics.jsonl`` in it).
        ValueError: it is not text, is empty, holds none of the records ``fit``
            writes, or holds no epoch yet; the message names the file.
    """
    given = Path(path)
    path = given / "metrics.jsonl" if given.is_dir() else given
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such file; fit(report=ReportConfig(log_dir=...)) writes "
            "metrics.jsonl into log_dir. " + see("plots-ddpkit-plot")
        )
    expected = (
        "ddpkit plot reads the metrics.jsonl that fit(report=ReportConfig(log_dir=...)) "
        "writes: one JSON record per line. " + see("plots-ddpkit-plot")
    )
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{path} is empty; {expected}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not text (byte {exc.start} is not UTF-8); {expected}"
        ) from None
    header: dict[str, Any] = {}
    epochs: dict[int, dict[str, Any]] = {}
    ours = False  # a record fit writes: a run header or an epoch
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if "run" in record:
            ours = True
            run = record["run"]
            if not (isinstance(run, dict) and run.get("resumed")):
                epochs.clear()  # a fresh run: what came before is another run
            header = run if isinstance(run, dict) else {}
        elif isinstance(record.get("epoch"), int) and not isinstance(record["epoch"], bool):
            ours = True
            epochs[record["epoch"]] = record
    if not ours:
        raise ValueError(
            f"{path} holds none of the records fit writes (a run header or an "
            f"epoch's figures); {expected}"
        )
    if not epochs:
        raise ValueError(f"{path} holds no epoch yet")
    return header, [epochs[e] for e in sorted(epochs)]


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw the learning curves of the run in ``run_dir``; return the image's path.

    Panels: train and validation loss (on a log scale), top-1 and top-5
    accuracy (top-5 only with more than 5 classes; the model average's top-1
    with ``fit(ema=...)``), learning rate, images per
    second, and the share of time spent waiting for data, each against the
    epoch (counted from 1); and the last epoch's confusion matrix, row-normalised,
    when it has at most 50 classes.

    Args:
        run_dir: the ``log_dir`` of the run (or its ``metrics.jsonl``).
        out: the file to write, exactly this path; its suffix picks the format
            (``.png``, ``.pdf``, ``.svg`` ... any that matplotlib writes).
            Default ``run_dir/curves.png``.

    Raises:
        PlotUnavailable: matplotlib is not installed.
        FileNotFoundError, ValueError: as :func:`read_metrics`.
        ValueError: ``out`` is empty, a directory, or has no suffix or one
            matplotlib cannot write (the message lists those it can).
        OSError: the file cannot be written (a full disk ...), naming it.

    Example:
        >>> plot_run("runs/exp1")
        PosixPath('runs/exp1/curves.png')
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "plotting needs matplotlib: pip install 'ddpkit[plot]' (or pip install matplotlib)"
        ) from None
    base = Path(run_dir) if Path(run_dir).is_dir() else Path(run_dir).parent
    out, form = _output(out if out is not None else base / "curves.png")
    header, records = read_metrics(run_dir)
    # A run of at most 5 classes: top-5 is 100 % by definition (older files recorded it).
    classes = header.get("classes")
    left_out = {"val_acc5"} if isinstance(classes, list) and 0 < len(classes) <= 5 else set()
    drawn = {k for _, c in _PANELS for k, _ in c if any(_number(r.get(k)) for r in records)}
    panels = [(t, [(k, n) for k, n in c if k in drawn - left_out]) for t, c in _PANELS]
    panels = [(t, c) for t, c in panels if c]
    confusion = _last_confusion(records)
    count = len(panels) + (confusion is not None)
    columns = min(3, count)
    rows = -(-count // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.4 * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    if confusion is not None:
        _draw_confusion(axes.flat[len(panels)], *confusion, header)
    for ax, (title, curves) in zip(axes.flat, panels, strict=False):
        top, low = 0.0, math.inf
        for key, label in curves:
            points = [(r["epoch"], r[key]) for r in records if _number(r.get(key))]
            scale = 100.0 if key == "data_wait" else 1.0
            values = [p[1] * scale for p in points]
            top, low = max([top, *values]), min([low, *values])
            ax.plot([p[0] for p in points], values, marker="o", markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        # A loss spans decades, and one spike of the validation loss would flatten the
        # training curve on a linear axis: both stay readable on a log one.
        if key == "lr" or (title == "loss" and low > 0):
            ax.set_yscale("log")
        elif key in _FROM_ZERO:
            ax.set_ylim(0, max(_FROM_ZERO[key], top * 1.15))
        if len(curves) > 1:
            ax.legend()
    fig.suptitle(_title(header, records))
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110, format=form)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if exc.errno == errno.ENOSPC:
            reason += ": free some space or write elsewhere with -o"
        raise OSError(exc.errno, f"cannot write the plot to {out}: {reason}") from None
    finally:
        plt.close(fig)
    return out


def _output(out: str | os.PathLike[str]) -> tuple[Path, str]:
    """The path to write, as given, and the format its suffix names; refuse what cannot be."""
    from matplotlib.figure import Figure

    formats = sorted(Figure().canvas.get_supported_filetypes())
    choices = ", ".join(f".{f}" for f in formats)
    text = os.fspath(out)
    if not text:
        raise ValueError(
            f"the plot's output path is empty; name a file such as curves.png "
            f"(formats: {choices}). " + see("plots-ddpkit-plot")
        )
    path = Path(text)
    if path.is_dir() or text.endswith(("/", os.sep)):
        raise ValueError(
            f"the plot's output {text} is a directory; name a file in it, such as "
            f"{path / 'curves.png'}. " + see("plots-ddpkit-plot")
        )
    form = path.suffix.removeprefix(".").lower()
    if form not in formats:
        what = f"suffix {path.suffix!r}" if path.suffix else "no suffix"
        raise ValueError(
            f"the plot's output {text} has {what}, which names no image format "
            f"matplotlib writes; end it with one of {choices}. " + see("plots-ddpkit-plot")
        )
    return path, form


def _last_confusion(records: list[dict[str, Any]]) -> tuple[list[list[int]], int] | None:
    """The newest epoch's confusion matrix and that epoch, if small enough to draw."""
    for record in reversed(records):
        matrix = record.get("val_confusion")
        if isinstance(matrix, list) and matrix:
            n = len(matrix)
            # A hand-edited or foreign file: only a square matrix of counts is drawn.
            square = all(
                isinstance(row, list) and len(row) == n and all(_number(v) and v >= 0 for v in row)
                for row in matrix
            )
            return (matrix, record["epoch"]) if square and n <= CONFUSION_PLOT_MAX else None
    return None


def _draw_confusion(ax: Any, matrix: list[list[int]], epoch: int, header: dict[str, Any]) -> None:
    """Each row (a true class) as shares of its samples, so small classes show as well."""
    shares = [[v / max(sum(row), 1) for v in row] for row in matrix]
    image = ax.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0)
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set_title(f"confusion, epoch {epoch} (share of each true class)")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    names = header.get("classes")
    n = len(matrix)
    if isinstance(names, list) and len(names) == n and n <= 20:
        ax.set_xticks(range(n), [str(x) for x in names], rotation=90, fontsize=7)
        ax.set_yticks(range(n), [str(x) for x in names], fontsize=7)
    if n <= 12:
        for t in range(n):
            for p in range(n):
                if matrix[t][p]:
                    color = "white" if shares[t][p] > 0.5 else "black"
                    ax.text(
                        p, t, str(matrix[t][p]), ha="center", va="center", fontsize=7, color=color
                    )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _title(header: dict[str, Any], records: list[dict[str, Any]]) -> str:
    scored = [r for r in records if _number(r.get("val_acc1"))]
    best = max(scored, key=lambda r: r["val_acc1"]) if scored else None
    parts = [f"run {header['id']}" if "id" in header else "run"]
    parts.append(f"{len(records)} epochs")
    if best is not None:
        parts.append(f"best top-1 {best['val_acc1']:.2f}% (epoch {best['epoch']})")
    return ", ".join(parts)
