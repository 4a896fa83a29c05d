"""spawn(max_restarts=...): restarts after a failure; preemption and signals sent to the parent."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from restart_jobs import always_die, die_on_first_attempt, preempt_every_rank, preempt_rank_one
from warm import WarmProcess, warm_popen  # type: ignore[import-not-found]

import ddpkit
from ddpkit.distributed.stops import HANG_EXIT_CODE, PREEMPTED_EXIT_CODE, HangStopped, Preempted

TESTS_DIR = Path(__file__).resolve().parents[1] / "helpers"


def _attempts(outdir: Path, rank: int) -> list[int]:
    """The attempts in which ``rank`` reached the job function, from its marker files."""
    return sorted(int(p.name[7:].split("-")[0]) for p in outdir.glob(f"attempt*-rank{rank}"))


@pytest.mark.timeout(180)
def test_a_killed_rank_restarts_all_processes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        out = ddpkit.spawn(die_on_first_attempt, 2, args=(str(tmp_path),), max_restarts=1)
    # (rank, info.restart_count, TORCHELASTIC_RESTART_COUNT) from the second attempt.
    assert out == [(0, 1, "1"), (1, 1, "1")]
    assert _attempts(tmp_path, 1) == [0, 1]
    assert (tmp_path / "attempt0-rank1").read_text() == "0 0"
    assert (tmp_path / "attempt1-rank0").read_text() == "1 1"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("rank 1 of 2 failed: exited with code -9")
    assert warnings[0].endswith("restarting all 2 processes (restart 1 of 1)")


@pytest.mark.timeout(180)
def test_a_restart_does_not_meet_in_the_store_file_of_the_failed_attempt(tmp_path: Path) -> None:
    # The ranks host this store themselves, in a file that outlives a SIGKILL.
    url = f"file://{tmp_path}/rendezvous"
    out = ddpkit.spawn(
        die_on_first_attempt, 2, args=(str(tmp_path),), init_method=url, max_restarts=1
    )
    assert out == [(0, 1, "1"), (1, 1, "1")]


@pytest.mark.timeout(120)
def test_without_restarts_a_killed_rank_fails_the_job(tmp_path: Path) -> None:
    with pytest.raises(ddpkit.RankFailedError) as info:
        ddpkit.spawn(die_on_first_attempt, 2, args=(str(tmp_path),))
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 of 2 failed: exited with code -9")
    assert "max_restarts" not in str(info.value)
    assert _attempts(tmp_path, 1) == [0]


@pytest.mark.timeout(240)
def test_when_restarts_run_out_the_last_failure_is_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="ddpkit"),
        pytest.raises(ddpkit.RankFailedError) as info,
    ):
        ddpkit.spawn(always_die, 2, args=(str(tmp_path),), max_restarts=2)
    assert _attempts(tmp_path, 1) == [0, 1, 2]  # exactly three attempts
    assert info.value.rank == 1
    lines = str(info.value).splitlines()
    assert lines[0].startswith("rank 1 of 2 failed: exited with code -9")
    assert lines[1] == "(after 2 restarts, max_restarts=2)"
    restarts = [r.getMessage() for r in caplog.records if "restarting all" in r.getMessage()]
    assert [m[-len("(restart 1 of 2)") :] for m in restarts] == [
        "(restart 1 of 2)",
        "(restart 2 of 2)",
    ]


@pytest.mark.timeout(120)
def test_a_preemption_is_raised_as_such_and_never_restarted(tmp_path: Path) -> None:
    with pytest.raises(Preempted) as info:
        ddpkit.spawn(preempt_every_rank, 2, args=(str(tmp_path),), max_restarts=2)
    assert (info.value.signal_name, info.value.step) == ("SIGUSR1", 3)
    assert info.value.checkpoint == "/ckpt/step3.pt"  # rank 0's, the rank that saved
    assert info.value.code == PREEMPTED_EXIT_CODE
    assert _attempts(tmp_path, 0) == _attempts(tmp_path, 1) == [0]


@pytest.mark.timeout(120)
def test_a_rank_preempted_alone_is_a_preemption_not_its_peer_failure(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(Preempted) as info:
        ddpkit.spawn(preempt_rank_one, 2, args=(str(tmp_path),), max_restarts=1)
    # Rank 0 lost its peer in the barrier: an echo, not a failure worth a restart.
    assert (info.value.signal_name, info.value.step) == ("SIGTERM", 7)
    assert _attempts(tmp_path, 1) == [0]
    assert time.monotonic() - start < 90  # not the stop grace for a rank that never ends


def test_restart_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="max_restarts must be at least 0, got -1"):
        ddpkit.spawn(print, 1, max_restarts=-1)
    with pytest.raises(ValueError, match="max_restarts must be an int"):
        ddpkit.spawn(print, 1, max_restarts=True)
    with pytest.raises(ValueError, match="needs a coordinator") as info:
        ddpkit.spawn(print, 2, nnodes=2, init_method="tcp://127.0.0.1:1", max_restarts=1)
    assert "torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d" in str(
        info.value
    )


# --- signals sent to a spawn parent that runs as a process of its own ---------

_PARENT = textwrap.dedent(
    """
    import signal, sys
    # The SIGINT disposition the test needs, whatever this process inherited: a
    # suite started with `&` from a script hands every child an ignored SIGINT.
    ignored = sys.argv[3] == "ignored"
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
    sys.path.insert(0, sys.argv[1])
    import ddpkit
    import restart_jobs
    ddpkit.spawn(getattr(restart_jobs, sys.argv[2]), 2)
    """
)


def _start_parent(job: str, stderr: IO[str], sigint: str = "default") -> WarmProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    # A session of its own: its process group stands for a terminal's foreground job.
    return warm_popen(
        [sys.executable, "-c", _PARENT, str(TESTS_DIR), job, sigint],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        start_new_session=True,
    )


def _wait_for(parent: WarmProcess, err: IO[str], word: str, count: int) -> list[list[str]]:
    """Read the children's stdout lines up to ``count`` that start with ``word``."""
    assert parent.stdout is not None
    found: list[list[str]] = []
    while len(found) < count:
        line = parent.stdout.readline()
        if not line:
            err.seek(0)
            pytest.fail(
                f"the parent ended ({parent.wait()}) before {word!r}:\n{err.read()[-3000:]}"
            )
        if line.startswith(word + " "):
            found.append(line.split())
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _cleanup(parent: WarmProcess, pids: list[int]) -> Iterator[None]:
    try:
        yield
    finally:
        parent.kill()
        parent.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(150)
