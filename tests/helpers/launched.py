"""Running a training script as a launcher would, from the suite's server, and faulting it.

Shared by the example's fault tests: start a command (warm, so torch and timm
are imported once), wait for a step checkpoint, find a launcher's workers,
kill a whole tree, and show every rank's error when a run fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from warm import WarmProcess, warm_popen

LIMIT_S = 240


def launch(
    command: list[str],
    env: Mapping[str, str],
    cwd: Path,
    when: Callable[[WarmProcess], None] | None = None,
) -> tuple[int, str]:
    """Run ``command`` to its end, calling ``when(process)`` first; its status and output."""
    with warm_popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            if when is not None:
                try:
                    when(proc)
                except AssertionError as exc:  # what the run had printed by then, too
                    kill_tree(proc.pid)
                    out, _ = proc.communicate(timeout=30)
                    raise AssertionError(f"{exc}; the run's output:\n{shown(out)}") from None
            out, _ = proc.communicate(timeout=LIMIT_S)
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
    return proc.returncode, out


def shown(out: str) -> str:
    """What a failed assertion shows: every rank's error line, then the output's end."""
    errors = [
        line for line in out.splitlines() if re.match(r"\[rank\d+\]: \w+(Error|Exception)", line)
    ]
    return "\n".join([*errors, "[...]", out[-3000:]])


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def kill_tree(pid: int) -> None:
    for child in children(pid):
        kill_tree(child)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def workers(launcher: int) -> list[int]:
    """The training processes a launcher started (torchrun's or spawn's children)."""
    found = []
    for pid in children(launcher):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in command:
            found.append(pid)
    return found


def when_step_saved(checkpoints: Path, step: int) -> None:
    """Wait until the checkpoint of ``step`` exists."""
    name = checkpoints / f"step-{step:09d}.pth"
    deadline = time.monotonic() + LIMIT_S
    while not name.exists():
        assert time.monotonic() < deadline, f"{name} never appeared"
        time.sleep(0.01)
