"""Trackers under kills, lost log directories, slow servers and runs that cannot start: each
epoch is in each tracker's run once, its end is recorded, and no tracker stops training.

Kinds: a fresh run in a used log directory; a resume after the last epoch was logged but
not saved (in the same ``log_dir``, or another); a kill between two trackers; a kill inside
the trackers' end; a tracking server slower than the hang watchdog; a tracker that cannot
start its run. Against the real libraries (TensorBoard's events, MLflow's file store).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from warm import warm_run  # type: ignore[import-not-found]

from ddpkit import CheckpointManager, ReportConfig, TrainConfig, fit, load_checkpoint
from ddpkit.testing import run_distributed
from ddpkit.training import trackers as trackers_module
from ddpkit.training.trackers import TrackerError, Trackers

pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local MLflow file store for this test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return tmp_path / "mlruns"


def _tb_epochs(directory: Path) -> list[tuple[int, float]]:
    """(step, epoch) of the ``epoch`` scalars in ``directory``'s own event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    if "epoch" not in events.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in events.Scalars("epoch")]


def _mlflow_epochs(store: Path, project: str) -> list[list[float]]:
    """Each run's logged epochs, in the order logged, for the runs of ``project``."""
    from mlflow import MlflowClient

    client = MlflowClient(store.as_uri())
    experiment = client.get_experiment_by_name(project)
    runs = client.search_runs([experiment.experiment_id])
    return [
        sorted(m.value for m in client.get_metric_history(r.info.run_id, "epoch")) for r in runs
    ]


def _fit(
    directory: Path,
    epochs: int,
    *,
    names: tuple[str, ...] = ("tensorboard",),
    log_dir: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    callbacks: tuple[object, ...] = (),
) -> int:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = [(torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))] * 2
    history = fit(
        model,
        data,
        torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        epochs=epochs,
        checkpoints=CheckpointManager(directory / "ckpt", overwrite=overwrite),
        resume=resume,
        config=TrainConfig(normalize=None),
        report=ReportConfig(
            progress=False,
            verbose=False,
            log_dir=log_dir or directory / "logs",
            trackers=names,
            project="bad-trackers",
        ),
        callbacks=list(callbacks),  # type: ignore[arg-type]
    )
    return len(history.records)


def test_a_fresh_run_in_a_used_log_dir_logs_every_epoch_to_tensorboard(tmp_path: Path) -> None:
    _fit(tmp_path, 2)
    earlier = _tb_epochs(tmp_path / "logs")
    assert [e for _, e in earlier] == [1, 2]
    _fit(tmp_path, 3, overwrite=True)  # a new run, the same directories
    assert [e for _, e in _tb_epochs(tmp_path / "logs")] == [1, 2, 3]
    # The earlier run's events are kept, beside (TensorBoard shows them as a run of their own).
    (aside,) = (tmp_path / "logs").glob("tensorboard-earlier-*")
    assert _tb_epochs(aside) == earlier
    runs = load_checkpoint(tmp_path / "ckpt" / "latest.pth")["extra"]["trackers"]
    assert runs["tensorboard"].startswith(str((tmp_path / "logs").resolve()))


@pytest.mark.parametrize("lost", ["the same log_dir", "another log_dir"])
def test_a_resume_after_an_epoch_logged_but_not_saved_logs_each_epoch_once(
    tmp_path: Path, mlflow_store: Path, lost: str
) -> None:
    names = ("tensorboard", "mlflow")
    _fit(tmp_path, 2, names=names)
    carried = load_checkpoint(tmp_path / "ckpt" / "latest.pth")["extra"]["tracker_records"]
    assert [(epoch, step) for epoch, step, _ in carried] == [(1, 2), (2, 4)]
    # The newest checkpoint is epoch 1's: the job was killed after logging epoch 2.
    os.replace(tmp_path / "ckpt" / "previous.pth", tmp_path / "ckpt" / "latest.pth")
    log_dir = tmp_path / "logs" if lost == "the same log_dir" else tmp_path / "elsewhere"
    assert _fit(tmp_path, 3, names=names, log_dir=log_dir, resume=True) == 2
    assert _mlflow_epochs(mlflow_store, "bad-trackers") == [[1, 2, 3]]  # one run, each once
    # TensorBoard: the killed job's epoch 2 hidden (purge_step), epoch 1 sent again from the
    # checkpoint (into another directory: all it holds), each epoch once.
    assert _tb_epochs(log_dir) == [(2, 1), (4, 2), (6, 3)]


