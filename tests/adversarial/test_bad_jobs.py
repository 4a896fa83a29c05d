"""Jobs that go wrong at start-up: no wait past the deadline, no orphan, a message naming why."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from warm import WarmProcess, warm_popen  # type: ignore[import-not-found]

import ddpkit
from ddpkit import RendezvousError, init_distributed
from ddpkit.cli import main
from ddpkit.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port where something accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in accepted:
        conn.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_silent_listener_cannot_hold_a_rank_past_the_deadline(
    silent_listener: int, rank: int
) -> None:
    # rank 0 too: under torchrun the launcher hosts the store and rank 0 connects.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(silent_listener)}
    env.update({"RANK": str(rank), "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    start = time.monotonic()
    message = run_distributed(_join_env, 1, args=(env, 3.0), init=None, timeout=60)[0]
    elapsed = time.monotonic() - start
    assert f"something at 127.0.0.1:{silent_listener} accepted the connection" in message
    assert "did not answer as a ddpkit/c10d store within 3 s" in message
    assert elapsed < 3.0 + 15  # the deadline, the grace, and a child process's start


def _join_env(rank: int, world_size: int, env: dict[str, str], seconds: float) -> str:
    os.environ.update(env)
    try:
        init_distributed(rendezvous_timeout=timedelta(seconds=seconds))
    except RendezvousError as exc:
        return str(exc)
    return "joined"


_RANK = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import ddpkit
    url, rank, world, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    print("starting", flush=True)
    try:
        ddpkit.init_distributed(url, world_size=world, rank=rank,
                                rendezvous_timeout=timedelta(seconds=seconds))
    except ddpkit.RendezvousError as exc:
        print("ERROR", exc, flush=True)
        sys.exit(3)
    print("joined", flush=True)
    """
)


def _start_rank(url: str, rank: int, world: int, seconds: float) -> WarmProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return warm_popen(
        [sys.executable, "-c", _RANK, url, str(rank), str(world), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _wait_listening(port: int, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    pytest.fail(f"nothing listened on {port} within {within} s")


@pytest.mark.parametrize("when", ["before-joining", "while-waiting"])
def test_a_stopped_rank_zero_cannot_hold_the_others_past_the_deadline(when: str) -> None:
    port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    zero = _start_rank(url, 0, 3, 300.0)  # waits for 3 ranks: only 2 come
    other = None
    try:
        _wait_listening(port)
        if when == "while-waiting":
            other = _start_rank(url, 1, 3, 6.0)
            assert other.stdout is not None
            assert other.stdout.readline().strip() == "starting"
            time.sleep(3.0)  # rank 1 is in the rendezvous, polling rank 0's store
        os.kill(zero.pid, signal.SIGSTOP)  # Ctrl-Z
        start = time.monotonic()
        if other is None:
            other = _start_rank(url, 1, 3, 6.0)
        out, _ = other.communicate(timeout=90)
        elapsed = time.monotonic() - start
    finally:
        os.kill(zero.pid, signal.SIGKILL)
        zero.wait()
        if other is not None and other.poll() is None:
            other.kill()
    assert other.returncode == 3, out
    assert "ERROR" in out
    assert "SIGSTOP" in out  # the message says what it saw
    assert elapsed < 6.0 + 25  # the deadline, grace for the verdict, and a start-up


_PARENT = textwrap.dedent(
    """
    import os, sys, time
    import ddpkit
    sys.path.insert(0, sys.argv[2])
    from dist_jobs import sleep_and_record
    ddpkit.spawn(sleep_and_record, 2, args=(sys.argv[1],))
    """
)


def test_killing_the_spawn_parent_ends_its_ranks(tmp_path: Path) -> None:
    tests = str(ROOT / "tests" / "helpers")
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path), tests], cwd=ROOT)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert time.monotonic() < deadline, "the ranks never started"
            assert parent.poll() is None, "spawn ended early"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = [pid for pid in pids if _alive(pid)]
    finally:
        parent.kill()
        for path in tmp_path.glob("rank*.pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(path.read_text()), signal.SIGKILL)
    assert orphans == [], "ranks outlived their SIGKILLed parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "url", ["file://./rdzv", "file://rel/path", "file:rdzv", "file://server/share/rdzv"]
)
def test_a_relative_file_url_is_refused_with_its_absolute_form(url: str) -> None:
    with pytest.raises(ValueError, match="relative path") as info:
        init_distributed(url, world_size=2, rank=0)
    assert "file:///" in str(info.value)
    assert not Path("/rdzv").exists()


