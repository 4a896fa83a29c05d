"""Experiment trackers on rank 0: TensorBoard, MLflow and Weights & Biases, one run per job.

:class:`Trackers` is what :class:`ddpkit.training.reporting.Reporter` logs
through: the run's configuration once, each epoch's record at the global
step, and at the end the best checkpoint's path and ``curves.png``. Each
library is imported only when asked for (``ReportConfig(trackers=...)``).

A job that is killed, preempted, requeued or restarted continues the *same*
tracker run: the run ids go into every checkpoint (``fit`` passes
:meth:`Trackers.runs` as the save's ``extra``), and the ledger
``trackers.json`` in ``log_dir`` holds the last epoch each run received, so
an epoch retrained after a resume is not logged twice. W&B writes its run
file in the background (every 15 s): an epoch it received stays *pending* in
the ledger, with its values and step, until its run file on disk holds it;
a job killed before that re-sends the pending epochs when it resumes, once.
A tracker that raises (a server down, a full disk) is dropped with one
warning; training goes on.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["EXTRAS", "LEDGER", "TRACKERS", "Trackers", "missing_extra"]

logger = logging.getLogger("ddpkit")

TRACKERS = ("tensorboard", "mlflow", "wandb")
# The module each tracker imports, and the extra that installs it.
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
LEDGER = "trackers.json"


def missing_extra(name: str) -> str | None:
    """Why tracker ``name`` cannot run here (its library is not installed), or None."""
    if importlib.util.find_spec(EXTRAS[name]) is not None:
        return None
    return f'{name} is not installed: pip install "ddpkit[{name}]"'


def _numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's scalars as trackers chart them (lists, names, non-finite values left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class _TensorBoard:
    name = "tensorboard"
    durable = True  # log() returns once its events are flushed to disk

    def __init__(self, log_dir: Path, project: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(os.fspath(log_dir))

    def open(self, run_id: str | None, config: Mapping[str, Any] | None) -> str:
        if run_id is None and config is not None:
            self.writer.add_text("config", "    " + json.dumps(dict(config), indent=1), 0)
        return run_id or str(self.log_dir.resolve())

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, best: str | None, picture: Path | None, step: int) -> None:
        if best is not None:
            self.writer.add_text("best_checkpoint", best, step)
        if picture is not None:
            import numpy as np
            from PIL import Image

            with Image.open(picture) as image:
                pixels = np.asarray(image.convert("RGB"))
            self.writer.add_image("curves", pixels, step, dataformats="HWC")
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


class _Mlflow:
    name = "mlflow"
    durable = True  # log() returns once the tracking store holds the metrics

    def __init__(self, log_dir: Path, project: str) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient()  # MLFLOW_TRACKING_URI, else ./mlruns
        self.project = project
        self.run_id = ""

    def open(self, run_id: str | None, config: Mapping[str, Any] | None) -> str:
        if run_id is not None:
            self.client.get_run(run_id)  # raises when the store does not hold it
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return run_id
        found = self.client.get_experiment_by_name(self.project)
        experiment = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(self.project)
        )
        self.run_id = self.client.create_run(experiment).info.run_id
        if config is not None:
            from mlflow.entities import Param

            params = [Param(k, json.dumps(v)[:6000]) for k, v in sorted(config.items())]
            for start in range(0, len(params), 100):  # the store's limit per batch
                self.client.log_batch(self.run_id, params=params[start : start + 100])
            self.client.log_dict(self.run_id, dict(config), "config.json")
        return self.run_id

    def log(self, values: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, best: str | None, picture: Path | None, step: int) -> None:
        if best is not None:
            self.client.set_tag(self.run_id, "best_checkpoint", best)
        if picture is not None:
            self.client.log_artifact(self.run_id, os.fspath(picture))

    def close(self, finished: bool) -> None:
        # A stopped job leaves its run RUNNING: the resumed one continues it.
        if finished:
            self.client.set_terminated(self.run_id, status="FINISHED")


def _wandb_epochs(path: Path) -> set[int]:
    """The epochs of the history rows a W&B run file (``run-<id>.wandb``) holds.

    The file is LevelDB's log format (32 KiB blocks of framed records); a torn
    last record, as a killed process leaves it, is not counted.
    """
    from wandb.proto import wandb_internal_pb2

    data, epochs, pending, pos = path.read_bytes(), set(), b"", 7  # after the ":W&B" header
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a frame: padding
            pos += left
            continue
        size, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + size], pos + 7 + size
        if len(chunk) < size:
            break  # torn
        if kind in (2, 3):  # first or middle piece of a record
            pending += chunk
            continue
        whole, pending = (pending + chunk if kind == 4 else chunk), b""
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        try:
            record.ParseFromString(whole)
        except Exception:  # a damaged record: its epoch is not confirmed
            continue
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                if (item.key or "/".join(item.nested_key)) == "epoch":
                    epochs.add(int(float(item.value_json)))
    return epochs


class _Wandb:
    name = "wandb"
    durable = False  # its run file is written in the background: confirmed()

    def __init__(self, log_dir: Path, project: str) -> None:
        import wandb

        self.wandb, self.log_dir, self.project = wandb, log_dir, project
        self.run: Any = None

    def open(self, run_id: str | None, config: Mapping[str, Any] | None) -> str:
        self.run = self.wandb.init(
            project=self.project,
            dir=os.fspath(self.log_dir),
            id=run_id,
            resume="allow" if run_id is not None else None,
            config=dict(config) if config is not None and run_id is None else None,
            reinit="create_new",
        )
        return str(self.run.id)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step, commit=True)  # without commit the row waits for the next

    def confirmed(self) -> set[int]:
        """The epochs that this run's files on disk hold, of this job and the ones before."""
        wandb_dir = Path(self.run.settings.sync_dir).parent
        held: set[int] = set()
        for path in wandb_dir.glob(f"*-{self.run.id}/run-{self.run.id}.wandb"):
            try:
                held |= _wandb_epochs(path)
            except OSError:
                continue
        return held

    def finish(self, best: str | None, picture: Path | None, step: int) -> None:
        if best is not None:
            self.run.summary["best_checkpoint"] = best
        if picture is not None:
            self.run.summary["curves"] = self.wandb.Image(os.fspath(picture))

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


