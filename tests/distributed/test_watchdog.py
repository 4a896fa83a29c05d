"""HangWatchdog: real ranks that stall, deadlock or lose rank 0 are named, log stacks, exit 124."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from train_jobs import slow_workers_run
from warm import WarmProcess, warm_popen  # type: ignore[import-not-found]

import ddpkit.distributed.watchdog as watchdog_module
from ddpkit.distributed.processes import RankFailedError
from ddpkit.distributed.rendezvous import free_port
from ddpkit.distributed.stops import HANG_EXIT_CODE
from ddpkit.distributed.watchdog import HangWatchdog, format_stacks
from ddpkit.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "watchdog_jobs.py"
STALL_STEP = 5  # as in watchdog_jobs.py
# What the watchdog promises: every process gone this long after its last progress.
PROMISED_S = 30.0
# Each job's hard limit: start-up (importing torch on a busy machine) plus the promise.
LIMIT_S = 90.0


@dataclass
class _Ended:
    """How one rank's process ended."""

    code: int
    end: float  # time.time() when it ended (nan: killed by the test on purpose)
    stalled: float  # time.time() when its loop stalled (nan: it did not)
    log: str


def _wait_or_kill(proc: WarmProcess) -> float:
    """When ``proc`` ended (``time.time()``); killed, and ``inf``, past ``LIMIT_S``."""
    try:
        proc.wait(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return math.inf
    return time.time()


def _run_job(
    tmp_path: Path, scenario: str, world: int, timeout: float, stuck: tuple[int, ...] = ()
) -> list[_Ended]:
    """Run the ranks of ``scenario`` to their end, then kill the ``stuck`` ones (still alive).

    Returns each rank's exit code, end time (``time.time()``) and log.
    """
    port, procs, logs = free_port(), [], []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        for rank in range(world):
            logs.append(tmp_path / f"{scenario}-rank{rank}.log")
            with logs[-1].open("wb") as log:
                args = [scenario, str(rank), str(world), str(port), str(timeout)]
                command = [sys.executable, str(JOB), *args]
                procs.append(warm_popen(command, stderr=log, cwd=ROOT, env=env))
        awaited = [proc for rank, proc in enumerate(procs) if rank not in stuck]
        with ThreadPoolExecutor(world) as pool:  # each exit time as it happens
            ended = dict(zip(awaited, pool.map(_wait_or_kill, awaited), strict=True))
        assert all(procs[rank].poll() is None for rank in stuck)
        ends = [ended.get(proc, math.nan) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for proc, end, log in zip(procs, ends, logs, strict=True):
        text = log.read_text(errors="replace")
        match = re.search(r"STALLED at ([\d.]+)", text)
        stalled = float(match.group(1)) if match else math.nan
        results.append(_Ended(proc.returncode, end, stalled, text))
    return results


def _main_thread_stack(log: str, rank: int) -> str:
    """The main thread's stack as the ERROR record (not faulthandler) of ``rank`` wrote it."""
    dump = log.split(f"stacks of rank {rank}, all threads:\n", 1)[1]
    return dump.split("Thread 'MainThread'", 1)[1].split("\nThread ", 1)[0]


def _assert_exits_in_time(rank: _Ended, timeout: float, stalled: float | None = None) -> None:
    """Not before ``timeout`` passed since the stall, and within the promise."""
    waited = rank.end - (rank.stalled if stalled is None else stalled)
    assert timeout - 0.1 < waited <= timeout + PROMISED_S, rank.log


@pytest.mark.timeout(2 * LIMIT_S)
def test_rank_stalled_in_data_is_named_and_every_rank_exits_124(tmp_path: Path) -> None:
    timeout = 3.0
    ranks = _run_job(tmp_path, "stall", 3, timeout)
    assert [r.code for r in ranks] == [HANG_EXIT_CODE] * 3, ranks[0].log
    for r in ranks:
        _assert_exits_in_time(r, timeout, stalled=ranks[1].stalled)  # when the job stalled
    verdict = (
        f"rank(s) 1 stopped at step {STALL_STEP} (waiting for training data); the others wait "
        f"for them: rank(s) 0, 2 at step {STALL_STEP} (in compute)"
    )
    assert verdict in ranks[0].log
    assert "ERROR ddpkit: hang watchdog: no progress for" in ranks[0].log
    for rank, phase in ((1, "waiting for training data"), (2, "in compute")):
        obeyed = f"rank {rank} stops at step {STALL_STEP} ({phase}), on rank 0's verdict: "
        assert obeyed in ranks[rank].log
        assert verdict in ranks[rank].log
    stalled = _main_thread_stack(ranks[1].log, 1)
    assert re.search(r"line \d+, in read_batch_from_nfs\n", stalled), stalled
    for rank in (0, 2):  # blocked in the gradient all-reduce, waiting for rank 1
        waiting = _main_thread_stack(ranks[rank].log, rank)
        assert re.search(r"line \d+, in backward\n", waiting), waiting
        assert "read_batch_from_nfs" not in waiting


@pytest.mark.timeout(2 * LIMIT_S)
def test_steps_in_time_and_a_slow_first_step_raise_no_alarm(tmp_path: Path) -> None:
    timeout = 2.0
    started = time.time()
    ranks = _run_job(tmp_path, "healthy", 2, timeout)
    assert [r.code for r in ranks] == [0, 0], ranks[0].log + "\n" + ranks[1].log
    for r in ranks:
        assert "hang watchdog" not in r.log
        assert "Traceback" not in r.log  # the watchdog thread did not die either
    # A first step of 1.5 timeouts, 3 timeouts of short steps, and rank 0 saving for 1.5
    # timeouts after rank 1 stopped its watchdog: no silence may be taken for a hang.
    assert min(r.end for r in ranks) - started > 6 * timeout


@pytest.mark.timeout(2 * LIMIT_S)
def test_all_ranks_stuck_in_one_operation_are_reported_together(tmp_path: Path) -> None:
    timeout = 3.0
    ranks = _run_job(tmp_path, "deadlock", 3, timeout)
    assert [r.code for r in ranks] == [HANG_EXIT_CODE] * 3, ranks[0].log
    together = f"all ranks stopped at step {STALL_STEP} (in compute), none behind another"
    assert together in ranks[0].log
    assert "rank(s) 0" not in ranks[0].log
    for rank, r in enumerate(ranks):
        stack = _main_thread_stack(r.log, rank)
        assert re.search(r"line \d+, in exchange_with_neighbours\n", stack), stack


@pytest.mark.timeout(2 * LIMIT_S)
@pytest.mark.parametrize(
    ("scenario", "why"),
    [("rank0_dies", "(DistNetworkError: "), ("rank0_stops", "(no answer in 2 s)")],
    ids=["SIGKILL", "SIGSTOP"],
)
def test_ranks_that_lose_rank_0_and_the_store_exit_124_by_themselves(
    tmp_path: Path, scenario: str, why: str
) -> None:
    timeout = 3.0
    stuck = (0,) if scenario == "rank0_stops" else ()
    ranks = _run_job(tmp_path, scenario, 3, timeout, stuck=stuck)
    assert ranks[0].code == -9, ranks[0].log  # killed: by itself, or by the test
    for rank in (1, 2):
        r = ranks[rank]
        assert r.code == HANG_EXIT_CODE, r.log
        _assert_exits_in_time(r, timeout)
        assert f"rank {rank}, which lost the c10d store {why}" in r.log
        stack = _main_thread_stack(r.log, rank)
        assert re.search(r"line \d+, in read_batch_from_nfs\n", stack), stack


@pytest.mark.timeout(LIMIT_S)
def test_single_process_without_a_group_exits_124_with_its_stack(tmp_path: Path) -> None:
    timeout = 1.0
    (alone,) = _run_job(tmp_path, "alone", 1, timeout)
    assert alone.code == HANG_EXIT_CODE, alone.log
    _assert_exits_in_time(alone, timeout)
    assert f"(timeout {timeout:g} s) at step 1 (waiting for training data)" in alone.log
    stack = _main_thread_stack(alone.log, 0)
    assert re.search(r"line \d+, in stuck_alone\n", stack), stack


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf, True, "600"])
def test_timeout_must_be_positive_finite_seconds(timeout: object) -> None:
    with pytest.raises(ValueError, match="timeout must be positive finite seconds"):
        HangWatchdog(timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("timeout", "interval"),
    [(3.0, 0), (3.0, -1.0), (3.0, math.nan), (3.0, 2.0), (600.0, 6.0), (3.0, "1")],
)
def test_interval_must_fit_the_timeout(timeout: float, interval: object) -> None:
    with pytest.raises(ValueError, match="interval must be positive seconds"):
        HangWatchdog(timeout, interval=interval)  # type: ignore[arg-type]


