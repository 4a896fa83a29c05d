"""Reporter: what rank 0 shows and writes for each epoch and run; other ranks write nothing."""

from __future__ import annotations

import enum
import json
import logging
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import CheckpointManager, DistInfo, ReportConfig, TrainConfig, build_loader, fit
from ddpkit.training.reporting import DATA_WAIT_WARNING, Reporter, epoch_line

_HEADER = {"world_size": 2, "epochs": 3}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rank_zero_writes_a_run_header_json_lines_and_epoch_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reporter = Reporter(ReportConfig(progress=False, log_dir=tmp_path / "logs"), is_main=True)
    reporter.start(_HEADER, resumed=False)
    reporter.epoch({"epoch": 1, "train_loss": 1.25, "val_acc1": float("nan")}, 3)
    reporter.epoch({"epoch": 2, "train_loss": 0.5, "val_acc1": 75.0}, 3)
    reporter.close()
    reporter.close()  # twice is harmless
    header, *epochs = _lines(tmp_path / "logs" / "metrics.jsonl")
    assert header["run"]["world_size"] == 2
    assert header["run"]["resumed"] is False
    assert len(header["run"]["id"]) == 12
    assert epochs == [
        {"epoch": 1, "train_loss": 1.25, "val_acc1": None},  # nan is not JSON
        {"epoch": 2, "train_loss": 0.5, "val_acc1": 75.0},
    ]
    out = capsys.readouterr().out
    assert "epoch 2/3: train_loss 0.5000, val_acc1 75.00%" in out
    assert reporter.progress_bar(10, "epoch") is None  # progress=False


def test_a_fresh_run_starts_a_fresh_record_and_a_resumed_one_continues_it(tmp_path: Path) -> None:
    config = ReportConfig(progress=False, log_dir=tmp_path, verbose=False)
    first = Reporter(config, is_main=True)
    first.start(_HEADER, resumed=False)
    first.epoch({"epoch": 1, "train_loss": 1.0})
    first.close()
    run = _lines(tmp_path / "metrics.jsonl")[0]["run"]["id"]
    resumed = Reporter(config, is_main=True)
    resumed.start(_HEADER, resumed=True)
    resumed.epoch({"epoch": 2, "train_loss": 0.5})
    resumed.close()
    lines = _lines(tmp_path / "metrics.jsonl")
    assert [line.get("epoch") for line in lines] == [None, 1, None, 2]
    assert lines[2]["run"] == {"id": run, "resumed": True, **_HEADER}
    fresh = Reporter(config, is_main=True)
    fresh.start(_HEADER, resumed=False)
    fresh.close()
    assert _lines(tmp_path / f"metrics-{run}.jsonl") == lines  # the earlier run, kept whole
    restarted = _lines(tmp_path / "metrics.jsonl")
    assert len(restarted) == 1
    assert restarted[0]["run"]["id"] != run


def test_other_ranks_write_and_print_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reporter = Reporter(ReportConfig(log_dir=tmp_path / "logs"), is_main=False)
    reporter.start(_HEADER, resumed=False)
    reporter.epoch({"epoch": 1, "train_loss": 1.0}, 3)
    reporter.say("resuming")
    reporter.finish([{"epoch": 1, "val_acc1": 50.0}])
    reporter.close()
    assert not (tmp_path / "logs").exists()
    assert reporter.progress_bar(10, "epoch") is None
    assert capsys.readouterr().out == ""