_KINDS: dict[str, Any] = {"tensorboard": _TensorBoard, "mlflow": _Mlflow, "wandb": _Wandb}


class Trackers:
    """The trackers of one run on rank 0; every call is safe on a tracker that failed.

    Args:
        names: the trackers (of :data:`TRACKERS`).
        log_dir: where TensorBoard and W&B write, and the ledger lives (None:
            the working directory for W&B, no ledger, no TensorBoard).
        project: the MLflow experiment and W&B project of a new run.
    """

    def __init__(
        self, names: tuple[str, ...], log_dir: str | os.PathLike[str] | None, project: str
    ):
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.project = project
        self._open: dict[str, Any] = {}
        self._names = [n for n in names if n != "tensorboard" or self.log_dir is not None]
        self._runs: dict[str, str] = {}
        self._logged: dict[str, int] = {}  # the last epoch each run received
        # Epochs a tracker received but has not confirmed on disk: [epoch, step, values].
        self._pending: dict[str, list[list[Any]]] = {}
        self._step = 0

    def start(
        self,
        runs: Mapping[str, Any] | None,
        config: Mapping[str, Any] | None,
        done_epochs: int = 0,
    ) -> dict[str, str]:
        """Open each tracker's run: the one of ``runs`` (a checkpoint's), else a new one.

        ``done_epochs``: the epochs the resumed checkpoint holds, all logged
        already. Returns ``{tracker: run id}`` for the checkpoints.
        """
        ledger = self._read_ledger()
        for name in self._names:
            previous = runs.get(name) if runs else None
            run_id = previous if isinstance(previous, str) else None
            try:
                tracker = _KINDS[name](self.log_dir or Path.cwd(), self.project)
                self._runs[name] = tracker.open(run_id, config)
            except Exception as exc:
                self._failed(name, "could not start its run", exc)
                continue
            self._open[name] = tracker
            entry = ledger.get(name) or {}
            same = entry.get("id") == self._runs[name]
            known = entry.get("epoch") if same else None
            self._logged[name] = max(done_epochs if run_id else 0, int(known or 0))
            pending = entry.get("pending") if same else None
            self._pending[name] = list(pending) if isinstance(pending, list) else []
            self._resend(name, tracker)
        return dict(self._runs)

    def _resend(self, name: str, tracker: Any) -> None:
        """Log again the pending epochs the run's files do not hold (a killed job lost them)."""
        if not self._pending[name]:
            return
        try:
            held = tracker.confirmed()
            for epoch, step, values in self._pending[name]:
                if epoch not in held:
                    tracker.log(values, step)
        except Exception as exc:
            self._failed(name, "could not log again the epochs its killed job lost", exc)
            return
        self._write_ledger()

    def runs(self) -> dict[str, str]:
        """``{tracker: run id}`` of the runs opened (what checkpoints record)."""
        return dict(self._runs)

    def epoch(self, record: Mapping[str, Any], step: int) -> None:
        """Log one epoch's record at ``step`` (the optimizer steps so far) to each tracker
        that does not hold that epoch yet."""
        self._step = step
        values = _numbers(record)
        epoch = int(record["epoch"])
        for name, tracker in list(self._open.items()):
            if epoch <= self._logged.get(name, 0):
                continue  # logged before the job stopped: a resumed run does not repeat it
            try:
                tracker.log(values, step)
                if not tracker.durable:
                    self._pending[name].append([epoch, step, values])
                    held = tracker.confirmed()
                    self._pending[name] = [p for p in self._pending[name] if p[0] not in held]
            except Exception as exc:
                self._failed(name, f"could not log epoch {epoch}", exc)
                continue
            self._logged[name] = epoch
        self._write_ledger()

    def finish(self, best: str | None, picture: Path | None) -> None:
        """The best checkpoint's path and the curves picture, once, at the end of training."""
        for name, tracker in list(self._open.items()):
            try:
                tracker.finish(best, picture, self._step)
            except Exception as exc:
                self._failed(name, "could not record the best checkpoint and curves", exc)

    def close(self, finished: bool) -> None:
        """End each tracker's session: ``finished`` marks the run done, else it stays open
        for the job that resumes it. Safe to call twice."""
        for name, tracker in list(self._open.items()):
            try:
                tracker.close(finished)
            except Exception as exc:
                self._failed(name, "could not close its run", exc)
                continue
            self._pending[name] = []  # closing wrote the run's files whole
        self._open.clear()
        self._write_ledger()

    def _failed(self, name: str, what: str, exc: BaseException) -> None:
        """Drop tracker ``name`` with one warning; the run goes on without it."""
        tracker = self._open.pop(name, None)
        warnings.warn(
            f"tracker {name} {what} ({type(exc).__name__}: {exc}); training goes on "
            "without it, metrics.jsonl keeps every epoch",
            RuntimeWarning,
            stacklevel=3,
        )
        if tracker is not None:
            try:
                tracker.close(False)
            except Exception:  # already failing: the warning above says why
                logger.debug("closing tracker %s failed too", name, exc_info=True)

    def _read_ledger(self) -> dict[str, Any]:
        if self.log_dir is None:
            return {}
        try:
            data = json.loads((self.log_dir / LEDGER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_ledger(self) -> None:
        if self.log_dir is None or not self._runs:
            return
        data = {
            n: {"id": i, "epoch": self._logged.get(n, 0), "pending": self._pending.get(n, [])}
            for n, i in self._runs.items()
        }
        path = self.log_dir / LEDGER
        try:
            path.with_suffix(".tmp").write_text(json.dumps(data), encoding="utf-8")
            os.replace(path.with_suffix(".tmp"), path)
        except OSError as exc:
            logger.warning("could not write %s: %s", path, exc)
