"""What ``fit`` shows and writes on rank 0: epoch lines, bars, ``metrics.jsonl``, plots, logs.

``fit`` hands each epoch's record to a :class:`Reporter` and asks it for a
progress bar; nothing about how a result is shown lives in the training loop.
Epochs are counted from 1 everywhere a person reads them: the bar, the epoch
lines, ``metrics.jsonl``, the records and the weight files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from ddpkit.training.config import ReportConfig
from ddpkit.training.stragglers import straggler_text

__all__ = ["DATA_WAIT_WARNING", "ReportConfig", "Reporter", "epoch_line"]

logger = logging.getLogger("ddpkit")

# Above this share of the training time spent waiting for batches, the epoch
# line says that data loading is the bottleneck, and what to do.
DATA_WAIT_WARNING = 0.25
METRICS = "metrics.jsonl"


def epoch_line(record: dict[str, Any], epochs: int | None = None) -> str:
    """The one line a person reads per epoch, from :func:`ddpkit.fit`'s record.

    Example:
        >>> epoch_line({"epoch": 3, "train_loss": 0.41, "val_acc1": 91.2}, 90)
        'epoch 3/90: train_loss 0.4100, val_acc1 91.20%'
    """
    parts = []
    for key, form in (
        ("train_loss", "{:.4f}"),
        ("val_loss", "{:.4f}"),
        ("val_acc1", "{:.2f}%"),
        ("val_acc5", "{:.2f}%"),
        ("val_ema_acc1", "{:.2f}%"),
        ("lr", "{:.4g}"),
    ):
        if isinstance(record.get(key), int | float):
            parts.append(f"{key} {form.format(record[key])}")
    worst = record.get("val_worst_recall")
    if isinstance(worst, int | float) and record.get("val_worst_class") is not None:
        parts.append(f"worst class {record['val_worst_class']} {worst:.1f}%")
    if "train_images_per_sec" in record:
        parts.append(f"{record['train_images_per_sec']:.0f} img/s")
    wait = record.get("data_wait")
    if isinstance(wait, float):
        parts.append(f"data wait {wait:.0%}")
    if "wall_seconds" in record:
        parts.append(f"{record['wall_seconds']:.1f} s")
    data_s = record.get("rank_data_s")
    if isinstance(data_s, list) and data_s:
        parts.append(
            f"ranks: spread {record.get('rank_spread', 0.0):.0%}, "
            f"data wait {min(data_s):.1f}-{max(data_s):.1f} s"
        )
    of = f"/{epochs}" if epochs is not None else ""
    line = f"epoch {record['epoch']}{of}: " + ", ".join(parts)
    straggler = record.get("straggler")
    if isinstance(straggler, dict):
        line += "; " + straggler_text(straggler)
    if isinstance(wait, float) and wait > DATA_WAIT_WARNING:
        line += (
            f"; data loading is the bottleneck ({wait:.0%} of the time waiting for batches): "
            "more workers (-j / build_loader(workers=)), the uint8 tensor path "
            "(decode='tensor'), or a copy of the LMDB on a local disk"
        )
    return line


class Reporter:
    """Rank 0's view of a run: bars, lines, one JSON line per epoch, a summary, a plot.

    On other ranks (``is_main=False``) every method does nothing, so the
    training loop calls them unconditionally.
    """

    def __init__(self, config: ReportConfig, *, is_main: bool) -> None:
        self.config, self.is_main = config, is_main
        self._jsonl: Any = None
        self._tb: Any = None
        self._started = time.perf_counter()
        if is_main and config.log_dir is not None:
            os.makedirs(config.log_dir, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.fspath(config.log_dir))
            except ImportError:
                pass

    def start(self, header: dict[str, Any], *, resumed: bool) -> None:
        """Begin ``metrics.jsonl`` with a run header.

        A fresh run starts a fresh record (an earlier run's file is kept as
        ``metrics-<its run id>.jsonl``); a resumed one continues its run's
        record and id, with a header saying where it resumed.
        """
        if not self.is_main or self.config.log_dir is None:
            return
        path = Path(self.config.log_dir) / METRICS
        earlier = _run_id(path)
        if path.exists() and not resumed:
            os.replace(path, path.with_name(f"metrics-{earlier or 'earlier'}.jsonl"))
        run = earlier if resumed and earlier else secrets.token_hex(6)
        self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._write({"run": {"id": run, "resumed": resumed and earlier is not None, **header}})

    def say(self, message: str) -> None:
        """A line for the person watching: stdout when ``verbose``, else the log."""
        if not self.is_main:
            return
        if self.config.verbose:
            print(message, flush=True)
        else:
            logger.info("%s", message)

    def progress_bar(self, total: int | None, desc: str) -> Any:
        """A tqdm bar on rank 0 with ``progress`` and a terminal, else None."""
        if not (self.config.progress and self.is_main and _terminal()):
            return None
        from tqdm.auto import tqdm  # type: ignore[import-untyped]

        return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)

    def epoch(self, record: dict[str, Any], epochs: int | None = None) -> None:
        """Write one epoch's record: a JSON line, TensorBoard scalars, the epoch line."""
        if not self.is_main:
            return
        self._write(record)
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key not in ("epoch", "val_worst_class"):
                    self._tb.add_scalar(key, value, record["epoch"])
            self._tb.flush()
        self.say(epoch_line(record, epochs))

    def finish(self, records: list[dict[str, Any]]) -> None:
        """The summary table at the end of a run, and ``curves.png`` where it can be drawn."""
        if not self.is_main or not records:
            return
        scored = [r for r in records if isinstance(r.get("val_acc1"), int | float)]
        best = max(scored, key=lambda r: r["val_acc1"]) if scored else None
        speeds = [r["train_images_per_sec"] for r in records if "train_images_per_sec" in r]
        rows = [
            ("epochs trained", str(len(records))),
            ("total time", f"{time.perf_counter() - self._started:.1f} s"),
        ]
        if best is not None:
            rows += [
                ("best epoch", str(best["epoch"])),
                ("best val_acc1", f"{best['val_acc1']:.2f}%"),
            ]
        averaged = [r for r in records if isinstance(r.get("val_ema_acc1"), int | float)]
        if averaged:
            top = max(averaged, key=lambda r: r["val_ema_acc1"])
            rows.append(("best EMA val_acc1", f"{top['val_ema_acc1']:.2f}% (epoch {top['epoch']})"))
        if speeds:
            rows.append(("images/s", f"{sum(speeds) / len(speeds):.0f}"))
        width = max(len(name) for name, _ in rows)
        self.say("\n".join(f"  {name:<{width}}  {value}" for name, value in rows))
        if self.config.log_dir is not None:
            self._plot()

    def _plot(self) -> None:
        from ddpkit.training.plotting import PlotUnavailable, plot_run

        if self._jsonl is not None:
            self._jsonl.flush()
        try:
            out = plot_run(self.config.log_dir)  # type: ignore[arg-type]
        except PlotUnavailable:
            return  # the extra is not installed: no picture, and nothing wrong
        self.say(f"learning curves: {out}")

    def _write(self, record: dict[str, Any]) -> None:
        if self._jsonl is None:
            return
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in record.items()
        }
        self._jsonl.write(json.dumps(clean) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        """Close the files; safe to call twice."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _run_id(path: Path) -> str | None:
    """The run id of the last run header in ``path``, or None."""
    found = None
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith('{"run"'):
                    try:
                        found = json.loads(line)["run"]["id"]
                    except (ValueError, KeyError, TypeError):
                        continue
    except OSError:
        return None
    return found if isinstance(found, str) else None
