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

from ddpkit._docs import see
from ddpkit.training.config import ReportConfig
from ddpkit.training.stragglers import straggler_text
from ddpkit.training.trackers import Trackers, missing_extra

__all__ = ["DATA_WAIT_WARNING", "Reporter", "epoch_line", "tracker_names"]

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
    sent = record.get("comm_bytes_per_step")
    if isinstance(sent, int | float):
        parts.append(f"all-reduce {_megabytes(sent)}/step ({record.get('comm_hook', 'none')})")
    wait = record.get("data_wait")
    if isinstance(wait, float):
        parts.append(f"data wait {wait:.0%}")
    if "wall_seconds" in record:
        parts.append(f"{record['wall_seconds']:.1f} s")
    changed = _world_change(record.get("batch_splits"))
    if changed:
        parts.append(changed)
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
    dropped = record.get("rank_dropped_batches")
    if isinstance(dropped, list) and any(dropped):
        line += "; data ended apart, batches dropped: " + ", ".join(
            f"{n} on rank {r}" for r, n in enumerate(dropped) if n
        )
    if isinstance(wait, float) and wait > DATA_WAIT_WARNING:
        line += (
            f"; data loading is the bottleneck ({wait:.0%} of the time waiting for batches): "
            "more workers (-j / build_loader(workers=)), the uint8 tensor path "
            "(decode='tensor'), or a copy of the LMDB on a local disk"
        )
    return line


def _megabytes(count: float) -> str:
    """``12.3 MB``, ``0.0412 MB``: three significant digits of a byte count, in MB."""
    return f"{count / 1e6:.3g} MB"


def _world_change(splits: Any) -> str | None:
    """``world sizes [2, 1]: ...``: how the steps were split when a server left or joined."""
    if not isinstance(splits, list) or len(splits) < 2:
        return None
    sizes = [s[0] for s in splits]
    shown = " then ".join(
        f"{w} x {b}" + (f" x {a} accumulated" if a > 1 else "") for w, b, a in splits
    )
    if not all(b for _, b, _ in splits):
        return f"world sizes {sizes}"
    per_step = {w * b * a for w, b, a in splits}
    changed = [
        name
        for i, name in ((1, "per-process batch"), (2, "accumulation steps"))
        if len({s[i] for s in splits}) > 1
    ]
    what = f" (the {' and the '.join(changed)} changed)" if changed else ""
    each = f"{per_step.pop()} samples a step" if len(per_step) == 1 else "steps of other sizes"
    return f"world sizes {sizes}: {each}, as {shown}{what}"


class Reporter:
    """Rank 0's view of a run: bars, lines, one JSON line per epoch, a summary, a plot.

    On other ranks (``is_main=False``) every method does nothing, so the
    training loop calls them unconditionally.
    """

    def __init__(self, config: ReportConfig, *, is_main: bool) -> None:
        self.config, self.is_main = config, is_main
        self._jsonl: Any = None
        self._started = time.perf_counter()
        self._finished = False
        self.tracker_names = tracker_names(config)
        self._trackers: Trackers | None = None
        if is_main and config.log_dir is not None:
            os.makedirs(config.log_dir, exist_ok=True)
        if is_main and self.tracker_names:
            self._trackers = Trackers(
                self.tracker_names, config.log_dir, config.project, timeout=config.tracker_timeout
            )

    def start(
        self,
        header: dict[str, Any],
        *,
        resumed: bool,
        tracker_runs: dict[str, Any] | None = None,
        tracker_records: list[Any] | None = None,
    ) -> dict[str, str]:
        """Begin ``metrics.jsonl`` with a run header, and the trackers' runs.

        A fresh run starts a fresh record (an earlier run's file is kept as
        ``metrics-<its run id>.jsonl``); a resumed one continues its run's
        record and id, with a header saying where it resumed. Each tracker
        continues its run of ``tracker_runs`` (a resumed checkpoint's) and is
        sent the epochs of ``tracker_records`` (the checkpoint's
        :meth:`~ddpkit.training.trackers.Trackers.records`) it may lack;
        returns ``{tracker: run id}`` (empty on other ranks).

        Raises:
            TrackerError: (rank 0) a tracker asked for cannot start its run.
        """
        if not self.is_main:
            return {}
        if self.config.run_config is not None:
            header = {**header, "resolved": dict(self.config.run_config)}
        runs: dict[str, str] = {}
        if self._trackers is not None:
            config = self.config.run_config
            runs = self._trackers.start(tracker_runs, config, tracker_records)
            if self.config.trackers is not None:
                header = {**header, "trackers": runs}
        if self.config.log_dir is None:
            return runs
        path = Path(self.config.log_dir) / METRICS
        earlier = _run_id(path)
        if path.exists() and not resumed:
            os.replace(path, path.with_name(f"metrics-{earlier or 'earlier'}.jsonl"))
        run = earlier if resumed and earlier else secrets.token_hex(6)
        self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._write({"run": {"id": run, "resumed": resumed and earlier is not None, **header}})
        return runs

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

    def epoch(self, record: dict[str, Any], epochs: int | None = None, step: int = 0) -> None:
        """Write one epoch's record: a JSON line, the trackers (at global ``step``), the line."""
        if not self.is_main:
            return
        self._write(record)
        if self._trackers is not None:
            self._trackers.epoch(record, step)
        self.say(epoch_line(record, epochs))

    def tracker_records(self) -> list[Any]:
        """The run's epoch records as the trackers got them, for the checkpoints."""
        return self._trackers.records() if self._trackers is not None else []

    def finish(self, records: list[dict[str, Any]], best_checkpoint: str | None = None) -> None:
        """The summary table at the end of a run, ``curves.png`` where it can be drawn, and
        ``best_checkpoint`` (a path) and the picture sent to the trackers.

        With no ``records`` (a resumed run that had nothing left to train) only the
        trackers get their end again (the job may have stopped in it)."""
        self._finished = True
        if not self.is_main:
            return
        if not records:
            if self._trackers is not None:
                picture = self._plot() if self.config.log_dir is not None else None
                self._trackers.finish(best_checkpoint, picture)
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
        picture = self._plot() if self.config.log_dir is not None else None
        if self._trackers is not None:
            self._trackers.finish(best_checkpoint, picture)

    def _plot(self) -> Path | None:
        from ddpkit.training.plotting import PlotUnavailable, plot_run

        if self._jsonl is not None:
            self._jsonl.flush()
        try:
            out = plot_run(self.config.log_dir)  # type: ignore[arg-type]
        except PlotUnavailable:
            return None  # the extra is not installed: no picture, and nothing wrong
        self.say(f"learning curves: {out}")
        return out

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
        if self._trackers is not None:
            self._trackers.close(self._finished)  # a stopped run stays open for its resume
            self._trackers = None


def tracker_names(config: ReportConfig) -> tuple[str, ...]:
    """The trackers ``config`` asks for; the same answer on every rank.

    ``trackers=None`` keeps the behaviour before 0.3: TensorBoard when it is
    installed and there is a ``log_dir``.

    Raises:
        ValueError: a tracker asked for is not installed (names the extra).
    """
    if config.trackers is None:
        wanted = config.log_dir is not None and missing_extra("tensorboard") is None
        return ("tensorboard",) if wanted else ()
    problems = [p for p in map(missing_extra, config.trackers) if p is not None]
    if problems:
        raise ValueError(
            f"ReportConfig(trackers={config.trackers!r}): {'; '.join(problems)}. "
            + see("trackers-tensorboard-mlflow-wb")
        )
    return config.trackers


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