def test_an_absolute_file_url_works(tmp_path: Path) -> None:
    with init_distributed(f"file://{tmp_path}/rdzv", world_size=1, rank=0, network=None) as info:
        assert info.init_method == f"file://{tmp_path}/rdzv"


_BAD_DURATIONS = [0, -1, -0.5, math.nan, math.inf, "60", True, None, [1]]


@pytest.mark.parametrize("name", ["timeout", "rendezvous_timeout"])
@pytest.mark.parametrize("value", _BAD_DURATIONS, ids=repr)
def test_bad_timeouts_are_named_before_any_work(name: str, value: object) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=name):
        init_distributed("tcp://127.0.0.1:1", world_size=2, rank=1, **{name: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=name):
        ddpkit.spawn(print, 1, **{name: value})  # type: ignore[arg-type]
    assert time.monotonic() - start < 5  # refused, not tried


def test_a_number_of_seconds_is_a_timeout() -> None:
    info = init_distributed(timeout=60, rendezvous_timeout=5.5)
    assert not info.is_distributed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "bogus"}, "backend='bogus' is not a backend"),
        ({"backend": 3}, "backend must be"),
        ({"network": 5}, "network must be"),
        ({"device": "gpu0"}, "device='gpu0' is not a device"),
        ({"world_size": "2", "rank": 0}, "world_size must be an int"),
        ({"world_size": 2, "rank": 1.0}, "rank must be an int"),
        ({"world_size": True, "rank": 0}, "world_size must be an int"),
        ({"world_size": 2, "rank": 0, "local_rank": -1}, "local_rank must be >= 0"),
        ({"init_method": 5, "world_size": 2, "rank": 0}, "init_method must be a string"),
        ({"init_method": "tcp://h:0", "world_size": 2, "rank": 0}, "a port 1..65535"),
        ({"init_method": "tcp://h:70000", "world_size": 2, "rank": 0}, "a port 1..65535"),
        ({"init_method": "tcp://h:port", "world_size": 2, "rank": 0}, "a port 1..65535"),
    ],
)
def test_bad_arguments_are_value_errors_naming_them(kwargs: dict[str, object], match: str) -> None:
    kwargs.setdefault("init_method", "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match=match):
        init_distributed(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nprocs": 0}, "nprocs must be at least 1"),
        ({"nprocs": -1}, "nprocs must be at least 1"),
        ({"nprocs": True}, "nprocs must be an int"),
        ({"nprocs": "2"}, "nprocs must be an int"),
        ({"nprocs": 1, "nnodes": 0}, "nnodes must be at least 1"),
        ({"nprocs": 1, "node_rank": -1}, "node_rank must be at least 0"),
        ({"nprocs": 1, "backend": "bogus"}, "is not a backend"),
    ],
)
def test_bad_spawn_arguments_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ddpkit.spawn(print, **kwargs)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-(10**6), 10**6),
        st.text(max_size=5),
        st.booleans(),
        st.none(),
    )
)
def test_any_timeout_value_is_taken_or_named(value: object) -> None:
    from ddpkit.distributed.job import as_timeout

    try:
        seconds = as_timeout("timeout", value).total_seconds()
    except ValueError as exc:
        message = str(exc)
    else:
        message = ""
    if message:
        assert "timeout" in message
        return
    assert seconds > 0
    assert math.isfinite(seconds)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_any_init_url_is_resolved_or_refused_clearly(text: str) -> None:
    from ddpkit.distributed.job import resolve_job

    try:
        plan = resolve_job(text, world_size=2, rank=0)
    except ValueError:
        return
    assert plan is not None
    assert plan.scheme in ("tcp", "file")
    if plan.scheme == "tcp":
        assert plan.master_port is not None
        assert 0 < plan.master_port < 65536
    else:
        assert plan.file_path is not None
        assert os.path.isabs(plan.file_path)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "abc", "-inf"])
