"""benchmarks/comm.py runs in a checkout: two namespaces, a tc-limited link, its table.

A short run (one round, 2 timed steps of timm's small ``test_resnet``): each
hook's row is printed, and the bytes the hooks count per step are the bytes
the rank's interface sent, within 10 % (TCP's framing, and a window of two
steps). Skipped, as the script skips, without root, ``ip`` or ``tc``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "comm.py"


@pytest.mark.timeout(240)
def test_the_benchmark_prints_each_hooks_step_time_and_bytes() -> None:
    command = [sys.executable, str(SCRIPT), "--rounds", "1", "--steps", "2", "--warmup", "3",
               "--arch", "test_resnet", "--image-size", "32", "--rate", "100mbit"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    if "skipped:" in done.stdout:
        pytest.skip(done.stdout.strip())
    rows = {
        m.group(1): (float(m.group(2)), float(m.group(3)))
        for m in re.finditer(r"^\| (none|bf16|powersgd) \|.*\| ([\d.e+-]+) \| ([\d.e+-]+) \|$",
                             done.stdout, re.MULTILINE)
    }  # fmt: skip
    assert set(rows) == {"none", "bf16", "powersgd"}, done.stdout
    for hook in ("none", "bf16"):  # 2 timed steps: the counter's window is a little off
        counted, sent = rows[hook]
        assert counted * 0.9 <= sent <= counted * 1.1, (hook, done.stdout)
    assert rows["bf16"][0] == pytest.approx(rows["none"][0] / 2, rel=0.01)
    assert rows["powersgd"][0] < rows["none"][0] / 2
    assert re.search(
        r"goal: bf16 step time <= 0\.65 of no hook's: [\d.]+, (met|MISSED)", done.stdout
    )
