"""Tests of ``ddpkit.distributed.child``: the exit note a rank leaves its parent, and a child
that ends with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.distributed import child
from ddpkit.distributed.child import note_exit, read_note, write_notes_to
from ddpkit.testing import DistributedTestError, run_distributed

# Loads child.py alone (it needs only the standard library): importing ddpkit would load torch.
_LOAD = """
import importlib.util, os, subprocess, sys, time
spec = importlib.util.spec_from_file_location("child", {path!r})
child = importlib.util.module_from_spec(spec)
spec.loader.exec_module(child)
"""


def _script(body: str) -> str:
    return _LOAD.format(path=child.__file__) + body


def test_the_last_note_is_read_whole_and_stripped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(child, "_path", None)  # restored after the test
    write_notes_to(str(tmp_path), 3)
    note_exit("first")
    note_exit("  the hang watchdog ended this rank\n")
    assert read_note(str(tmp_path), 3) == "the hang watchdog ended this rank"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]  # no temporary left behind
    assert read_note(str(tmp_path), 2) == ""  # another child's: none


def test_a_note_that_cannot_be_read_or_decoded_is_not_an_error(tmp_path: Path) -> None:
    assert read_note(str(tmp_path / "gone"), 0) == ""
    (tmp_path / "0").write_bytes(b"stuck \xff\xfe in a collective")
    assert read_note(str(tmp_path), 0) == "stuck \ufffd\ufffd in a collective"
    (tmp_path / "1").mkdir()  # not a file
    assert read_note(str(tmp_path), 1) == ""


def test_note_exit_does_nothing_unstarted_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(child, "_path", None)
    note_exit("no parent of ddpkit's started this process")
    assert list(tmp_path.iterdir()) == []
    write_notes_to(str(tmp_path / "removed"), 0)  # the parent's directory is gone
    note_exit("nowhere to go")
    assert list(tmp_path.iterdir()) == []


def _note_then_exit(rank: int, world_size: int) -> None:
    note_exit("rank 0 stalled in all_reduce for 30 s")
    os._exit(7)


def test_the_parent_repeats_the_note_of_a_rank_that_exits_hard() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_note_then_exit, 1, init=None, timeout=60)
    message = str(info.value)
    assert "exited with code 7: rank 0 stalled in all_reduce for 30 s" in message
    assert "without returning" not in message


def test_a_child_whose_parent_is_already_gone_exits_at_once() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _script("child.die_with_parent(os.getppid() + 1)\nprint('on')")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (done.returncode, done.stdout) == (1, "")
    done = subprocess.run(
        [sys.executable, "-c", _script("child.die_with_parent(os.getppid())\nprint('on')")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (done.returncode, done.stdout) == (0, "on\n")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie that no init process has reaped yet counts as ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_a_child_ends_when_its_parent_is_killed(platform: str) -> None:
    """On Linux through the kernel; elsewhere (the watcher thread, forced here) within seconds."""
    grandchild = _script(f"sys.platform = {platform!r}\nchild.die_with_parent(os.getppid())\n")
    grandchild += "print('ready', flush=True)\ntime.sleep(60)\n"
    middle = _script(
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], stdout=subprocess.PIPE)\n"
        "assert p.stdout.readline() == b'ready\\n'\n"
        "print(p.pid, flush=True)\ntime.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait()
