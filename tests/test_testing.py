"""ddpkit.testing.run_distributed: results, failures, timeouts and isolation."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ddpkit.testing import DistributedTestError, run_distributed


def _rank_info(rank: int, world_size: int, tag: str) -> tuple[int, int, int, int, str, str]:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return (
        rank,
        world_size,
        dist.get_rank(),
        int(t.item()),
        dist.get_backend(),
        tag + os.environ.get("DDPKIT_TEST_MARK", ""),
    )


@pytest.mark.parametrize("init", ["file", "tcp"])
def test_returns_values_in_rank_order(init: str) -> None:
    out = run_distributed(
        _rank_info, 3, args=("x",), init=init, env={"DDPKIT_TEST_MARK": "!"}, timeout=90
    )
    assert out == [(r, 3, r, 6, "gloo", "x!") for r in range(3)]


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from the test on rank one")
    # The healthy rank blocks in a collective the failed rank never joins:
    # only termination by the parent ends it.
    dist.barrier()
    return rank


def test_rank_error_carries_message_and_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 30, "the surviving rank was not terminated"
    err = info.value
    assert err.rank == 1
    assert "ValueError: boom from the test on rank one" in str(err)
    assert "_raise_on_rank_one" in err.remote_traceback


def _sleep_forever_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        while True:
            time.sleep(1)
    return rank


def test_timeout_kills_and_names_stuck_rank(capfd: pytest.CaptureFixture[str]) -> None:
    timeout = 8.0  # room for the healthy rank to start even on a loaded machine
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1\. Their Python stacks") as info:
        run_distributed(_sleep_forever_on_rank_one, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 5, f"took {elapsed:.1f} s"
    assert "1 of 2 ranks" in str(info.value)
    # Where the stuck rank was, from its own stack dump, before it was killed.
    assert re.search(r"line \d+ in _sleep_forever_on_rank_one", capfd.readouterr().err)


def _exit_hard(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    dist.barrier()
    return rank


def test_silent_death_is_reported() -> None:
    with pytest.raises(DistributedTestError, match="rank 0 of 2 failed: exited with code 3"):
        run_distributed(_exit_hard, 2, timeout=60)


def _unpicklable(rank: int, world_size: int) -> object:
    return lambda: rank


def test_unpicklable_return_value_is_an_error() -> None:
    with pytest.raises(DistributedTestError, match="could not be sent to the parent"):
        run_distributed(_unpicklable, 1, timeout=60)


def _tagged_sum(rank: int, world_size: int, tag: int) -> tuple[int, int]:
    t = torch.tensor([tag])
    dist.all_reduce(t)
    return tag, int(t.item())


def test_concurrent_runs_do_not_collide() -> None:
    results: dict[int, object] = {}

    def run(tag: int) -> None:
        init = "tcp" if tag % 2 else "file"
        try:
            results[tag] = run_distributed(_tagged_sum, 2, args=(tag,), init=init, timeout=120)
        except BaseException as exc:
            results[tag] = exc

    threads = [threading.Thread(target=run, args=(tag,)) for tag in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # Each group summed only its own tag: a crossed rendezvous would mix them.
    assert results == {tag: [(tag, 2 * tag)] * 2 for tag in range(4)}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size must be at least 1"),
        ({"world_size": 2, "init": "env"}, "init must be 'file', 'tcp' or None"),
        ({"world_size": 2, "timeout": 0}, "timeout must be positive"),
        ({"world_size": 2, "start_method": "fork"}, "start_method .* 'spawn' or 'forkserver'"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_distributed(_tagged_sum, **kwargs)  # type: ignore[arg-type]


def _no_group(rank: int, world_size: int) -> tuple[int, bool, str | None]:
    return rank, dist.is_initialized(), os.environ.get("RANK")


def test_init_none_starts_processes_without_a_group() -> None:
    # No group and no launcher variables: the code under test starts its own job.
    assert run_distributed(_no_group, 2, init=None, timeout=60) == [
        (0, False, None),
        (1, False, None),
    ]


def _tensor_result(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((1000,), float(rank))


def test_tensors_come_back_after_the_ranks_exit() -> None:
    out = run_distributed(_tensor_result, 2, timeout=60)
    assert [float(t.sum()) for t in out] == [0.0, 1000.0]


def _started(rank: int, world_size: int) -> tuple[str | None, str | None, int]:
    import multiprocessing

    return (
        multiprocessing.current_process().name,
        os.environ.get("DDPKIT_TEST_LATE"),
        os.getppid(),
    )


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_each_start_method_gives_the_callers_environment_of_the_moment(
    start_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_distributed(_tagged_sum, 1, args=(0,), start_method=start_method)  # a server, if any, runs
    monkeypatch.setenv("DDPKIT_TEST_LATE", start_method)  # set after the server started
    out = run_distributed(_started, 2, start_method=start_method)  # type: ignore[arg-type]
    assert [(name, late) for name, late, _ in out] == [
        ("ddpkit-rank0", start_method),
        ("ddpkit-rank1", start_method),
    ]
    parents = {parent for _, _, parent in out}
    assert (parents == {os.getpid()}) is (start_method == "spawn")  # forkserver: its server


def test_the_environment_variable_chooses_the_start_method(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DDPKIT_TEST_START_METHOD", "spawn")
    assert {parent for *_, parent in run_distributed(_started, 2)} == {os.getpid()}
    monkeypatch.setenv("DDPKIT_TEST_START_METHOD", "vfork")
    with pytest.raises(ValueError, match=r"DDPKIT_TEST_START_METHOD.*got 'vfork'"):
        run_distributed(_started, 2)


def _recorded(rank: int, world_size: int) -> list[str]:
    from ddpkit.distributed.recorder import local_history

    trace = local_history("gloo") or {}
    return [entry["profiling_name"] for entry in trace.get("entries", [])]


def test_every_rank_is_connected_before_the_function_starts() -> None:
    # A function with no collective of its own cannot end, and close its connections,
    # while a peer is still connecting: the group's one barrier comes first.
    out = run_distributed(_recorded, 2, env={"TORCH_FR_BUFFER_SIZE": "20"}, timeout=60)
    assert out == [["gloo:barrier"], ["gloo:barrier"]]
