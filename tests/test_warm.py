"""tests/helpers/warm.py: a script run from the preloaded server behaves as under a fresh python."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warm import PIPE, STDOUT, warm_popen, warm_run  # type: ignore[import-not-found]

_SCRIPT = """\
import atexit, os, signal, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread ended", flush=True))).start()
print("argv", sys.argv[1:], "path0", sys.path[0], "cwd", os.getcwd(), "FOO", os.environ.get("FOO"))
sid = os.getsid(0) == os.getpid()
print("main", __name__, "sigint", signal.getsignal(signal.SIGINT), "sid", sid)
import multiprocessing
print("start method", multiprocessing.get_start_method(allow_none=True))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "exit3":
    sys.exit(3)
if how == "exit-text":
    sys.exit("a message")
if how == "raise":
    raise ValueError("boom")
if how == "interrupt":
    raise KeyboardInterrupt
"""

_CASES = ["fine", "exit3", "exit-text", "raise", "interrupt"]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "job.py"
    path.parent.mkdir()
    path.write_text(_SCRIPT, encoding="utf-8")
    return path


def _both(argv: list[str], cwd: Path, ignore_sigint: bool = False) -> tuple[object, object]:
    env = dict(os.environ, FOO="bar", PYTHONPATH=str(cwd))
    handler = signal.SIG_IGN if ignore_sigint else signal.default_int_handler
    previous = signal.signal(signal.SIGINT, handler)
    try:
        warm = warm_run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
        fresh = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    return warm, fresh


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", _CASES)
def test_a_script_ends_as_under_python(how: str, script: Path, tmp_path: Path) -> None:
    warm, fresh = _both([sys.executable, str(script), how], tmp_path)
    assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout)  # type: ignore[attr-defined]
    assert warm.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]  # type: ignore[attr-defined]
    assert "thread ended\natexit ran" in warm.stdout  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_a_module_and_code_run_as_under_python(script: Path, tmp_path: Path) -> None:
    (tmp_path / "jobmod.py").write_text(_SCRIPT, encoding="utf-8")
    for argv in (
        [sys.executable, "-m", "jobmod", "exit3"],
        [sys.executable, "-c", _SCRIPT, "raise"],
    ):
        warm, fresh = _both(argv, tmp_path)
        assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout)  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_an_ignored_sigint_is_inherited_as_under_python(script: Path, tmp_path: Path) -> None:
    warm, fresh = _both([sys.executable, str(script), "fine"], tmp_path, ignore_sigint=True)
    assert f"sigint {int(signal.SIG_IGN)} " in warm.stdout  # type: ignore[attr-defined]
    assert warm.stdout == fresh.stdout  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_signals_sessions_and_a_pipe_read_while_it_runs(tmp_path: Path) -> None:
    code = "import os, sys, time\nprint(os.getsid(0) == os.getpid(), flush=True)\ntime.sleep(60)"
    started = time.monotonic()
    proc = warm_popen([sys.executable, "-c", code], stdout=PIPE, stderr=STDOUT, text=True,
                      start_new_session=True)  # fmt: skip
    assert proc.stdout.readline() == "True\n"  # its own session, read before it ends
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert time.monotonic() - started < 30  # not the 60 s the script would sleep
    with pytest.raises(ValueError, match="python SCRIPT"):
        warm_popen(["bash", "-c", "true"])


def test_a_rank_starts_its_forkserver_workers_from_the_suite_server() -> None:
    # A rank of run_distributed (forked from the server) hands its DataLoader
    # workers' start to that server instead of starting a fresh interpreter.
    from train_jobs import worker_parents  # type: ignore[import-not-found]
    from warm import SERVER_VARIABLE, start_server  # type: ignore[import-not-found]

    from ddpkit.testing import run_distributed

    start_server()
    server = int(os.environ[SERVER_VARIABLE])
    for result in run_distributed(worker_parents, 2, start_method="forkserver", timeout=120):
        assert result["parents"] == {server}, "a worker came from another process"
        assert result["rank"] != server
        assert result["server started"] is None, "the rank started a forkserver of its own"


_HELPERS = Path(__file__).resolve().parent / "helpers"


def _shell(
    command: str, cwd: Path, *, shim: bool, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """``bash -c command`` as the docs runner starts it, with or without the `python` shim."""
    path = [str(_HELPERS / "bin")] if shim else []
    path += [str(Path(sys.executable).parent), os.environ["PATH"]]
    env = dict(os.environ, FOO="bar", PATH=os.pathsep.join(path), DDPKIT_TEST_PYTHON=sys.executable)
    env.pop("PYTHONUNBUFFERED", None)  # python's own buffering, which -u changes
    env["PYTHONPATH"] = f"{_HELPERS}{os.pathsep}{cwd}"
    return subprocess.run(["bash", "-c", command], env=env, cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.timeout(120)
def test_the_python_of_the_docs_shell_blocks_is_warm_and_behaves_as_python(
    script: Path, tmp_path: Path
) -> None:
    from warm import start_server  # type: ignore[import-not-found]

    start_server()
    (tmp_path / "jobmod.py").write_text(_SCRIPT, encoding="utf-8")
    commands = [f"python {script} {how}; echo status $?" for how in _CASES]
    commands += ["python -m jobmod exit3; echo status $?",
                 "python -c 'import sys; print(sys.stdin.read().upper(), sys.argv)' a b",
                 "python -u -c 'print(1)'; python --version",
                 "python no-such-script.py; echo status $?; python -c; echo status $?",
                 "python -c 'import sys; print(sys.stdin.read())' <&-; echo status $?"]  # fmt: skip
    for command in commands:
        warm = _shell(command, tmp_path, shim=True, stdin="from a pipe")
        fresh = _shell(command, tmp_path, shim=False, stdin="from a pipe")
        assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout), command
        assert warm.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], command
    check = "python -c 'import sys; print(\"timm\" in sys.modules)'"
    assert _shell(check, tmp_path, shim=True).stdout == "True\n"  # forked from the server
    assert _shell(check, tmp_path, shim=False).stdout == "False\n"


@pytest.mark.timeout(120)
def test_the_shell_python_takes_torchruns_u_and_buffers_as_python(tmp_path: Path) -> None:
    # torchrun starts each worker as `$PYTHON_EXEC -u SCRIPT ...`: warm, and unbuffered.
    from warm import start_server  # type: ignore[import-not-found]

    start_server()
    code = "import sys; print('timm' in sys.modules); sys.stderr.write('err\\n'); print('out')"
    for flag, lines in (("-u", ["{}", "err", "out"]), ("", ["err", "{}", "out"])):
        command = f'python {flag} -c "{code}" 2>&1'
        warm = _shell(command, tmp_path, shim=True)
        fresh = _shell(command, tmp_path, shim=False)
        assert warm.stdout.splitlines() == [x.format(True) for x in lines], command
        assert fresh.stdout.splitlines() == [x.format(False) for x in lines], command


_LOADER_SCRIPT = """\
import multiprocessing, os
from torch.utils.data import DataLoader
from train_jobs import WorkerParents
if __name__ == "__main__":
    context = multiprocessing.get_context("forkserver")
    loader = DataLoader(WorkerParents(), num_workers=2, multiprocessing_context=context)
    parents = {int(batch) for batch in loader}
    started = multiprocessing.forkserver._forkserver._forkserver_pid
    print(parents == {int(os.environ["DDPKIT_TEST_WARM_SERVER"])}, started)