def test_doctor_refuses_a_bad_timeout_flag(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["doctor", "--timeout", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --timeout" in err  # argparse takes "-inf" for a flag, and says so
    assert "doctor bug" not in err


def _join_with_world(rank: int, world_size: int, url: str, worlds: list[int]) -> tuple[str, float]:
    start = time.monotonic()
    try:
        init_distributed(
            url, world_size=worlds[rank], rank=rank, rendezvous_timeout=timedelta(seconds=60)
        )
    except RendezvousError as exc:
        return str(exc), time.monotonic() - start
    ddpkit.shutdown()
    return "joined", time.monotonic() - start


def test_rank_zero_with_a_larger_world_size_is_named_at_once() -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    out = run_distributed(_join_with_world, 2, args=(url, [3, 2]), init=None, timeout=120)
    for message, elapsed in out:
        assert "disagree on the job" in message
        assert "rank 0 has world_size=3" in message
        assert "was started with world_size=2" in message
        assert elapsed < 30  # not the 60 s rendezvous timeout


def test_a_very_long_timeout_does_not_break_a_healthy_call() -> None:
    from ddpkit.distributed.deadline import BoundedCalls

    calls = BoundedCalls(time.monotonic() + 1e12)
    assert calls(lambda: "ok") == "ok"
    calls.close()


def test_spawn_names_a_bad_master_port_once_in_the_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500x")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="MASTER_PORT='29500x' is not a port number"):
        ddpkit.spawn(print, 2, init_method="env://")


def test_a_local_rank_that_contradicts_the_launcher_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"local_rank=0\) disagrees with torchrun"):
        init_distributed("tcp://127.0.0.1:1", local_rank=0)


def test_a_host_name_that_resolves_to_loopback_is_warned_about() -> None:
    from ddpkit.distributed.network import _loopback_route

    interfaces = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2"]}
    assert _loopback_route("gpu-node-1", "lo", interfaces)  # /etc/hosts: 127.0.1.1 gpu-node-1
    assert not _loopback_route("localhost", "lo", interfaces)
    assert not _loopback_route("127.0.0.1", "lo", interfaces)
    assert not _loopback_route("gpu-node-1", "eth0", interfaces)


# --- file:// paths that c10d's FileStore cannot use, refused with the path and the fix ----


def _unwritable(tmp_path: Path) -> str:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    return f"file://{locked}/rdzv"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: f"file://{d}/", "is a directory; name a file in it"),
        (lambda d: f"file://{d}", "is a directory; name a file in it"),
        (lambda d: f"file://{d}/missing/rdzv", "does not exist on rank 0"),
        pytest.param(
            _unwritable,
            "is not writable by this user",
            marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere"),
        ),
    ],
    ids=["dir-slash", "dir", "missing-parent", "unwritable"],
)
def test_a_file_url_the_store_cannot_use_is_named_with_the_fix(
    tmp_path: Path, make: object, match: str
) -> None:
    url = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(RendezvousError, match=match) as info:
        init_distributed(url, world_size=1, rank=0, network=None)
    assert url in str(info.value)
    assert "troubleshooting.md#the-store-cannot-be-opened" in str(info.value)


def test_an_empty_file_url_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a path"):
        init_distributed("file://", world_size=1, rank=0)


# --- every real number is a number: NumPy's scalars, Fraction; never a bool -----------------

_REALS = [np.int64(5), np.float32(5.0), np.float64(5.0), Fraction(11, 2), 5]


