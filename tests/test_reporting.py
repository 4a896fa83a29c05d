"""Reporter: what rank 0 writes for each epoch, and that other ranks write nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ddpkit import ReportConfig
from ddpkit.reporting import Reporter


def test_rank_zero_writes_a_json_line_and_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = Reporter(ReportConfig(progress=False, log_dir=tmp_path / "logs"), is_main=True)
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        reporter.epoch({"epoch": 0, "train_loss": 1.25, "val_acc1": float("nan")})
        reporter.epoch({"epoch": 1, "train_loss": 0.5, "val_acc1": 75.0})
    reporter.close()
    reporter.close()  # twice is harmless
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"epoch": 0, "train_loss": 1.25, "val_acc1": None},  # nan is not JSON
        {"epoch": 1, "train_loss": 0.5, "val_acc1": 75.0},
    ]
    assert "epoch 1: train_loss 0.5, val_acc1 75" in caplog.text
    assert reporter.progress_bar(10, "epoch") is None  # progress=False


def test_other_ranks_write_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reporter = Reporter(ReportConfig(log_dir=tmp_path / "logs"), is_main=False)
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        reporter.epoch({"epoch": 0, "train_loss": 1.0})
    reporter.close()
    assert not (tmp_path / "logs").exists()
    assert reporter.progress_bar(10, "epoch") is None
    assert "epoch 0" not in caplog.text


def test_progress_bar_on_rank_zero() -> None:
    bar = Reporter(ReportConfig(), is_main=True).progress_bar(5, "epoch 1/2")
    assert bar is not None
    assert bar.total == 5
    bar.close()
