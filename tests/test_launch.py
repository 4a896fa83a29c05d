"""The suite's verdict does not depend on how it was started: a sample of the signal tests
passes with SIGINT ignored, stdin closed and no terminal, as under `nohup make test &`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent

# Tests that send SIGINT and need Python's own Ctrl-C handling in the process they signal.
_SAMPLE = [
    "distributed/test_spawning_restarts.py::test_ctrl_c_reaches_the_children_once_through_the_parent",
    "data/test_lmdb_build.py::test_interrupted_build_leaves_no_database[SIGINT]",
    "distributed/test_stops.py::test_a_second_ctrl_c_after_a_second_stops_at_once",
]


def _as_a_background_job() -> None:
    # What a non-interactive shell does to `cmd &`: SIGINT (and SIGQUIT) ignored,
    # inherited by every process the job starts.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(280)
def test_signal_tests_pass_with_sigint_ignored_no_stdin_and_no_terminal() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--timeout=200",
            *(str(TESTS_DIR / t) for t in _SAMPLE),
        ],
        stdin=subprocess.DEVNULL,  # stdin closed
        capture_output=True,
        text=True,
        timeout=260,
        env=env,
        cwd=TESTS_DIR.parent,
        start_new_session=True,  # setsid: no controlling terminal
        preexec_fn=_as_a_background_job,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{len(_SAMPLE)} passed" in done.stdout, done.stdout[-4000:]