def test_default_interval_is_a_quarter_of_the_timeout_up_to_5_s() -> None:
    assert HangWatchdog(3.0).interval == 0.75
    assert HangWatchdog(600.0).interval == 5.0


def test_a_store_without_a_group_needs_rank_and_world_size() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="rank= and world_size="):
        HangWatchdog(3.0, store=dist.HashStore(), rank=0)


def _exiting(watchdog: HangWatchdog, exit: Any) -> HangWatchdog:
    """``watchdog`` ending the process with ``exit`` instead of ``os._exit``."""
    watchdog._exit = exit
    return watchdog


def test_stop_is_prompt_idempotent_and_final() -> None:
    exits: list[int] = []
    before = set(threading.enumerate())
    watchdog = _exiting(HangWatchdog(60.0), exits.append).start()  # heartbeats 5 s apart
    watchdog.progress(1, "done")
    (thread,) = [t for t in threading.enumerate() if t not in before]
    assert thread.name == "ddpkit-watchdog"
    began = time.monotonic()
    watchdog.stop()
    assert time.monotonic() - began < 1.0
    assert not thread.is_alive()
    watchdog.stop()
    with pytest.raises(RuntimeError, match="started before"):
        watchdog.start()
    assert exits == []


def test_progress_costs_well_under_a_microsecond_or_so() -> None:
    watchdog = HangWatchdog(60.0)
    calls = 100_000
    best = math.inf
    for _ in range(5):
        began = time.perf_counter()
        for step in range(calls):
            watchdog.progress(step, "data")
        best = min(best, (time.perf_counter() - began) / calls)
    assert best < 2e-6


