"""``make gpu-check``: every GPU test, then the GPU benchmark, in one table; within 8 minutes.

On a machine with CUDA: the tests of ``tests/gpu`` first (so a slow
benchmark never hides them), then ``benchmarks/gpu.py`` with the time left;
one table (check, result, figure); exit status 1 if any check failed. On a
machine without CUDA: one line that says so, the checks it would run, exit 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 480.0  # the whole check
TESTS_S = 300.0  # at most, for the tests; the benchmark gets what is left
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/gpu", "-m", "gpu"]


def _collected() -> list[str]:
    done = subprocess.run(
        [*PYTEST, "--collect-only", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    return [line for line in done.stdout.splitlines() if "::" in line]


def _needs(test_id: str) -> str:
    """`` (needs 2 GPUs)`` for a test marked so, else ``""``."""
    sys.path[:0] = [str(ROOT / "tests" / "helpers"), str(ROOT)]
    import importlib

    module = importlib.import_module("tests.gpu.test_gpu")
    function = getattr(module, test_id.split("::")[-1].split("[")[0], None)
    marks = getattr(function, "pytestmark", [])
    return next(
        (f" ({m.kwargs['reason']})" for m in marks if "GPUs" in m.kwargs.get("reason", "")), ""
    )


def _test_rows(report: Path) -> list[tuple[str, str, str]]:
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "?")
        seconds = f"{float(case.get('time', 0)):.1f} s"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            message = (
                (failed.get("message") or "").splitlines()[0][:60] if failed.get("message") else ""
            )
            rows.append((name, "FAIL", message or seconds))
        elif skipped is not None:
            rows.append((name, "skip", (skipped.get("message") or "")[:60]))
        else:
            rows.append((name, "pass", seconds))
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "make gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing run."
        )
        print("On a machine with CUDA it runs, within 8 minutes:")
        for test in _collected():
            print(f"  {test}{_needs(test)}")
        print("  benchmarks/gpu.py (SE-ResNeXt-101 images/s: seed pipeline, ddpkit, GPU decode)")
        return 0
    began = time.monotonic()
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-gpu-check-") as tmp:
        report = Path(tmp, "tests.xml")
        try:
            tests = subprocess.run(
                [*PYTEST, f"--junitxml={report}", "--timeout=240", "-q"],
                cwd=ROOT,
                timeout=TESTS_S,
            )
            if tests.returncode not in (0, 1):  # 1: a test failed, in the rows below
                rows.append(("tests/gpu", "FAIL", f"pytest exited with status {tests.returncode}"))
        except subprocess.TimeoutExpired:
            rows.append(("tests/gpu", "FAIL", f"over {TESTS_S:.0f} s"))
        if report.is_file():
            rows.extend(_test_rows(report))
        left = BUDGET_S - (time.monotonic() - began) - 20
        figures = Path(tmp, "gpu.json")
        if left > 60:
            try:
                bench = subprocess.run(
                    [
                        sys.executable,
                        "benchmarks/gpu.py",
                        "--seconds",
                        str(left * 0.6),
                        "--json",
                        str(figures),
                    ],
                    cwd=ROOT,
                    timeout=left,
                )
                ok = bench.returncode == 0 and figures.is_file()
            except subprocess.TimeoutExpired:
                ok = False
            if ok:
                data = json.loads(figures.read_text())
                for key, value in data.items():
                    if key != "gpu":
                        unit = "" if "/" in key else " img/s"
                        rows.append((f"benchmark {key}", "pass", f"{value:.2f}{unit}"))
            else:
                rows.append(("benchmarks/gpu.py", "FAIL", "no figures (see its output above)"))
        else:
            rows.append(("benchmarks/gpu.py", "skip", "no time left within 8 minutes"))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':{width}}  result  figure")
    for name, result, figure in rows:
        print(f"{name:{width}}  {result:6}  {figure}")
    gpus = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    print(f"({time.monotonic() - began:.0f} s on {gpus})")
    return 1 if any(result == "FAIL" for _, result, _ in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.exit(main())
