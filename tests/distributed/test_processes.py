"""ddpkit.distributed.processes: run_processes results, the first real failure, stops, timeouts."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from loader_fixtures import left_running  # type: ignore[import-not-found]

from ddpkit.distributed.processes import RankFailedError, Stop, run_processes


def _run(*args: Any, **kwargs: Any) -> list[Any]:
    """``run_processes``' values, or its failure raised."""
    outcome = run_processes(*args, **kwargs)
    if outcome.failure is not None:
        raise outcome.failure
    assert outcome.values is not None
    return outcome.values


def _all_ready(index: int, directory: str, count: int) -> None:
    """Wait until all ``count`` processes started, so their failures come moments apart."""
    Path(directory, f"ready-{index}").touch()
    deadline = time.monotonic() + 90
    while len(list(Path(directory).glob("ready-*"))) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def _fail_in_order(index: int, directory: str) -> None:
    _all_ready(index, directory, 3)
    if index == 0:  # first, but only the echo of a peer that went away
        raise RuntimeError("[gloo/transport] Connection closed by peer")
    if index == 2:
        time.sleep(0.1)
        raise ValueError("the real cause")
    time.sleep(0.4)
    raise KeyError("a later error")


class _MyError(RankFailedError):
    pass


def test_the_earliest_real_failure_is_the_cause_and_the_others_are_listed(tmp_path: Path) -> None:
    with pytest.raises(_MyError) as info:
        _run(_fail_in_order, 3, (str(tmp_path),), timeout=120, error=_MyError,
             first_rank=4, world_size=8)  # fmt: skip
    error, message = info.value, str(info.value)
    assert error.rank == 6  # process 2, named by its rank in the job
    assert message.startswith("rank 6 of 8 failed: ValueError: the real cause")
    assert "(then also failed: rank 5: KeyError: 'a later error'; rank 4: RuntimeError" in message
    assert "--- traceback from rank 6 ---" in message
    assert "_fail_in_order" in error.remote_traceback
    assert "ValueError: the real cause" in error.remote_traceback


def _hang(index: int) -> None:
    while True:
        time.sleep(0.1)


def test_a_timeout_names_the_unfinished_ranks_and_kills_them() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        _run(_hang, 1, timeout=3, first_rank=3, world_size=4, timeout_hint="Look here.")
    assert time.monotonic() - start < 3 + 10
    message = str(info.value)
    assert message.startswith("1 of 1 ranks had not finished after 3 s: rank(s) 3.")
    assert message.endswith("they were killed. Look here.")


class _Halt(Exception):
    pass


def _stop_in_ways(index: int, directory: str) -> None:
    _all_ready(index, directory, 3)
    if index == 0:
        time.sleep(0.2)
        raise RuntimeError("Connection closed by peer")  # a consequence of the stops
    if index == 1:
        raise _Halt("asked to stop")
    os._exit(75)  # a stop code, without a report


def test_stops_are_no_failure_nor_is_a_peer_lost_beside_them(tmp_path: Path) -> None:
    outcome = run_processes(_stop_in_ways, 3, (str(tmp_path),), timeout=120,
                            stop_types=(_Halt,), stop_exit_codes=frozenset({75}))  # fmt: skip
    assert outcome.values is None
    assert outcome.failure is None
    stops = sorted(outcome.stops, key=lambda s: s.rank)
    assert [s.rank for s in stops] == [1, 2]
    assert isinstance(stops[0].exception, _Halt)
    assert stops[1] == Stop(2, None, 75)


def test_rank_failed_error_keeps_its_rank_and_traceback() -> None:
    error = RankFailedError("rank 3 of 4 failed: boom", 3, "Traceback ...")
    assert (error.rank, error.remote_traceback, str(error)) == (3, "Traceback ...", error.args[0])
    assert isinstance(error, RuntimeError)
    assert RankFailedError("x", 0).remote_traceback == ""


def _leave_workers(index: int, directory: str) -> None:
    """Leave a forkserver DataLoader whose worker raised behind, held by a traceback; end."""
    from multiprocessing import forkserver

    from loader_fixtures import FailsAt  # type: ignore[import-not-found]
    from torch.utils.data import DataLoader

    forkserver.set_forkserver_preload(["torch", "loader_fixtures"])  # workers start at once
    loader = DataLoader(FailsAt(64, 3), num_workers=2, multiprocessing_context="forkserver")
    batches = iter(loader)
    pids = [w.pid for w in batches._workers] + [forkserver._forkserver._forkserver_pid]
    Path(directory, "pids").write_text(" ".join(map(str, pids)))
    try:
        for _ in batches:
            pass
    except ValueError as exc:  # the worker's error, re-raised here
        raise RuntimeError("failed with its loader open") from exc


_FAST: dict[str, Any] = {"timeout": 90, "start_method": "forkserver"}


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_loader_its_failure_holds_does_not_outlive_its_process(tmp_path: Path) -> None:
    # The traceback holds the iterator in a reference cycle, and a process ends by
    # os._exit: without a collection the iterator is never freed, and a forkserver
    # and its workers wait for each other for ever.
    with pytest.raises(RankFailedError, match="failed with its loader open"):
        _run(_leave_workers, 1, args=(str(tmp_path),), **_FAST)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    left = left_running(pids, 20)
    assert left == [], f"still running after their process ended: {left}"
