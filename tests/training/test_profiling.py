"""The profiler switch: a trace of exactly the steps asked, on the ranks asked, nothing when off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit import ReportConfig, TrainConfig, fit
from ddpkit.training.profiling import peak_memory_mb


def _fit(report: ReportConfig, epochs: int = 2) -> list[dict[str, object]]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
    model = nn.Linear(4, 2)
    marked = nn.Sequential(model)
    history = fit(
        marked,
        DataLoader(data, batch_size=4),  # 6 steps an epoch
        torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        epochs=epochs,
        config=TrainConfig(normalize=None),
        report=report,
    )
    return history.records


def _steps_in(trace: Path) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith("ddpkit step ")})


def test_the_trace_holds_exactly_the_steps_asked_across_an_epoch_end(tmp_path: Path) -> None:
    records = _fit(
        ReportConfig(progress=False, verbose=False, log_dir=tmp_path, profile_steps=(5, 8))
    )
    traces = list((tmp_path / "profile").iterdir())
    assert [t.name for t in traces] == ["rank0.steps5-8.pt.trace.json"]
    # Three steps, 5 to 7 (the first epoch ends after step 5), each marked.
    assert _steps_in(traces[0]) == ["ddpkit step 5", "ddpkit step 6", "ddpkit step 7"]
    assert all(r["peak_memory_mb"] > 0 for r in records)


def test_a_rank_not_asked_and_a_run_without_the_switch_write_nothing(tmp_path: Path) -> None:
    _fit(
        ReportConfig(
            progress=False,
            verbose=False,
            log_dir=tmp_path,
            profile_steps=(0, 2),
            profile_ranks=(1,),
        ),
        epochs=1,
    )
    _fit(ReportConfig(progress=False, verbose=False, log_dir=tmp_path), epochs=1)
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("steps", [(3, 3), (-1, 2), (1,), (1.5, 2)])
def test_profile_steps_must_be_a_range_of_steps(steps: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="profile_steps must be"):
        ReportConfig(log_dir=tmp_path, profile_steps=steps)  # type: ignore[arg-type]


def test_profile_steps_needs_a_log_dir() -> None:
    with pytest.raises(ValueError, match="needs log_dir"):
        ReportConfig(profile_steps=(0, 1))


def test_peak_memory_on_the_cpu_is_the_resident_set() -> None:
    assert peak_memory_mb(torch.device("cpu")) > 10
