"""ddpkit.distributed.rendezvous: the join over a store, its verdicts, and opening stores."""

from __future__ import annotations

import socket
import threading
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import ddpkit.distributed.rendezvous as rendezvous
from ddpkit.distributed.job import JobPlan
from ddpkit.distributed.rendezvous import Layout, RendezvousError, free_port, join, open_store


def _plan(rank: int, world_size: int, prefix: str = "ddpkit/rdzv") -> JobPlan:
    return JobPlan(rank=rank, world_size=world_size, local_rank=None, local_world_size=None,
                   node_rank=None, launcher="explicit", scheme="file", url="file:///tmp/rdzv",
                   file_path="/tmp/rdzv", store_prefix=prefix)  # fmt: skip


def _join_all(store: dist.Store, plans: list[JobPlan], seconds: float = 20.0) -> list[Any]:
    """Every plan joins from its own thread; each outcome is a Layout or the error raised."""
    out: list[Any] = [None] * len(plans)
    deadline = time.monotonic() + seconds

    def one(i: int) -> None:
        try:
            out[i] = join(store, plans[i], deadline)
        except RendezvousError as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,), name=f"rank-{i}") for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 30)
    return out


def test_ranks_on_two_hosts_are_placed_by_host_in_rank_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hosts = {"rank-0": "node-a", "rank-1": "node-b", "rank-2": "node-a", "rank-3": "node-b"}
    fake = types.SimpleNamespace(gethostname=lambda: hosts[threading.current_thread().name])
    monkeypatch.setattr(rendezvous, "socket", fake)
    out = _join_all(dist.HashStore(), [_plan(r, 4) for r in range(4)])
    assert out == [
        Layout(local_rank=0, local_world_size=2, node_rank=0),
        Layout(local_rank=0, local_world_size=2, node_rank=1),
        Layout(local_rank=1, local_world_size=2, node_rank=0),
        Layout(local_rank=1, local_world_size=2, node_rank=1),
    ]


def test_one_host_places_every_rank_on_node_0() -> None:
    out = _join_all(dist.HashStore(), [_plan(r, 3) for r in range(3)])
    assert out == [Layout(r, 3, 0) for r in range(3)]


def test_a_rank_given_twice_stops_every_rank_with_the_same_words() -> None:
    out = _join_all(dist.HashStore(), [_plan(0, 3), _plan(1, 3), _plan(1, 3)], seconds=10)
    assert all(isinstance(e, RendezvousError) for e in out), out
    assert len({str(e) for e in out}) == 1
    assert "rank 1 joined file:///tmp/rdzv twice" in str(out[0])
    assert "delete /tmp/rdzv, which an earlier run may have left" in str(out[0])


def test_a_rank_outside_the_world_is_named_by_what_is_missing() -> None:
    out = _join_all(dist.HashStore(), [_plan(0, 2), _plan(5, 2)], seconds=10)
    message = str(out[0])
    assert "2 processes joined but ranks 1 never did" in message
    assert "outside 0..1" in message
    assert isinstance(out[1], RendezvousError)


def test_a_missing_rank_times_out_naming_who_came_and_who_did_not() -> None:
    start = time.monotonic()
    out = _join_all(dist.HashStore(), [_plan(0, 3), _plan(1, 3)], seconds=0.5)
    assert time.monotonic() - start < 10
    for error in out:
        assert "timed out: 2 of 3 ranks joined (ranks 0, 1); missing rank(s) 2" in str(error)


def test_attempts_under_other_prefixes_do_not_meet() -> None:
    store = dist.HashStore()
    first = _join_all(store, [_plan(r, 2, "a") for r in range(2)])
    again = _join_all(store, [_plan(r, 2, "b") for r in range(2)])  # a restart: no "twice"
    assert first == again == [Layout(0, 2, 0), Layout(1, 2, 0)]


class _Gone:
    """A store whose host went away: every call fails as c10d's do."""

    def add(self, key: str, amount: int) -> int:
        raise RuntimeError("Connection reset by peer\nmore detail")


def test_a_store_that_goes_away_is_a_rendezvous_error() -> None:
    with pytest.raises(RendezvousError, match="lost the rendezvous store") as info:
        join(_Gone(), _plan(1, 2), time.monotonic() + 5)  # type: ignore[arg-type]
    assert "(Connection reset by peer). Rank 0 hosts it" in str(info.value)  # its first line


def test_a_file_store_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "nowhere" / "rdzv")
    plan = JobPlan(rank=1, world_size=2, local_rank=None, local_world_size=None, node_rank=None,
                   launcher="explicit", scheme="file", url=f"file://{path}",
                   file_path=path)  # fmt: skip
    with pytest.raises(RendezvousError, match="does not exist on rank 1"):
        open_store(plan, timedelta(seconds=2))


def test_free_port_is_free() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