def test_unarmed_local_watchdog_waits_for_the_first_finished_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fired = threading.Event()
    exits: list[int] = []

    def record(code: int) -> None:
        exits.append(code)
        fired.set()

    timeout = 0.3
    watchdog = _exiting(HangWatchdog(timeout), record)
    with caplog.at_level(logging.ERROR, logger="ddpkit"), watchdog:
        watchdog.progress(0, "compute")  # the first step: not armed, however long it takes
        assert not fired.wait(3 * timeout)
        watchdog.progress(1, "done")
        armed = time.monotonic()
        assert fired.wait(10.0)
        assert time.monotonic() - armed > timeout
    assert exits == [HANG_EXIT_CODE]
    assert "no progress for" in caplog.text
    assert "at step 1 (between steps)" in caplog.text
    assert re.search(r"line \d+, in test_unarmed_local_watchdog_waits_for_the_first", caplog.text)


def test_rank_that_never_reported_is_named_and_the_others_exit() -> None:
    store = dist.HashStore()  # three ranks in one process; rank 2 never starts its watchdog
    fired = {0: threading.Event(), 1: threading.Event()}
    watchdogs = [
        _exiting(
            HangWatchdog(1.0, store=store, rank=r, world_size=3), lambda _c, r=r: fired[r].set()
        )
        for r in (0, 1)
    ]
    for watchdog in watchdogs:
        watchdog.start()
        watchdog.progress(4, "done")
    try:
        assert fired[0].wait(15.0)
        assert fired[1].wait(15.0)
    finally:
        for watchdog in watchdogs:
            watchdog.stop()
    verdict = store.get("ddpkit/watchdog/hang").decode()
    assert "rank(s) 2 never sent a heartbeat" in verdict
    assert "the others wait for them: rank(s) 0, 1 at step 4 (between steps)" in verdict
    assert store.get("ddpkit/watchdog/ack/1") == b"1"


def test_rank_that_hears_nothing_from_rank_0_exits_by_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fired = threading.Event()
    timeout, interval = 0.5, 0.125  # alone after timeout + 2 * interval + 5 s = 5.75 s
    store = dist.HashStore()  # reachable, but rank 0 never watches
    watchdog = _exiting(
        HangWatchdog(timeout, interval=interval, store=store, rank=1, world_size=2),
        lambda _c: fired.set(),
    )
    with caplog.at_level(logging.ERROR, logger="ddpkit"), watchdog:
        watchdog.progress(3, "done")
        began = time.monotonic()
        assert fired.wait(30.0)
        assert time.monotonic() - began > timeout + 2 * interval + 5
    assert "on rank 1, and rank 0 reported no hang within 5.75 s" in caplog.text
    assert not store.check(["ddpkit/watchdog/hang"])  # nobody gave a verdict