"""


@pytest.mark.timeout(120)
def test_a_script_of_the_shell_python_starts_its_forkserver_workers_from_the_server(
    tmp_path: Path,
) -> None:
    # As a rank of run_distributed does (warm.share_server): no forkserver of its own.
    from warm import start_server  # type: ignore[import-not-found]

    start_server()
    (tmp_path / "loader.py").write_text(_LOADER_SCRIPT, encoding="utf-8")
    warm = _shell("python loader.py", tmp_path, shim=True)
    assert warm.stdout == "True None\n", warm.stderr[-2000:]
    fresh = _shell("python loader.py", tmp_path, shim=False)
    assert fresh.stdout.startswith("False "), fresh.stderr[-2000:]


_RANK_SCRIPT = """\
import os, sys
# One write of one line: unbuffered, print() writes each part apart and two ranks' parts mix.
line = f'{os.environ["RANK"]} {os.environ["WORLD_SIZE"]} {"timm" in sys.modules} {sys.argv[1:]}'
os.write(1, (line + chr(10)).encode())
"""


@pytest.mark.timeout(180)
def test_torchrun_workers_start_warm_with_torchruns_environment(tmp_path: Path) -> None:
    from warm import torchrun_command, torchrun_warm_env  # type: ignore[import-not-found]

    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT, encoding="utf-8")
    command = torchrun_command(2, str(script), "--flag", "x")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = warm_run(command, env=torchrun_warm_env(env), cwd=tmp_path, capture_output=True,
                    text=True, timeout=150)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line[:1] in "01")
    assert lines == ["0 2 True ['--flag', 'x']", "1 2 True ['--flag', 'x']"], done.stdout


def _ended(pid: int, within: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_shell_python_passes_signals_on_and_takes_the_script_with_it(sig: int) -> None:
    from warm import start_server  # type: ignore[import-not-found]

    start_server()
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    env = dict(os.environ, PYTHONPATH=str(_HELPERS), DDPKIT_TEST_PYTHON=sys.executable)
    shim = subprocess.Popen([str(_HELPERS / "bin" / "python"), "-c", code], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    script = int(shim.stdout.readline())  # type: ignore[union-attr]
    assert script != shim.pid  # the script runs in a process of the server's
    shim.send_signal(sig)
    assert shim.wait(timeout=30) == -sig  # passed on (SIGTERM), or the shim's own death
    assert _ended(script, 10), f"the script outlived its shell's python ({sig!r})"


def test_the_shell_python_without_a_live_server_is_the_real_one(tmp_path: Path) -> None:
    # A socket file left by a server that ended, or none at all: python as usual.
    import socket

    stale = tmp_path / "listener"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(stale))
    code = "import sys; print('timm' in sys.modules, sys.argv[1:])"
    for address in (str(stale), ""):
        env = dict(os.environ, PYTHONPATH=str(_HELPERS), DDPKIT_TEST_PYTHON=sys.executable)
        env["DDPKIT_TEST_WARM_ADDRESS"] = address
        done = subprocess.run([str(_HELPERS / "bin" / "python"), "-c", code, "a"], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (done.returncode, done.stdout) == (0, "False ['a']\n"), done.stderr
