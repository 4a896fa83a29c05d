"""Trackers against the real libraries, read back from what they wrote: one run per job.

A job is SIGKILLed after epoch 2 is logged and before its checkpoint is
written, then resumed to 3 epochs on another number of ranks: MLflow (a local
file store, read with ``MlflowClient``), W&B (offline; its run files read back
and synced as its server would, dropping steps below the run's) and
TensorBoard (its event reader, which applies ``purge_step``) each hold one run
with every epoch once, with the values of ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from train_jobs import tracker_job
from warm import warm_run  # type: ignore[import-not-found]

from ddpkit import ReportConfig
from ddpkit.testing import run_distributed
from ddpkit.training.trackers import Trackers

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

ROOT = Path(__file__).resolve().parents[2]


def _tracker_env(root: Path) -> dict[str, str]:
    return {
        "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps the file store for local use
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        # no system metrics, machine or git description: a faster start, the same history
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_META": "true",
        "WANDB_X_DISABLE_MACHINE_INFO": "true",
    }


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-rank job killed after logging epoch 2, resumed to 3 epochs on 2 ranks."""
    root = tmp_path_factory.mktemp("trackers")
    env = {**os.environ, **_tracker_env(root), "PYTHONPATH": f"{ROOT}:{ROOT / 'tests/helpers'}"}
    code = f"from train_jobs import tracker_job; tracker_job(0, 1, {str(root)!r}, 3, False, 2)"
    killed = warm_run([sys.executable, "-c", code], env=env, timeout=240)
    assert killed.returncode == -9  # SIGKILL, as a lost node or the OOM killer would
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _tracker_env(root).items():
            mp.setenv(key, value)
        run_distributed(tracker_job, 2, args=(str(root), 3, True), timeout=240)
    return root


@pytest.fixture(scope="module")
def resumed_elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kill, then a resume whose log directory is empty (rank 0 requeued onto a
    node whose disk lacks it): the checkpoint's records are all the trackers are sent."""
    root = tmp_path_factory.mktemp("trackers-elsewhere")
    env = {**os.environ, **_tracker_env(root), "PYTHONPATH": f"{ROOT}:{ROOT / 'tests/helpers'}"}
    code = f"from train_jobs import tracker_job; tracker_job(0, 1, {str(root)!r}, 3, False, 2)"
    killed = warm_run([sys.executable, "-c", code], env=env, timeout=240)
    assert killed.returncode == -9
    shutil.rmtree(root / "logs")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _tracker_env(root).items():
            mp.setenv(key, value)
        run_distributed(tracker_job, 1, args=(str(root), 3, True), timeout=240)
    return root


def test_resumed_on_an_empty_log_dir_every_tracker_holds_every_epoch_once(
    resumed_elsewhere: Path,
) -> None:
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = resumed_elsewhere
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((root / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("trackers-test").experiment_id])
    assert sorted(m.value for m in client.get_metric_history(run.info.run_id, "epoch")) == [1, 2, 3]
    events = EventAccumulator(str(root / "logs"))
    events.Reload()
    assert [e.value for e in events.Scalars("epoch")] == [1, 2, 3]
    assert [epoch for epoch, _ in _wandb_synced(root)] == [1, 2, 3]


