"""Experiment trackers on rank 0: TensorBoard, MLflow and Weights & Biases, one run per job.

:class:`Trackers` is what :class:`ddpkit.training.reporting.Reporter` logs
through: the run's configuration once, each epoch's record at the global
step, and at the end the best checkpoint's path and ``curves.png``. Each
library is imported only when asked for (``ReportConfig(trackers=...)``).

Trackers never stop training. Every tracker call runs on one thread of its
own, in order; training hands it an epoch's record and goes on, so a server
that answers in 12 s (or never: MLflow retries for minutes) costs the loop
nothing. ``fit`` waits for it twice, each time at most ``timeout`` seconds:
while the runs open (a tracker asked for that cannot start its run is an
error before training, naming the fix) and at the end (what is still queued
then stays in the ledger, for a resume to send).

A job that is killed, preempted, requeued or restarted continues the *same*
tracker run: the run ids go into every checkpoint, and so does the ledger
(:meth:`Trackers.ledger`: per tracker the last epoch it received, the epochs
received or queued but not confirmed on disk, with their values and step,
and whether the run's end was recorded), which is also kept as
``trackers.json`` in ``log_dir``, rewritten as each tracker confirms each
epoch. A resumed run merges the two and asks each tracker which epochs its
run holds (:meth:`held`), so an epoch is logged once whatever was lost with
the killed job: the ledger file (another ``log_dir``, another node's disk),
an epoch W&B had not yet written (it writes its run file in the background,
every 15 s), or one still queued. A fresh run reads no ledger: an earlier
run's is not its own. A tracker that fails once running (a server down, a
full disk) is dropped with one warning; training goes on.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import queue
import secrets
import threading
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

__all__ = [
    "EXTRAS",
    "LEDGER",
    "TRACKERS",
    "TRACKER_TIMEOUT_S",
    "TrackerError",
    "Trackers",
    "missing_extra",
]

logger = logging.getLogger("ddpkit")

TRACKERS = ("tensorboard", "mlflow", "wandb")
# The module each tracker imports, and the extra that installs it.
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
LEDGER = "trackers.json"
# The longest fit waits for the trackers: while their runs open, and for the last records.
TRACKER_TIMEOUT_S = 60.0
# What to do when a tracker's run cannot start, by tracker.
_START_FIXES = {
    "tensorboard": "give ReportConfig(log_dir=) a directory this process can write",
    "mlflow": (
        "set MLFLOW_TRACKING_URI to your tracking server (http://host:5000); for a local "
        "store MLFLOW_TRACKING_URI=./mlruns with MLFLOW_ALLOW_FILE_STORE=true (an sqlite:// "
        'store needs the full package: pip install mlflow), or leave "mlflow" out of trackers'
    ),
    "wandb": (
        "run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to write the "
        'run here and `wandb sync` it later, or leave "wandb" out of trackers'
    ),
}


class TrackerError(RuntimeError):
    """A tracker asked for cannot start its run; raised before training, naming the fix."""


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
        self.log_dir = log_dir
        self.writer: Any = None

    def open(self, run_id: str | None, config: Mapping[str, Any] | None) -> str:
        from torch.utils.tensorboard import SummaryWriter

        if run_id is None:
            # TensorBoard shows a directory's event files as one run: an earlier run's
            # move to a directory of their own, a run of their own beside this one.
            earlier = sorted(self.log_dir.glob("events.out.tfevents.*"))
            if earlier:
                aside = self.log_dir / f"tensorboard-earlier-{secrets.token_hex(3)}"
                aside.mkdir()
                for path in earlier:
                    os.replace(path, aside / path.name)
        self.writer = SummaryWriter(os.fspath(self.log_dir))
        if run_id is None and config is not None:
            self.writer.add_text("config", "    " + json.dumps(dict(config), indent=1), 0)
        # Unique per run: a fresh run in the same directory is not the one before it.
        return run_id or f"{self.log_dir.resolve()}#{secrets.token_hex(4)}"

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def held(self) -> set[int]:
        """The epochs the event files in ``log_dir`` hold."""
        from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
            EventAccumulator,
        )

        events = EventAccumulator(os.fspath(self.log_dir), size_guidance={"scalars": 0})
        events.Reload()
        if "epoch" not in events.Tags().get("scalars", ()):
            return set()
        return {int(e.value) for e in events.Scalars("epoch")}

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
        if self.writer is not None:
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

    def held(self) -> set[int]:
        """The epochs the tracking store holds for this run."""
        return {int(m.value) for m in self.client.get_metric_history(self.run_id, "epoch")}

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
    durable = False  # its run file is written in the background: held() tells

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

    def held(self) -> set[int]:
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


class _Worker:
    """One daemon thread that makes every tracker call, in the order given.

    A thread rather than bounded calls on the training thread: a tracker's
    client cannot be interrupted mid-request, and a hung one must hold only
    its own thread (a daemon: it never holds the interpreter's exit either).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="ddpkit-trackers", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        done: Future[Any] = Future()
        self._jobs.put((job, done))
        return done

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done = item
            try:
                done.set_result(job())
            except BaseException as exc:  # handed to whoever waits for it
                done.set_exception(exc)


def _entry(value: Any) -> dict[str, Any] | None:
    """A ledger entry as read back (a file, a checkpoint), or None when it is not one."""
    if not isinstance(value, Mapping) or not isinstance(value.get("id"), str):
        return None
    pending = [
        [int(p[0]), int(p[1]), dict(p[2])]
        for p in value.get("pending") or ()
        if isinstance(p, list | tuple) and len(p) == 3 and isinstance(p[2], Mapping)
    ]
    epoch = value.get("epoch")
    return {
        "id": value["id"],
        "epoch": int(epoch) if isinstance(epoch, int | float) else 0,
        "pending": pending,
        "finished": value.get("finished") is True,
    }


def _merged(*entries: dict[str, Any] | None) -> dict[str, Any] | None:
    """One entry of the same run from several copies: the furthest of each, pending joined."""
    found = [e for e in entries if e is not None]
    if not found:
        return None
    pending: dict[int, list[Any]] = {}
    for entry in found:
        for item in entry["pending"]:
            pending.setdefault(item[0], item)
    return {
        "id": found[0]["id"],
        "epoch": max(e["epoch"] for e in found),
        "pending": [pending[e] for e in sorted(pending)],
        "finished": any(e["finished"] for e in found),
    }


class Trackers:
    """The trackers of one run on rank 0; every call is safe on a tracker that failed.

    All calls to the trackers' libraries run on one thread of this object's
    own: :meth:`epoch` and :meth:`finish` return at once, :meth:`start` and
    :meth:`close` wait at most ``timeout`` seconds.

    Args:
        names: the trackers (of :data:`TRACKERS`).
        log_dir: where TensorBoard and W&B write, and the ledger lives (None:
            the working directory for W&B, no ledger, no TensorBoard).
        project: the MLflow experiment and W&B project of a new run.
        timeout: the longest :meth:`start` and :meth:`close` wait for the trackers.
    """

    def __init__(
        self,
        names: tuple[str, ...],
        log_dir: str | os.PathLike[str] | None,
        project: str,
        *,
        timeout: float = TRACKER_TIMEOUT_S,
    ):
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.project, self.timeout = project, timeout
        self._names = [n for n in names if n != "tensorboard" or self.log_dir is not None]
        self._open: dict[str, Any] = {}
        self._runs: dict[str, str] = {}
        # The ledger, per tracker: the last epoch its run received; the epochs it received
        # but has not confirmed on disk, as [epoch, step, values]; whether its end is recorded.
        self._logged: dict[str, int] = {}
        self._pending: dict[str, list[list[Any]]] = {}
        self._finished: dict[str, bool] = {}
        self._queued: list[list[Any]] = []  # epochs handed to the thread, not yet through it
        self._lock = threading.Lock()  # the ledger: the thread writes it, checkpoints read it
        self._worker: _Worker | None = None
        self._starting = ""
        self._step = 0

    def start(
        self,
        runs: Mapping[str, Any] | None,
        config: Mapping[str, Any] | None,
        done_epochs: int = 0,
        ledger: Mapping[str, Any] | None = None,
    ) -> dict[str, str]:
        """Open each tracker's run: the one of ``runs`` (a checkpoint's), else a new one.

        ``done_epochs``: the epochs the resumed checkpoint holds; ``ledger``: the
        one it carries (:meth:`ledger`). A resumed run sends the epochs its
        tracker lacks, once. Returns ``{tracker: run id}`` for the checkpoints.

        Raises:
            TrackerError: a tracker cannot start its run, or does not answer in
                ``timeout`` s (named, with what to do); the others are closed.
        """
        if not self._names:
            return {}
        self._worker = worker = _Worker()
        opened = worker.submit(lambda: self._start(runs, config, done_epochs, ledger))
        try:
            opened.result(timeout=self.timeout)
        except TrackerError:
            self._worker = None  # the runs opened were closed: nothing is left to wait for
            worker.stop()
            raise
        except FutureTimeout:
            name = self._starting
            self._worker = None  # its thread is stuck in the tracker: never waited for again
            worker.stop()
            raise TrackerError(
                f"tracker {name} did not start its run in {self.timeout:g} s (its server does "
                f"not answer?): {_START_FIXES[name]}"
            ) from None
        return dict(self._runs)

    def _start(
        self,
        runs: Mapping[str, Any] | None,
        config: Mapping[str, Any] | None,
        done_epochs: int,
        ledger: Mapping[str, Any] | None,
    ) -> None:
        on_disk = self._read_ledger()
        for name in self._names:
            self._starting = name
            previous = runs.get(name) if runs else None
            run_id = previous if isinstance(previous, str) else None
            try:
                tracker = _KINDS[name](self.log_dir or Path.cwd(), self.project)
                self._runs[name] = tracker.open(run_id, config)
            except Exception as exc:
                self._close_open()
                raise TrackerError(
                    f"tracker {name} could not start its run ({type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}): "
                    f"{_START_FIXES[name]}"
                ) from exc
            self._open[name] = tracker
            self._logged[name], self._pending[name], self._finished[name] = 0, [], False
            if run_id is not None:  # a fresh run reads no ledger: an earlier run's is not its own
                self._continue(name, tracker, run_id, done_epochs, on_disk, ledger or {})
        self._write_ledger()

    def _continue(
        self,
        name: str,
        tracker: Any,
        run_id: str,
        done_epochs: int,
        on_disk: Mapping[str, Any],
        carried: Mapping[str, Any],
    ) -> None:
        """Take up run ``run_id``: what it holds, what the ledgers say, the epochs it lacks."""
        copies = [_entry(on_disk.get(name)), _entry(carried.get(name))]
        entry = _merged(*(e for e in copies if e is not None and e["id"] == run_id))
        try:
            held = tracker.held()
            # Without a ledger (a checkpoint of ddpkit before 0.4): its epochs were logged.
            logged = max(entry["epoch"] if entry else done_epochs, max(held, default=0))
            for epoch, step, values in entry["pending"] if entry else ():
                if epoch not in held:
                    tracker.log(values, step)  # lost with the killed job, or still queued
                    logged = max(logged, epoch)
                    if not tracker.durable:
                        self._pending[name].append([epoch, step, values])
        except Exception as exc:
            self._failed(name, "could not send the epochs its run lacks", exc)
            return
        with self._lock:
            self._logged[name] = logged
            self._finished[name] = bool(entry and entry["finished"])

    def runs(self) -> dict[str, str]:
        """``{tracker: run id}`` of the runs opened (what checkpoints record)."""
        return dict(self._runs)

    def ledger(self) -> dict[str, dict[str, Any]]:
        """The ledger as it stands, with the epochs still queued as pending (what checkpoints
        carry, so a resume on another node or into another ``log_dir`` loses nothing)."""
        with self._lock:
            return {
                name: {
                    "id": run,
                    "epoch": self._logged.get(name, 0),
                    "pending": [
                        *self._pending.get(name, []),
                        *(q for q in self._queued if q[0] > self._logged.get(name, 0)),
                    ],
                    "finished": self._finished.get(name, False),
                }
                for name, run in self._runs.items()
            }

    def epoch(self, record: Mapping[str, Any], step: int) -> None:
        """Log one epoch's record at ``step`` (the optimizer steps so far) to each tracker
        that does not hold that epoch yet; returns at once."""
        if self._worker is None or not self._open:
            return
        item = [int(record["epoch"]), step, _numbers(record)]
        with self._lock:
            self._queued.append(item)
        self._worker.submit(lambda: self._log(item))

    def _log(self, item: list[Any]) -> None:
        epoch, step, values = item
        self._step = step
        for name, tracker in list(self._open.items()):
            if epoch <= self._logged.get(name, 0):
                continue  # logged before the job stopped: a resumed run does not repeat it
            try:
                tracker.log(values, step)
                pending = self._pending[name]
                if not tracker.durable:
                    held = tracker.held()
                    pending = [p for p in [*pending, item] if p[0] not in held]
            except Exception as exc:
                self._failed(name, f"could not log epoch {epoch}", exc)
                continue
            with self._lock:
                self._logged[name], self._pending[name] = epoch, pending
            self._write_ledger()  # each tracker's progress as soon as it is confirmed
        with self._lock:
            self._queued.remove(item)

    def unfinished(self) -> bool:
        """Whether a tracker's run still lacks its end (the best checkpoint, the curves)."""
        return any(not self._finished.get(name, False) for name in list(self._open))

    def finish(self, best: str | None, picture: Path | None) -> None:
        """The best checkpoint's path and the curves picture, once per run, at the end of
        training (also by a resumed job that finds nothing left to train)."""
        if self._worker is not None:
            self._worker.submit(lambda: self._finish(best, picture))

    def _finish(self, best: str | None, picture: Path | None) -> None:
        for name, tracker in list(self._open.items()):
            if self._finished.get(name):
                continue
            try:
                tracker.finish(best, picture, self._step)
            except Exception as exc:
                self._failed(name, "could not record the best checkpoint and curves", exc)
                continue
            with self._lock:
                self._finished[name] = True
            self._write_ledger()

    def close(self, finished: bool) -> None:
        """End each tracker's session, waiting at most ``timeout`` s for what is queued:
        ``finished`` marks a run whose end is recorded done, else it stays open for the
        job that resumes it. Safe to call twice."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        closed = worker.submit(lambda: self._close(finished))
        worker.stop()
        try:
            closed.result(timeout=self.timeout)
        except FutureTimeout:
            with self._lock:
                late = sorted({q[0] for q in self._queued})
            warnings.warn(
                f"trackers {', '.join(self._open) or '(closing)'} did not finish in "
                f"{self.timeout:g} s (a server not answering?); "
                + (f"epochs {late} were not sent, " if late else "")
                + "metrics.jsonl keeps every epoch, and the checkpoints' ledger lets a resumed "
                "job send what the runs lack",
                RuntimeWarning,
                stacklevel=2,
            )

    def _close(self, finished: bool) -> None:
        for name, tracker in list(self._open.items()):
            try:
                tracker.close(finished and self._finished.get(name, False))
            except Exception as exc:
                self._failed(name, "could not close its run", exc)
                continue
            with self._lock:
                self._pending[name] = []  # closing wrote the run's files whole
        self._open.clear()
        self._write_ledger()

    def _close_open(self) -> None:
        """Close the runs opened so far, as a stopped job leaves them (open, for a retry)."""
        for name, tracker in list(self._open.items()):
            try:
                tracker.close(False)
            except Exception:  # already failing: the error raised says why
                logger.debug("closing tracker %s failed too", name, exc_info=True)
        self._open.clear()

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
        data = self.ledger()
        path = self.log_dir / LEDGER
        try:
            path.with_suffix(".tmp").write_text(json.dumps(data), encoding="utf-8")
            os.replace(path.with_suffix(".tmp"), path)
        except OSError as exc:
            logger.warning("could not write %s: %s", path, exc)