def test_quiet_reporting_goes_to_the_ddpkit_logger(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    reporter = Reporter(ReportConfig(progress=False, verbose=False), is_main=True)
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        reporter.epoch({"epoch": 1, "train_loss": 1.0}, 2)
    assert capsys.readouterr().out == ""
    assert "epoch 1/2: train_loss 1.0000" in caplog.text


def test_a_bar_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    reporter = Reporter(ReportConfig(), is_main=True)
    # Forced both ways: `pytest -s` at a terminal leaves this process a terminal's stderr.
    monkeypatch.setattr("ddpkit.training.reporting._terminal", lambda: False)
    assert reporter.progress_bar(5, "epoch 1/2") is None
    monkeypatch.setattr("ddpkit.training.reporting._terminal", lambda: True)
    bar = reporter.progress_bar(5, "epoch 1/2")
    assert bar is not None
    assert bar.total == 5
    bar.close()


def test_the_epoch_line_names_a_data_bottleneck_and_its_fixes() -> None:
    record = {"epoch": 4, "train_loss": 0.1, "val_acc1": 90.0, "val_acc5": 99.5, "lr": 0.01,
              "train_images_per_sec": 1234.4, "data_wait": 0.1, "wall_seconds": 45.21}  # fmt: skip
    line = epoch_line(record, 90)
    assert line == (
        "epoch 4/90: train_loss 0.1000, val_acc1 90.00%, val_acc5 99.50%, lr 0.01, "
        "1234 img/s, data wait 10%, 45.2 s"
    )
    slow = epoch_line({**record, "data_wait": DATA_WAIT_WARNING + 0.2}, 90)
    assert "data wait 45%, 45.2 s; data loading is the bottleneck" in slow
    assert "workers" in slow
    assert "local disk" in slow


def test_the_summary_names_the_best_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    records = [
        {"epoch": 1, "val_acc1": 50.0, "train_images_per_sec": 100.0},
        {"epoch": 2, "val_acc1": 80.0, "train_images_per_sec": 300.0},
        {"epoch": 3, "val_acc1": 70.0, "train_images_per_sec": 200.0},
    ]
    Reporter(ReportConfig(progress=False), is_main=True).finish(records)
    out = capsys.readouterr().out
    assert "  best epoch      2\n" in out  # the values line up after the longest name
    assert "  best val_acc1   80.00%\n" in out
    assert "  images/s        200\n" in out  # the mean over the epochs
    assert "  epochs trained  3\n" in out


@pytest.mark.parametrize(
    ("splits", "said"),
    [
        ([[8, 32, 1]], None),  # one world all epoch: nothing to say
        ([[8, 32, 1], [4, 64, 1]],
         "world sizes [8, 4]: 256 samples a step, as 8 x 32 then 4 x 64 (the per-process batch "
         "changed)"),
        ([[4, 32, 1], [2, 32, 2]],
         "world sizes [4, 2]: 128 samples a step, as 4 x 32 then 2 x 32 x 2 accumulated (the "
         "accumulation steps changed)"),
        ([[2, 4, 1], [3, 4, 1]], "world sizes [2, 3]: steps of other sizes, as 2 x 4 then 3 x 4,"),
        ([[2, 0, 0], [1, 12, 1]], "world sizes [2, 1],"),  # a checkpoint of an older ddpkit
    ],
)  # fmt: skip
def test_the_epoch_line_says_how_the_steps_were_split_when_a_server_left_or_joined(
    splits: list[list[int]], said: str | None
) -> None:
    line = epoch_line({"epoch": 4, "train_loss": 0.5, "batch_splits": splits}, 90)
    if said is None:
        assert "world sizes" not in line
    else:
        assert said in line + ","


def test_the_epoch_line_shows_the_average_and_the_worst_class() -> None:
    record = {"epoch": 4, "train_loss": 0.5, "val_acc1": 80.0, "val_acc5": 99.0,
              "val_ema_acc1": 82.5, "val_worst_class": "cat", "val_worst_recall": 61.04,
              "lr": 0.1}  # fmt: skip
    line = epoch_line(record, 10)
    assert "val_acc1 80.00%, val_acc5 99.00%, val_ema_acc1 82.50%" in line
    assert "worst class cat 61.0%" in line
    assert "worst class" not in epoch_line({**record, "val_worst_recall": None}, 10)


class _Sched(enum.Enum):
    STEP = "step"


def test_fit_records_a_run_config_of_paths_enums_and_numpy_numbers(tmp_path: Path) -> None:
    # What vars(args) holds with type=Path and friends: written as text, loadable weights_only.
    run_config = {
        "data": tmp_path / "data",
        "sched": _Sched.STEP,
        "lr": np.float64(0.1),
        "epochs": np.int64(1),
        "milestones": (30, 60),
        "nested": {"out": PurePosixPath("runs/a")},
    }
    plain = {
        "data": str(tmp_path / "data"),
        "sched": "step",
        "lr": 0.1,
        "epochs": 1,
        "milestones": [30, 60],
        "nested": {"out": "runs/a"},
    }
    model = nn.Linear(4, 2)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    info = DistInfo(0, 0, 1, 1, 0, torch.device("cpu"), None, False)
    loader = build_loader(
        TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4, train=True, workers=0, info=info
    )
    fit(
        model,
        loader,
        torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        epochs=1,
        config=TrainConfig(normalize=None),
        checkpoints=CheckpointManager(tmp_path / "ck"),
        report=ReportConfig(
            progress=False, verbose=False, log_dir=tmp_path / "logs", run_config=run_config
        ),
    )
    header, epoch = _lines(tmp_path / "logs" / "metrics.jsonl")
    assert header["run"]["resolved"] == plain
    assert epoch["epoch"] == 1
    state = torch.load(tmp_path / "ck" / "latest.pth", weights_only=True)
    assert state["extra"]["config"] == plain


def test_a_run_config_json_cannot_hold_is_refused_before_any_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"run_config\['args'\]\['model'\]: .*\(Linear\)"):
        ReportConfig(log_dir=tmp_path / "logs", run_config={"args": {"model": nn.Linear(1, 1)}})
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    ("sent", "hook", "shown"),
    [(44_700_000.0, "none", "all-reduce 44.7 MB/step (none)"),
     (22_350_000.0, "bf16", "all-reduce 22.4 MB/step (bf16)"),
     (184_320.0, "powersgd", "all-reduce 0.184 MB/step (powersgd)")],
)  # fmt: skip
def test_the_epoch_line_says_what_a_step_all_reduced(sent: float, hook: str, shown: str) -> None:
    record = {"epoch": 2, "train_loss": 0.5, "comm_hook": hook, "comm_bytes_per_step": sent}
    assert shown in epoch_line(record, 4)
    assert "all-reduce" not in epoch_line({"epoch": 2, "comm_bytes_per_step": None}, 4)