def test_format_stacks_names_every_thread_main_first() -> None:
    parked = threading.Event()

    def _park_here() -> None:
        parked.wait()

    thread = threading.Thread(target=_park_here, name="parked-thread")
    thread.start()
    try:
        text = format_stacks()
    finally:
        parked.set()
        thread.join()
    assert text.startswith("Thread 'MainThread'")
    parked_part = text.split("Thread 'parked-thread'", 1)[1].split("\nThread ", 1)[0]
    assert re.search(r"line \d+, in _park_here\n", parked_part)
    assert "test_format_stacks_names_every_thread_main_first" in text.split("\nThread ", 1)[0]


def test_module_states_its_concern_first() -> None:
    first = (watchdog_module.__doc__ or "").splitlines()[0]
    assert first.startswith("The hang watchdog:")
    assert first.endswith(".")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("persistent", [False, True], ids=["workers-per-epoch", "persistent"])
def test_loaders_starting_workers_slower_than_the_timeout_are_never_timed(
    persistent: bool,
) -> None:
    # Each worker takes 2 timeouts to start (a sleep as it unpickles its dataset): at the
    # first step, at each validation (and, without persistent workers, each later epoch).
    plan = {"hang_timeout": 1.5, "delay": 3.0, "persistent": persistent, "epochs": 2}
    results = run_distributed(slow_workers_run, 2, args=(plan,), timeout=150)
    assert [r["epochs"] for r in results] == [[1, 2], [1, 2]]


@pytest.mark.timeout(200)
def test_a_rank_whose_validation_data_hangs_is_still_caught_and_named() -> None:
    plan = {"hang_timeout": 1.5, "delay": 0.0, "persistent": False, "epochs": 1, "hang_val": 1}
    with pytest.raises(RankFailedError, match=f"exited with code {HANG_EXIT_CODE}") as caught:
        run_distributed(slow_workers_run, 2, args=(plan,), timeout=150)
    # Each rank's last word (its exit note) holds rank 0's verdict, which names rank 1.
    verdict = "rank(s) 1 stopped at step 2 (waiting for validation data); the others wait "
    assert verdict + "for them: rank(s) 0 at step 2 (in validation)" in str(caught.value)


def _fit_with_a_callback_that_hangs_on_rank_1(rank: int, world_size: int, directory: str) -> None:
    """fit() with the watchdog and checkpoints; rank 1's callback never returns after epoch 1."""
    from ddpkit import CheckpointManager, DistInfo, FaultConfig, build_loader, fit, wrap_ddp
    from ddpkit.training.config import ReportConfig, TrainConfig

    torch.manual_seed(0)
    info = DistInfo(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo", True)
    model = wrap_ddp(torch.nn.Linear(8, 3), sync_bn=False)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    loader = build_loader(data, batch_size=4, train=True, workers=0, seed=1, info=info)

    def upload(record: dict[str, object]) -> None:
        if rank == 1:
            threading.Event().wait()  # a callback that hangs: a stuck upload, a lock

    fit(
        model,
        loader,
        torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=torch.nn.CrossEntropyLoss(),
        epochs=2,
        checkpoints=CheckpointManager(os.path.join(directory, f"rank{rank}"), prefix="t"),
        callbacks=[upload],
        config=TrainConfig(normalize=None),
        report=ReportConfig(progress=False),
        faults=FaultConfig(hang_timeout=2.0, report_dir=directory),
    )


@pytest.mark.timeout(LIMIT_S)
def test_a_rank_hanging_in_a_callback_at_the_epochs_end_is_named_as_the_report_names_it(
    tmp_path: Path,
) -> None:
    # 8 steps an epoch; rank 1 hangs in a callback at its end, rank 0 waits in the save's
    # collective. The verdict names rank 1, at step 8, and the collective it never entered:
    # the one the hang report's FIRST DISAGREEMENT names.
    with pytest.raises(RankFailedError, match=f"exited with code {HANG_EXIT_CODE}") as caught:
        run_distributed(
            _fit_with_a_callback_that_hangs_on_rank_1,
            2,
            args=(str(tmp_path),),
            timeout=LIMIT_S - 10,
            env={"TORCH_FR_BUFFER_SIZE": "2000"},  # the flight recorder, for the report
        )
    said = str(caught.value)
    verdict = (
        "rank(s) 1 stopped at step 8 (in the epoch's report or callbacks); the "
        "others wait for them: rank(s) 0 at step 8 (saving a checkpoint); rank(s) 1 never "
        "entered collective #"
    )
    assert verdict in said, said
    number = said.split(verdict, 1)[1].split(",", 1)[0]
    report = (tmp_path / "hang-report.txt").read_text()
    assert f"FIRST DISAGREEMENT: process group 0, collective #{number}:" in report, report
    assert f"rank 1: never entered #{number}" in report, report