def test_sigterm_to_the_parent_stops_the_children_and_exits_75(tmp_path: Path) -> None:
    pids: list[int] = []
    with (tmp_path / "stderr").open("w+") as err:
        parent = _start_parent("wait_for_a_signal", err)
        with _cleanup(parent, pids):
            pids += [int(pid) for _, _, pid in _wait_for(parent, err, "ready", 2)]
            os.kill(parent.pid, signal.SIGTERM)  # as a scheduler does
            stopping = _wait_for(parent, err, "stopping", 2)
            status = parent.wait(timeout=90)
        err.seek(0)
        assert status == PREEMPTED_EXIT_CODE, err.read()[-3000:]
    assert sorted(" ".join(s[1:]) for s in stopping) == ["0 SIGTERM", "1 SIGTERM"]
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(150)
def test_ctrl_c_reaches_the_children_once_through_the_parent(tmp_path: Path) -> None:
    pids: list[int] = []
    with (tmp_path / "stderr").open("w+") as err:
        parent = _start_parent("wait_for_a_signal", err)
        with _cleanup(parent, pids):
            pids += [int(pid) for _, _, pid in _wait_for(parent, err, "ready", 2)]
            # Each child leads a process group of its own, outside the terminal's.
            assert [os.getpgid(pid) for pid in pids] == pids
            os.killpg(parent.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
            stopping = _wait_for(parent, err, "stopping", 2)
            status = parent.wait(timeout=90)
        err.seek(0)
        stderr = err.read()
    assert status != 0
    assert "KeyboardInterrupt" in stderr
    assert sorted(" ".join(s[1:]) for s in stopping) == ["0 SIGINT", "1 SIGINT"]
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(150)
def test_a_second_ctrl_c_kills_the_children(tmp_path: Path) -> None:
    pids: list[int] = []
    with (tmp_path / "stderr").open("w+") as err:
        parent = _start_parent("ignore_sigint", err)
        with _cleanup(parent, pids):
            pids += [int(pid) for _, _, pid in _wait_for(parent, err, "ready", 2)]
            os.killpg(parent.pid, signal.SIGINT)
            _wait_for(parent, err, "sigint", 2)  # forwarded, and ignored by the job
            time.sleep(1.2)  # a second press, not the first one bouncing
            os.killpg(parent.pid, signal.SIGINT)
            status = parent.wait(timeout=60)
        err.seek(0)
        stderr = err.read()
    assert status != 0
    assert "KeyboardInterrupt" in stderr
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.timeout(150)
def test_a_watchdog_stop_exits_124_with_the_watchdogs_finding(tmp_path: Path) -> None:
    with (tmp_path / "stderr").open("w+") as err:
        parent = _start_parent("stall_rank_one", err)
        with _cleanup(parent, []):
            status = parent.wait(timeout=120)
        err.seek(0)
        stderr = err.read()
    assert status == HANG_EXIT_CODE, stderr[-3000:]
    # The parent repeats the finding, which names rank 1: not "rank 0 failed".
    assert "spawn: hang watchdog: " in stderr, stderr[-3000:]
    assert "rank(s) 1 stopped at step 3 (waiting for training data)" in stderr
    assert "RankFailedError" not in stderr


def test_a_hang_stop_is_raised_as_such_in_the_parent() -> None:
    from ddpkit.distributed.processes import RankFailedError
    from ddpkit.distributed.spawning import _final

    finding = "hang watchdog: rank 1 stops at step 3 (waiting for training data)"
    hang = _final(RankFailedError("rank 0 of 2 failed", 0, "", HANG_EXIT_CODE, finding), 0, 0)
    assert isinstance(hang, HangStopped)
    assert (hang.code, str(hang)) == (HANG_EXIT_CODE, finding)
    other = RankFailedError("rank 0 of 2 failed", 0, "", HANG_EXIT_CODE, "")
    assert _final(other, 0, 0) is other  # a status 124 without the watchdog's word: a failure


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(150)
def test_sigterm_before_training_exits_143_and_says_nothing_was_saved(tmp_path: Path) -> None:
    pids: list[int] = []
    with (tmp_path / "stderr").open("w+") as err:
        parent = _start_parent("wait_before_fit", err)
        with _cleanup(parent, pids):
            pids += [int(pid) for _, _, pid in _wait_for(parent, err, "ready", 2)]
            os.kill(parent.pid, signal.SIGTERM)
            status = parent.wait(timeout=90)
        err.seek(0)
        stderr = err.read()
    # 75 promises interrupted.pth; here nothing was written: 128 + SIGTERM, as a shell says.
    assert status == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM before training began" in stderr
    assert "nothing was saved" in stderr
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(150)
def test_an_ignored_sigint_stays_ignored(tmp_path: Path) -> None:
    # Started with SIGINT ignored (`cmd &` from a script, nohup), spawn leaves it
    # so, as Python does: no handler, nothing forwarded, no process groups of the
    # children's own. Ctrl-C to the group reaches each child once, directly.
    pids: list[int] = []
    with (tmp_path / "stderr").open("w+") as err:
        parent = _start_parent("ignore_sigint", err, sigint="ignored")
        with _cleanup(parent, pids):
            pids += [int(pid) for _, _, pid in _wait_for(parent, err, "ready", 2)]
            assert [os.getpgid(pid) for pid in pids] == [parent.pid, parent.pid]
            os.killpg(parent.pid, signal.SIGINT)
            first = _wait_for(parent, err, "sigint", 2)
            time.sleep(1.2)  # a second press: with a handler, it would kill the children
            os.killpg(parent.pid, signal.SIGINT)
            second = _wait_for(parent, err, "sigint", 2)
            time.sleep(1.0)
            running = (parent.poll(), [pid for pid in pids if _alive(pid)])
    assert sorted(s[1] for s in first + second) == ["0", "0", "1", "1"]
    assert running == (None, pids)
