"""``make gpu-check`` and ``benchmarks/gpu.py`` on a machine without CUDA: one line, the list, 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")


def test_gpu_check_says_there_is_no_gpu_lists_its_checks_and_succeeds() -> None:
    done = subprocess.run(
        [sys.executable, "tests/gpu/gpu_check.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("make gpu-check: no CUDA device here")
    listed = [line.strip() for line in lines if "tests/gpu/test_gpu.py::" in line]
    assert len(listed) == 11
    assert sum(line.endswith("(needs 2 GPUs)") for line in listed) == 2
    assert any("fit_on_cuda_killed_mid_epoch_resumes_bit_exact[bf16-compile]" in x for x in listed)
    assert "benchmarks/gpu.py" in lines[-1]


def test_the_gpu_benchmark_says_it_measured_nothing_and_succeeds() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu.py"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("benchmarks/gpu.py: no CUDA device here")