@pytest.mark.parametrize("value", _REALS, ids=repr)
def test_any_real_number_is_a_timeout(value: object) -> None:
    from ddpkit.distributed.job import as_timeout

    for name in ("timeout", "rendezvous_timeout"):
        info = init_distributed(**{name: value})  # type: ignore[arg-type]
        assert not info.is_distributed
    assert as_timeout("timeout", value).total_seconds() == float(value)  # type: ignore[arg-type]
    assert ddpkit.FaultConfig(hang_timeout=value).hang_timeout == float(value)  # type: ignore[arg-type]
    assert type(ddpkit.FaultConfig(hang_timeout=value).hang_timeout) is float  # type: ignore[arg-type]
    manager = ddpkit.CheckpointManager("unused", every_minutes=value)  # type: ignore[arg-type]
    assert manager.cadence.every_minutes == float(value)  # type: ignore[arg-type]
    from ddpkit.distributed.watchdog import HangWatchdog

    assert HangWatchdog(value).timeout == float(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value", [True, np.float64("nan"), np.float32("inf"), np.int64(-5), np.int64(0)], ids=repr
)
def test_a_bool_or_a_meaningless_real_is_still_refused(value: object) -> None:
    with pytest.raises(ValueError, match="rendezvous_timeout"):
        init_distributed("tcp://127.0.0.1:1", world_size=2, rank=1, rendezvous_timeout=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hang_timeout"):
        ddpkit.FaultConfig(hang_timeout=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every_minutes"):
        ddpkit.CheckpointManager("unused", every_minutes=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(print, 1, timeout=value)  # type: ignore[arg-type]


def test_numpy_integers_are_counts_and_fractional_numbers_are_not() -> None:
    from ddpkit.distributed.job import resolve_job

    plan = resolve_job("tcp://127.0.0.1:1", world_size=np.int64(2), rank=np.int32(1))  # type: ignore[arg-type]
    assert plan is not None
    assert (type(plan.world_size), plan.world_size, plan.rank) == (int, 2, 1)
    with pytest.raises(ValueError, match="rank must be an int"):
        resolve_job("tcp://127.0.0.1:1", world_size=2, rank=np.float64(1.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nprocs must be at least 1"):
        ddpkit.spawn(print, np.int64(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size must be an int"):
        run_distributed(print, Fraction(3, 2))  # type: ignore[arg-type]


# --- doctor's numeric flags, refused as argparse refuses them ---------------------------


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--world-size", "-3"),
        ("--world-size", "0"),
        ("--world-size", "two"),
        ("--master-port", "0"),
        ("--master-port", "70000"),
        ("--master-port", "-5"),
    ],
)
def test_doctor_refuses_a_bad_count_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["doctor", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err
    assert "not compared" not in err


_ABANDONED_CALL = textwrap.dedent(
    """
    import ctypes, sys, time
    from pathlib import Path
    from ddpkit.distributed.deadline import BoundedCalls, DeadlinePassed

    marker = Path(sys.argv[1])

    def slow_native_call():
        ctypes.CDLL(None).usleep(1_500_000)  # in C, without the GIL, as c10d waits
        marker.write_text("returned")

    calls = BoundedCalls(time.monotonic() + 0.2, "test-bounded")
    try:
        calls(slow_native_call)
    except DeadlinePassed:
        sys.exit(3)
    """
)


def test_a_call_abandoned_at_its_deadline_returns_before_the_interpreter_ends(
    tmp_path: Path,
) -> None:
    # A helper thread coming back from native code while the interpreter is torn
    # down aborts the process; the abandoned call is let finish first, and the
    # exit status stays the program's.
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", _ABANDONED_CALL, str(marker)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert marker.read_text() == "returned"


_GARBAGE_SERVER = textwrap.dedent(
    """
    import socket, sys, threading, time
    import ddpkit

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def answer_garbage():
        while True:
            peer, _ = server.accept()
            peer.sendall(bytes(range(256)) * 4)
            time.sleep(0.05)
            peer.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    url = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    try:
        ddpkit.init_distributed(url, world_size=2, rank=1, rendezvous_timeout=2)
    except ddpkit.RendezvousError:
        sys.exit(3)
    """
)


def test_a_caught_rendezvous_error_leaves_the_exit_status_to_the_program() -> None:
    # A port that answers malformed bytes: c10d's client retries in a thread that
    # outlives the error; the process must still exit as the program chose (3).
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _GARBAGE_SERVER], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 3, done.stderr[-2000:]
        assert "terminate called" not in done.stderr
