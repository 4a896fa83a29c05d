"""Experiment trackers on rank 0: TensorBoard, MLflow and Weights & Biases, one run per job.

Each epoch's record is logged at the global step on one thread of the
trackers' own, so a slow server never stops training; a tracker that cannot
start is an error before training, naming the fix, and one that fails later
is dropped with a warning. A resumed job continues the same runs through each
tracker's own resume (run ids and epoch records travel in the checkpoints):
TensorBoard's ``purge_step``, an MLflow run's metric history, W&B's
``resume="allow"`` with its monotonic step. So each epoch is logged once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import queue
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

__all__ = ["EXTRAS", "TRACKERS", "TRACKER_TIMEOUT_S", "TrackerError", "Trackers", "missing_extra"]

TRACKERS = ("tensorboard", "mlflow", "wandb")
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # module = extra
TRACKER_TIMEOUT_S = 60.0  # the longest fit waits for them: runs opening, last records
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
    def __init__(self, log_dir: Path, project: str, run: str | None, config: Any, records: Any):
        from torch.utils.tensorboard import SummaryWriter

        earlier = sorted(log_dir.glob("events.out.tfevents.*"))
        if run is None and earlier:
            # TensorBoard shows one directory's events as one run: an earlier run's go aside.
            aside = log_dir / f"tensorboard-earlier-{secrets.token_hex(3)}"
            aside.mkdir()
            for path in earlier:
                os.replace(path, aside / path.name)
        # Resumed: what the killed job wrote from the first record on is hidden, and sent again.
        purge = min((r[1] for r in records), default=None)
        self.writer = SummaryWriter(os.fspath(log_dir), purge_step=purge)
        if run is None and config is not None:
            self.writer.add_text("config", "    " + json.dumps(dict(config), indent=1), 0)
        for _, step, values in records:
            self.log(values, step)
        self.run_id = run or f"{log_dir.resolve()}#{secrets.token_hex(4)}"

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
    def __init__(self, log_dir: Path, project: str, run: str | None, config: Any, records: Any):
        from mlflow import MlflowClient

        self.client = client = MlflowClient()  # MLFLOW_TRACKING_URI, else ./mlruns
        self.held: set[int] = set()  # the steps a continued run holds: not logged again
        if run is not None:
            client.get_run(run)  # raises when the store does not hold it
            client.update_run(run, status="RUNNING")
            self.run_id, self.held = run, {m.step for m in client.get_metric_history(run, "epoch")}
        else:
            found = client.get_experiment_by_name(project)
            experiment = found.experiment_id if found else client.create_experiment(project)
            self.run_id = client.create_run(experiment).info.run_id
        for _, step, values in records:
            self.log(values, step)
        if run is None and config is not None:
            from mlflow.entities import Param

            params = [Param(k, json.dumps(v)[:6000]) for k, v in sorted(config.items())]
            for start in range(0, len(params), 100):  # the store's limit per batch
                client.log_batch(self.run_id, params=params[start : start + 100])
            client.log_dict(self.run_id, dict(config), "config.json")

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step not in self.held:  # the run's history says it holds this step
            now = int(time.time() * 1000)
            metrics = [Metric(k, v, now, step) for k, v in values.items()]
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, best: str | None, picture: Path | None, step: int) -> None:
        if best is not None:
            self.client.set_tag(self.run_id, "best_checkpoint", best)
        if picture is not None:
            self.client.log_artifact(self.run_id, os.fspath(picture))

    def close(self, finished: bool) -> None:
        if finished:  # a stopped job leaves its run RUNNING: the resumed one continues it
            self.client.set_terminated(self.run_id, status="FINISHED")


class _Wandb:
    def __init__(self, log_dir: Path, project: str, run: str | None, config: Any, records: Any):
        import wandb

        self.wandb = wandb
        self.run: Any = wandb.init(
            project=project,
            dir=os.fspath(log_dir),
            id=run,
            resume="allow" if run is not None else None,
            config=dict(config) if config is not None and run is None else None,
            reinit="create_new",
        )
        self.run_id = str(self.run.id)
        for _, step, values in records:
            if step >= self.run.step:  # W&B's steps only go up: those below it holds already
                self.log(values, step)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step, commit=True)

    def finish(self, best: str | None, picture: Path | None, step: int) -> None:
        if best is not None:
            self.run.summary["best_checkpoint"] = best
        if picture is not None:
            self.run.summary["curves"] = self.wandb.Image(os.fspath(picture))

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


_KINDS: dict[str, Any] = {"tensorboard": _TensorBoard, "mlflow": _Mlflow, "wandb": _Wandb}


def _run_on_thread() -> Callable[[Callable[[], Any] | None], Future[Any]]:
    """A submit function: jobs run in order on one daemon thread; the job None ends it.

    Not a ``ThreadPoolExecutor``, whose thread the interpreter joins at exit: a
    tracker's client hung mid-request must hold neither training nor the exit.
    """
    jobs: queue.SimpleQueue[tuple[Callable[[], Any] | None, Future[Any]]] = queue.SimpleQueue()

    def run() -> None:
        while (item := jobs.get())[0] is not None:
            try:
                item[1].set_result(item[0]())
            except BaseException as exc:  # handed to whoever waits for it
                item[1].set_exception(exc)

    def submit(job: Callable[[], Any] | None) -> Future[Any]:
        jobs.put((job, done := Future[Any]()))
        return done

    threading.Thread(target=run, name="ddpkit-trackers", daemon=True).start()
    return submit


class Trackers:
    """The trackers of one run on rank 0, called on a thread of their own (the module's doc).

    ``names`` of :data:`TRACKERS`; TensorBoard and W&B write in ``log_dir`` (None:
    W&B in the working directory, no TensorBoard); ``project`` names a new run's
    MLflow experiment and W&B project; :meth:`start` and :meth:`close` wait at
    most ``timeout`` seconds.
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
        self._open: dict[str, Any] = {}  # the trackers running, and each run's id:
        self._runs: dict[str, str] = {}  # kept for the checkpoints after a tracker fails
        self._records: list[list[Any]] = []  # [epoch, step, values] of each epoch of the run
        self._submit: Callable[[Callable[[], Any] | None], Future[Any]] | None = None
        self._starting = ""

    def start(self, runs: Any, config: Any, records: Sequence[Any] | None = None) -> dict[str, str]:
        """Open each tracker's run: the one of ``runs`` (a checkpoint's), else a new one.

        A continued run is sent the epoch ``records`` the checkpoint carries
        (:meth:`records`) and takes each once. Returns ``{tracker: run id}``.

        Raises:
            TrackerError: a tracker cannot start its run, or does not answer in
                ``timeout`` s (named, with what to do); the others are closed.
        """
        if not self._names:
            return {}
        self._records = [
            [int(r[0]), int(r[1]), _numbers(r[2])]
            for r in records or ()
            if isinstance(r, list | tuple) and len(r) == 3 and isinstance(r[2], Mapping)
        ]
        self._submit = submit = _run_on_thread()
        opened = submit(lambda: self._start(runs or {}, config))
        try:
            opened.result(timeout=self.timeout)
        except TrackerError:
            self._submit = None  # the runs opened were closed: nothing is left to wait for
            submit(None)
            raise
        except FutureTimeout:  # its thread, stuck in a tracker, opens no more and closes all
            self._submit = None
            self._names.clear()
            submit(None)
            raise TrackerError(
                f"tracker {self._starting} did not start its run in {self.timeout:g} s (its "
                f"server does not answer?): {_START_FIXES[self._starting]}"
            ) from None
        return dict(self._runs)

    def _start(self, runs: Mapping[str, Any], config: Any) -> None:
        for name in self._names:
            self._starting = name
            run_id = runs.get(name) if isinstance(runs.get(name), str) else None
            try:  # a run continued, or new in a resumed job, is sent the records it lacks
                kind, where = _KINDS[name], self.log_dir or Path.cwd()
                tracker = kind(where, self.project, run_id, config, self._records)
            except Exception as exc:
                for opened in self._open.values():  # as a stopped job leaves them
                    with contextlib.suppress(Exception):  # already failing: the error says why
                        opened.close(False)
                said = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                raise TrackerError(
                    f"tracker {name} could not start its run ({type(exc).__name__}: {said}): "
                    f"{_START_FIXES[name]}"
                ) from exc
            self._open[name], self._runs[name] = tracker, tracker.run_id
        if self._submit is None:  # start() gave up waiting: nothing it opened stays open
            self._each("could not close its run", "close", False)

    def runs(self) -> dict[str, str]:
        """``{tracker: run id}`` of the runs opened (what checkpoints record)."""
        return dict(self._runs)

    def records(self) -> list[list[Any]]:
        """The run's epoch records, ``[epoch, step, values]`` (what checkpoints carry)."""
        return [list(r) for r in self._records]

    def epoch(self, record: Mapping[str, Any], step: int) -> None:
        """Log one epoch's record at ``step`` (the optimizer steps so far); returns at once."""
        item = [int(record["epoch"]), step, _numbers(record)]
        self._records = [r for r in self._records if r[0] < item[0]] + [item]  # sent or not
        if self._submit is not None and self._open:
            self._submit(lambda: self._each(f"could not log epoch {item[0]}", "log", item[2], step))

    def finish(self, best: str | None, picture: Path | None) -> None:
        """The best checkpoint's path and the curves picture at the end (again by a resumed
        job with nothing left to train: each tracker keeps one of each)."""
        if self._submit is not None:
            step = self._records[-1][1] if self._records else 0
            what = "could not record the best checkpoint and curves"
            self._submit(lambda: self._each(what, "finish", best, picture, step))

    def close(self, finished: bool) -> None:
        """End the sessions, waiting at most ``timeout`` s; ``finished``: the runs are done
        (else they stay open for the job that resumes them). Safe to call twice."""
        submit, self._submit = self._submit, None
        if submit is None:
            return
        closed = submit(lambda: self._each("could not close its run", "close", finished))
        submit(None)
        try:
            closed.result(timeout=self.timeout)
        except FutureTimeout:
            warnings.warn(
                f"trackers {', '.join(self._open) or '(closing)'} did not finish in "
                f"{self.timeout:g} s (a server not answering?); metrics.jsonl keeps every "
                "epoch, and the checkpoints carry them for a resumed job to send",
                RuntimeWarning,
                stacklevel=2,
            )

    def _each(self, what: str, method: str, *args: Any) -> None:
        """``method(*args)`` on each open tracker; one that fails is dropped with a warning."""
        for name, tracker in list(self._open.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:
                self._open.pop(name, None)
                warnings.warn(
                    f"tracker {name} {what} ({type(exc).__name__}: {exc}); training goes on "
                    "without it, metrics.jsonl keeps every epoch",
                    RuntimeWarning,
                    stacklevel=2,
                )
                if method != "close":
                    with contextlib.suppress(Exception):  # already failing: the error says why
                        tracker.close(False)