def test_an_epoch_a_slow_tracker_has_not_sent_travels_in_the_checkpoint(
    tmp_path: Path, mlflow_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, inside = threading.Event(), threading.Event()
    original = trackers_module._Mlflow.log

    def held_up(self: object, values: dict[str, float], step: int) -> None:
        if values["epoch"] == 2:
            inside.set()
            release.wait(30)  # a kill here, between the two trackers
        original(self, values, step)  # type: ignore[arg-type]

    monkeypatch.setattr(trackers_module._Mlflow, "log", held_up)
    trackers = Trackers(("tensorboard", "mlflow"), tmp_path, "per-tracker")
    runs = trackers.start(None, None)
    trackers.epoch({"epoch": 1, "train_loss": 1.0}, 2)
    trackers.epoch({"epoch": 2, "train_loss": 0.5}, 4)
    assert inside.wait(30)
    records = trackers.records()  # what the epoch-2 checkpoint carries, MLflow still sending
    assert [(epoch, step) for epoch, step, _ in records] == [(1, 2), (2, 4)]
    release.set()
    trackers.close(False)
    # The job that resumes from there sends nothing twice, and the lost epoch once.
    again = Trackers(("tensorboard", "mlflow"), tmp_path, "per-tracker")
    again.start(runs, None, records)
    again.epoch({"epoch": 3, "train_loss": 0.25}, 6)
    again.close(False)
    assert _tb_epochs(tmp_path) == [(2, 1), (4, 2), (6, 3)]
    assert _mlflow_epochs(mlflow_store, "per-tracker") == [[1, 2, 3]]


def test_a_kill_inside_the_trackers_end_is_completed_by_the_resumed_job(
    tmp_path: Path, mlflow_store: Path
) -> None:
    from mlflow import MlflowClient

    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{ROOT / 'tests/helpers'}",
        "MLFLOW_TRACKING_URI": mlflow_store.as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    code = "from train_jobs import tracker_end_job; tracker_end_job({!r}, 2, {})"
    job = [sys.executable, "-c", code.format(str(tmp_path), True)]
    killed = warm_run(job, env=env, timeout=120)
    assert killed.returncode == -9
    client = MlflowClient(mlflow_store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tracker-end").experiment_id])
    assert "best_checkpoint" not in run.data.tags
    done = warm_run([sys.executable, "-c", code.format(str(tmp_path), False)], env=env, timeout=120)
    assert done.returncode == 0, done
    (run,) = client.search_runs([client.get_experiment_by_name("tracker-end").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["best_checkpoint"].endswith("best.pth")
    assert "curves.png" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert sorted(m.value for m in client.get_metric_history(run.info.run_id, "epoch")) == [1, 2]


def test_a_tracking_server_slower_than_the_watchdog_stalls_nothing(
    tmp_path: Path, mlflow_store: Path
) -> None:
    from train_jobs import slow_tracker_run  # type: ignore[import-not-found]

    began = time.monotonic()
    # Each answer takes 3 s, the watchdog's timeout is 2 s: training never waits for one.
    done = run_distributed(slow_tracker_run, 2, args=(str(tmp_path), 3.0), timeout=120)
    assert done == [2, 2]
    assert time.monotonic() - began < 90
    assert _mlflow_epochs(mlflow_store, "slow-tracker") == [[1, 2]]


def test_epochs_do_not_wait_for_a_slow_tracker(
    tmp_path: Path, mlflow_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = trackers_module._Mlflow.log

    def slow(self: object, values: dict[str, float], step: int) -> None:
        time.sleep(1.0)
        original(self, values, step)  # type: ignore[arg-type]

    monkeypatch.setattr(trackers_module._Mlflow, "log", slow)
    ends: list[float] = []
    ended = (lambda record: ends.append(time.monotonic()),)
    assert _fit(tmp_path, 4, names=("mlflow",), callbacks=ended) == 4
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    assert max(gaps) < 0.9, gaps  # an epoch is far shorter than one answer
    assert _mlflow_epochs(mlflow_store, "bad-trackers") == [[1, 2, 3, 4]]  # all sent by the end


def test_a_tracker_that_cannot_start_is_an_error_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")  # the store cannot be made under a file
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (blocked / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    with pytest.raises(TrackerError, match="tracker mlflow could not start its run") as caught:
        _fit(tmp_path, 2, names=("tensorboard", "mlflow"))
    assert "MLFLOW_TRACKING_URI" in str(caught.value)
    assert not (tmp_path / "ckpt" / "latest.pth").exists()  # nothing trained


def test_mlflow_skinny_without_a_tracking_uri_is_an_error_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        from mlflow import MlflowClient

        MlflowClient().get_experiment_by_name("x")
    except Exception:
        pass
    else:
        pytest.skip("this MLflow starts a local store without a tracking URI")
    with pytest.raises(TrackerError, match="MLFLOW_TRACKING_URI"):
        _fit(tmp_path, 1, names=("mlflow",))


def test_a_tracker_that_fails_later_warns_once_and_training_goes_on(
    tmp_path: Path, mlflow_store: Path
) -> None:
    import shutil

    def break_the_store(record: dict[str, object]) -> None:
        if record["epoch"] == 1 and mlflow_store.is_dir():
            time.sleep(0.5)  # epoch 1 reaches the store first
            shutil.rmtree(mlflow_store)
            mlflow_store.write_text("")  # from here on every call fails

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _fit(tmp_path, 3, names=("mlflow",), callbacks=(break_the_store,)) == 3
    said = [str(w.message) for w in caught if "tracker mlflow" in str(w.message)]
    assert len(said) == 1, said


def test_a_server_that_does_not_answer_at_the_start_is_an_error_within_the_timeout(
    tmp_path: Path, mlflow_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = threading.Event()

    def silent(self: object, *_: object) -> None:
        answer.wait(30)  # a tracking server that does not answer

    monkeypatch.setattr(trackers_module._Mlflow, "__init__", silent)
    trackers = Trackers(("tensorboard", "mlflow"), tmp_path, "silent", timeout=1.0)
    began = time.monotonic()
    with pytest.raises(TrackerError, match="tracker mlflow did not start its run in 1 s"):
        trackers.start(None, None)
    trackers.close(False)  # nothing left to wait for
    assert time.monotonic() - began < 5
    answer.set()


def test_fit_waits_for_a_silent_server_at_most_tracker_timeout(
    tmp_path: Path, mlflow_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = threading.Event()
    monkeypatch.setattr(trackers_module._Mlflow, "__init__", lambda *_: answer.wait(30) and None)
    model = nn.Linear(4, 2)
    began = time.monotonic()
    with pytest.raises(TrackerError, match="did not start its run in 2 s"):
        fit(
            model,
            [(torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))],
            torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            epochs=1,
            config=TrainConfig(normalize=None),
            report=ReportConfig(
                progress=False, log_dir=tmp_path, trackers=("mlflow",), tracker_timeout=2
            ),
        )
    assert time.monotonic() - began < 8
    answer.set()


def test_epochs_after_the_only_tracker_failed_still_travel_in_the_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original, calls, failed = trackers_module._TensorBoard.log, [0], threading.Event()

    def fails_once(self: object, values: dict[str, float], step: int) -> None:
        calls[0] += 1
        if calls[0] == 2:
            failed.set()
            raise OSError("No space left on device")
        original(self, values, step)  # type: ignore[arg-type]

    monkeypatch.setattr(trackers_module._TensorBoard, "log", fails_once)
    trackers = Trackers(("tensorboard",), tmp_path, "p")
    runs = trackers.start(None, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in (1, 2, 3, 4):
            trackers.epoch({"epoch": epoch, "train_loss": 1.0 / epoch}, 2 * epoch)
            if epoch == 2:  # the only tracker is dropped before epoch 3 ends
                assert failed.wait(30)
                time.sleep(0.2)
        trackers.close(False)
    assert ["could not log epoch 2" in str(w.message) for w in caught] == [True]
    records = trackers.records()
    assert [(e, step) for e, step, _ in records] == [(1, 2), (2, 4), (3, 6), (4, 8)]
    monkeypatch.setattr(trackers_module._TensorBoard, "log", original)
    again = Trackers(("tensorboard",), tmp_path, "p")  # the resumed job: the run is whole
    again.start(runs, None, records)
    again.close(True)
    assert [e for _, e in _tb_epochs(tmp_path)] == [1, 2, 3, 4]


def test_a_continued_run_without_records_keeps_its_history(tmp_path: Path) -> None:
    # A checkpoint of an earlier release carries run ids but no records: nothing is purged.
    trackers = Trackers(("tensorboard",), tmp_path, "p")
    runs = trackers.start(None, None)
    for epoch in (1, 2, 3):
        trackers.epoch({"epoch": epoch}, 2 * epoch)
    trackers.close(False)
    again = Trackers(("tensorboard",), tmp_path, "p")
    again.start(runs, None)
    again.epoch({"epoch": 4}, 8)
    again.close(True)
    assert _tb_epochs(tmp_path) == [(2, 1), (4, 2), (6, 3), (8, 4)]


def test_a_tracker_added_on_resume_gets_every_epoch_of_the_run(
    tmp_path: Path, mlflow_store: Path
) -> None:
    trackers = Trackers(("tensorboard",), tmp_path, "added")
    runs = trackers.start(None, None)
    for epoch in (1, 2):
        trackers.epoch({"epoch": epoch}, 2 * epoch)
    records = trackers.records()
    trackers.close(False)
    again = Trackers(("tensorboard", "mlflow"), tmp_path, "added")
    again.start(runs, None, records)
    again.epoch({"epoch": 3}, 6)
    again.close(True)
    assert _mlflow_epochs(mlflow_store, "added") == [[1, 2, 3]]


def test_a_start_that_timed_out_opens_no_more_runs_and_closes_what_it_opened(
    tmp_path: Path, mlflow_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original, closed = trackers_module._TensorBoard.__init__, threading.Event()

    def slow(self: object, *args: object) -> None:
        time.sleep(2)  # a log directory on a stalled network file system
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(trackers_module._TensorBoard, "__init__", slow)
    close = trackers_module._TensorBoard.close
    monkeypatch.setattr(
        trackers_module._TensorBoard,
        "close",
        lambda self, finished: (close(self, finished), closed.set())[0],
    )
    trackers = Trackers(("tensorboard", "mlflow"), tmp_path, "timed-out", timeout=1.0)
    with pytest.raises(TrackerError, match="tracker tensorboard did not start its run in 1 s"):
        trackers.start(None, None)
    assert closed.wait(10)  # opened late, closed at once
    from mlflow import MlflowClient

    assert MlflowClient(mlflow_store.as_uri()).get_experiment_by_name("timed-out") is None