def _jsonl(root: Path, which: int = 0) -> dict[int, float]:
    """metrics.jsonl's train_loss of each epoch, as first logged (``which=-1``: last)."""
    seen: dict[int, list[float]] = {}
    for line in (root / "logs" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "epoch" in record:
            seen.setdefault(record["epoch"], []).append(record["train_loss"])
    return {epoch: losses[which] for epoch, losses in seen.items()}


def test_mlflow_holds_one_run_with_every_epoch_once(killed_then_resumed: Path) -> None:
    from mlflow import MlflowClient

    root = killed_then_resumed
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((root / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("trackers-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    epochs = client.get_metric_history(run.info.run_id, "epoch")
    assert sorted(m.value for m in epochs) == [1, 2, 3]
    losses = {int(e.value): e.step for e in epochs}
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}
    assert len(history) == 3
    assert {e: history[step] for e, step in losses.items()} == pytest.approx(_jsonl(root))
    assert sorted(losses.values()) == [2, 4, 6]  # the global step: 32 / 16 per epoch
    assert json.loads(run.data.params["lr"]) == {"value": 0.05, "source": "default"}
    assert run.data.tags["best_checkpoint"].endswith("best.pth")
    assert run.info.status == "FINISHED"
    pictures = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "curves.png" in pictures


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B ``.wandb`` file (LevelDB's log format: 32 KiB blocks)."""
    data, out, pending, pos = path.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        size, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + size], pos + 7 + size
        if kind == 1:
            out.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
            pending = b""
    return out


def _wandb_synced(root: Path) -> list[tuple[int, float]]:
    """(epoch, train_loss) of the run's history as W&B's server keeps it after ``wandb sync``
    of the offline runs in the order they ran: a row whose step is below the run's is dropped."""
    from wandb.proto import wandb_internal_pb2 as pb

    ids, rows, last = set(), [], -1
    for file in sorted((root / "logs" / "wandb").glob("offline-run-*/run-*.wandb")):
        for data in _wandb_records(file):
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                row = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                if "epoch" in row and row["_step"] > last:  # W&B's own rows aside
                    rows.append((row["epoch"], row["train_loss"]))
                    last = row["_step"]
    assert len(ids) == 1
    return rows


def test_wandb_holds_one_run_with_every_epoch_once(killed_then_resumed: Path) -> None:
    root = killed_then_resumed
    assert len(list((root / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))) == 2
    synced = _wandb_synced(root)
    assert [epoch for epoch, _ in synced] == [1, 2, 3]
    first, last = _jsonl(root), _jsonl(root, -1)
    for epoch, loss in synced:  # the killed job's epoch 2 if it was written, else the resumed's
        assert loss in (pytest.approx(first[epoch]), pytest.approx(last[epoch]))


def test_tensorboard_holds_every_epoch_once(killed_then_resumed: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(killed_then_resumed / "logs"))
    events.Reload()
    epochs = [(e.step, e.value) for e in events.Scalars("epoch")]
    assert epochs == [(2, 1), (4, 2), (6, 3)]
    losses = {int(v): events.Scalars("train_loss")[i].value for i, (_, v) in enumerate(epochs)}
    assert losses == pytest.approx(_jsonl(killed_then_resumed, -1))  # epoch 2 sent again


def test_every_checkpoint_records_the_tracker_runs_and_epochs(killed_then_resumed: Path) -> None:
    import ddpkit

    extra = ddpkit.load_checkpoint(killed_then_resumed / "ckpt" / "latest.pth")["extra"]
    assert sorted(extra["trackers"]) == ["mlflow", "tensorboard", "wandb"]
    assert [(e, step) for e, step, _ in extra["tracker_records"]] == [(1, 2), (2, 4), (3, 6)]
    assert extra["config"] == {"lr": {"value": 0.05, "source": "default"}}


def test_a_continued_tensorboard_run_takes_each_epoch_once(tmp_path: Path) -> None:
    trackers = Trackers(("tensorboard",), tmp_path, "p")
    runs = trackers.start(None, {"a": 1})
    trackers.epoch({"epoch": 1, "train_loss": 1.0}, 5)
    records = trackers.records()  # the epoch-1 checkpoint's
    trackers.epoch({"epoch": 2, "train_loss": 0.5}, 10)  # logged, then the job was killed
    trackers.close(False)
    again = Trackers(("tensorboard",), tmp_path, "p")
    assert again.start(runs, None, records) == runs
    again.epoch({"epoch": 2, "train_loss": 0.4}, 10)  # retrained after the resume
    again.close(True)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [
        (5, 1.0),
        (10, pytest.approx(0.4)),
    ]


def test_unknown_or_missing_trackers_are_refused() -> None:
    with pytest.raises(ValueError, match="trackers must be a tuple of"):
        ReportConfig(trackers=("neptune",))
    with pytest.raises(ValueError, match="trackers must be a tuple of"):
        ReportConfig(trackers=("mlflow", 3))  # type: ignore[arg-type]
    for bad in (0, -1, float("nan"), "60", True):
        with pytest.raises(ValueError, match="tracker_timeout must be a positive number"):
            ReportConfig(tracker_timeout=bad)  # type: ignore[arg-type]
