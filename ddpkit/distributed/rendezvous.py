"""How the ranks find each other: the c10d store, ddpkit's join protocol, ``RendezvousError``.

Every rank registers under its own key, records its world size and host, and
waits; rank 0 checks who came and publishes either the node layout or a
verdict that every rank raises. The whole join has a deadline, separate from
the collective timeout, so a misconfigured job fails in minutes with the
missing, duplicated or disagreeing ranks named, instead of hanging.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch.distributed as dist

from ddpkit._docs import see
from ddpkit.distributed.deadline import BoundedCalls, DeadlinePassed
from ddpkit.distributed.job import JobPlan
from ddpkit.distributed.ports import probe_tcp

__all__ = ["Layout", "RendezvousError", "free_port", "join", "open_store"]

_POLL_FIRST_S = 0.02
_POLL_MAX_S = 0.5
# How much longer the other ranks wait than rank 0, and rank 0 waits for them to
# read its verdict, so that rank 0's message (which names every rank) reaches all.
_ABORT_GRACE_S = 3.0
# How long past the rendezvous timeout a connecting store may take before it is
# called silent: c10d's own connect retries end at the timeout and say why.
_CONNECT_GRACE_S = 0.5
# What the join needs of a store: c10d's own, or the deadline-bounded proxy.
Store = Any


class RendezvousError(RuntimeError):
    """The ranks of a job could not find each other; the message says why and what to do."""


@dataclass(frozen=True)
class Layout:
    """Where the rendezvous placed this rank: its node and its place on it."""

    local_rank: int
    local_world_size: int
    node_rank: int


def open_store(plan: JobPlan, rendezvous_timeout: timedelta) -> dist.Store:
    """Create (rank 0 over TCP) or connect to the job's c10d store.

    Raises:
        RendezvousError: the port is taken, the address is not rank 0's, or
            the store cannot be reached within ``rendezvous_timeout``.
    """
    if plan.scheme == "file":
        assert plan.file_path is not None
        _check_store_file(plan, plan.file_path)
        store: dist.Store = dist.FileStore(plan.file_path, plan.world_size)
        store.set_timeout(rendezvous_timeout)
        return store
    assert plan.master_addr is not None
    assert plan.master_port is not None
    host, port = plan.master_addr, plan.master_port
    is_master = plan.rank == 0 and not plan.store_is_external
    seconds = rendezvous_timeout.total_seconds()
    calls = BoundedCalls(time.monotonic() + seconds + _CONNECT_GRACE_S, "ddpkit-store-connect")
    try:
        connect = partial(
            dist.TCPStore, is_master=is_master, wait_for_workers=False, timeout=rendezvous_timeout
        )
        tcp_store: dist.Store = calls(connect, host, port)
    except DeadlinePassed:
        raise _silent_store_error(plan, seconds) from None
    except Exception as exc:  # c10d raises DistNetworkError / DistStoreError / RuntimeError
        raise _store_error(plan, is_master, exc, rendezvous_timeout) from exc
    finally:
        calls.close()
    return tcp_store


def _check_store_file(plan: JobPlan, path: str) -> None:
    """Refuse a file:// path that c10d's FileStore cannot create or open, naming it."""
    directory = os.path.dirname(path.rstrip("/")) or "/"
    problem = ""
    if path.endswith("/") or os.path.isdir(path):
        problem = f"{path!r} is a directory; name a file in it, e.g. file://{path.rstrip('/')}/rdzv"
    elif not os.path.isdir(directory):
        problem = f"directory {directory!r} does not exist on rank {plan.rank}"
    elif not os.access(path if os.path.exists(path) else directory, os.R_OK | os.W_OK):
        where = path if os.path.exists(path) else f"directory {directory!r}"
        problem = f"{where} is not writable by this user on rank {plan.rank}"
    if problem:
        raise RendezvousError(
            f"{plan.url}: {problem}. file:// rendezvous needs a file path, new or left by no "
            "other job, in a writable directory on a filesystem every node shares (NFS, "
            "Lustre), or use tcp://. " + see("the-store-cannot-be-opened")
        )


def _silent_store_error(plan: JobPlan, seconds: float) -> RendezvousError:
    where = f"{plan.master_addr}:{plan.master_port}"
    if probe_tcp(str(plan.master_addr), int(plan.master_port or 0), 2.0)[0]:
        return RendezvousError(
            f"something at {where} accepted the connection but did not answer as a ddpkit/c10d "
            f"store within {seconds:g} s: another program holds the port, or rank 0 is stopped "
            "(Ctrl-Z / SIGSTOP) or hung. Check what listens there (`ss -ltnp 'sport = "
            f":{plan.master_port}'` on that host) and use a free port on every node. "
            + see("a-rank-cannot-reach-the-store")
        )
    return RendezvousError(
        f"rank {plan.rank} could not reach the rendezvous store at {plan.url} within "
        f"{seconds:g} s. Start rank 0 first (rank 0 is not running, or failed), and check the "
        "address and port on every node. " + see("a-rank-cannot-reach-the-store")
    )


def _store_error(
    plan: JobPlan, is_master: bool, exc: Exception, timeout: timedelta
) -> RendezvousError:
    text = str(exc)
    host, port = plan.master_addr, plan.master_port
    if is_master and ("EADDRINUSE" in text or "address already in use" in text.lower()):
        return RendezvousError(
            f"rank 0 cannot host the rendezvous store at {plan.url}: port {port} is already "
            f"in use on this machine (another job, or an earlier run still exiting). Pick a "
            f"free port, e.g. tcp://{host}:{free_port()} (the same on every node). "
            + see("the-store-cannot-be-opened")
        )
    if is_master:
        return RendezvousError(
            f"rank 0 cannot host the rendezvous store at {plan.url}: {_first_line(exc)}. "
            f"Check that {host} is an address of this machine and the port is free. "
            + see("the-store-cannot-be-opened")
        )
    return RendezvousError(
        f"rank {plan.rank} could not reach the rendezvous store at {plan.url} within "
        f"{timeout.total_seconds():g} s: {_first_line(exc)}. Start rank 0 first (rank 0 is "
        f"not running, or failed), and check the address and port on every node; `ddpkit "
        f"doctor --master-addr {host} --master-port {port}` tests the connection. "
        + see("a-rank-cannot-reach-the-store")
    )


def free_port() -> int:
    """A TCP port that is free on this machine right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def join(store: dist.Store, plan: JobPlan, deadline: float) -> Layout:
    """Register this rank, wait for all, and return where the rendezvous placed it.

    All ranks must call this, or it deadlocks until ``deadline``
    (``time.monotonic()``), when every rank raises a :class:`RendezvousError`
    naming the ranks that joined and those that did not. Every store call is
    bounded by the deadline too, so a store that stops answering (rank 0
    stopped with SIGSTOP) cannot hold this rank past it.
    """
    calls = BoundedCalls(deadline + _ABORT_GRACE_S + _CONNECT_GRACE_S, "ddpkit-rendezvous")
    try:
        return _join(_BoundedStore(store, calls), plan, deadline)
    except DeadlinePassed:
        raise RendezvousError(
            f"rank {plan.rank}: the rendezvous store at {plan.url} stopped answering (a call "
            f"made no progress by the rendezvous deadline). Rank 0, which hosts it, is stopped "
            "(Ctrl-Z / SIGSTOP), hung or overloaded, or the network between the nodes dropped; "
            "its own output says which. " + see("a-rank-cannot-reach-the-store")
        ) from None
    except RendezvousError:
        raise
    except RuntimeError as exc:  # c10d's DistError and friends: the store went away
        raise RendezvousError(
            f"rank {plan.rank} lost the rendezvous store at {plan.url} while waiting for the "
            f"other ranks ({_first_line(exc)}). Rank 0 hosts it: read rank 0's own error, "
            "which says why it stopped. " + see("a-rank-cannot-reach-the-store")
        ) from exc
    finally:
        calls.close()


class _BoundedStore:
    """The store calls the join makes, each one bounded by the rendezvous deadline."""

    def __init__(self, store: dist.Store, calls: BoundedCalls) -> None:
        self._store, self._calls = store, calls

    def add(self, key: str, amount: int) -> int:
        return self._calls(self._store.add, key, amount)

    def set(self, key: str, value: str) -> None:
        self._calls(self._store.set, key, value)

    def get(self, key: str) -> bytes:
        return self._calls(self._store.get, key)

    def check(self, keys: list[str]) -> bool:
        return self._calls(self._store.check, keys)


def _join(store: Store, plan: JobPlan, deadline: float) -> Layout:
    p = plan.store_prefix
    layout_key, joined_key = f"{p}/layout", f"{p}/joined"
    me = {"world_size": plan.world_size, "host": socket.gethostname(), "pid": os.getpid()}

    count = store.add(f"{p}/count/{plan.rank}", 1)
    store.set(f"{p}/info/{plan.rank}", json.dumps(me))
    if plan.rank == 0 and count == 1:
        store.set(f"{p}/world_size", str(plan.world_size))
    if count > 1:
        message = (
            f"rank {plan.rank} joined {plan.url} twice: a second process was started with "
            f"rank {plan.rank} (latest from host {me['host']}, pid {me['pid']}). Give each "
            "process its own rank (--rank / node_rank on every node), one job per address "
            "and port"
        )
        if plan.scheme == "file":
            message += f", and delete {plan.file_path}, which an earlier run may have left"
        message += ". " + see("the-ranks-disagree-on-the-job")
        store.set(f"{p}/abort", message)
        raise RendezvousError(message)
    store.add(joined_key, 1)

    hosts_store = plan.rank == 0 and plan.scheme == "tcp" and not plan.store_is_external
    if plan.scheme == "tcp" and not hosts_store:
        # Let rank 0 time out first: it sees every rank and says which are missing.
        deadline += _ABORT_GRACE_S
    pause, compared = _POLL_FIRST_S, False
    while True:
        _raise_if_aborted(store, p, hosts_store)
        if plan.rank == 0:
            joined = store.add(joined_key, 0)
            if joined >= plan.world_size:
                problem = _check_members(store, plan, joined)
                if isinstance(problem, str):
                    raise _abort(store, p, problem, hosts_store)
                store.set(layout_key, json.dumps(problem))
                return _place(problem, plan)
        elif not compared and store.check([f"{p}/world_size"]):
            compared = True
            theirs = int(store.get(f"{p}/world_size"))
            if theirs != plan.world_size:
                raise _abort(store, p, _disagree(plan, theirs, str(me["host"])), hosts_store)
        elif store.check([layout_key]):
            layout = json.loads(store.get(layout_key))
            if layout["world_size"] != plan.world_size:
                raise RendezvousError(
                    f"this rank ({plan.rank}) was started with world_size={plan.world_size}, but "
                    f"rank 0 formed the job at {plan.url} with world_size="
                    f"{layout['world_size']}. Give every node the same world size. "
                    + see("the-ranks-disagree-on-the-job")
                )
            return _place(layout, plan)
        if time.monotonic() >= deadline:
            raise _abort(store, p, _timeout_message(store, plan), hosts_store)
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _disagree(plan: JobPlan, rank0_world_size: int, host: str) -> str:
    return (
        f"the ranks at {plan.url} disagree on the job: rank 0 has world_size="
        f"{rank0_world_size}, but rank {plan.rank} (host {host}) was started with world_size="
        f"{plan.world_size}. world_size is the total number of processes (nodes x processes "
        "per node), the same on every node. " + see("the-ranks-disagree-on-the-job")
    )


def _raise_if_aborted(store: Store, p: str, hosts_store: bool) -> None:
    if not store.check([f"{p}/abort"]):
        return
    message = store.get(f"{p}/abort").decode()
    if hosts_store:
        _linger(store, p, store.add(f"{p}/joined", 0) - 1)
    else:
        store.add(f"{p}/abort_seen", 1)
    raise RendezvousError(message)


def _abort(store: Store, p: str, message: str, hosts_store: bool) -> RendezvousError:
    """Publish why the rendezvous failed; return the error for this rank to raise."""
    store.set(f"{p}/abort", message)
    if hosts_store:
        _linger(store, p, store.add(f"{p}/joined", 0) - 1)
    return RendezvousError(message)


def _linger(store: Store, p: str, readers: int) -> None:
    """On the rank that hosts the store: let the other ranks read the verdict first.

    The store disappears when this process exits, and with it the message
    that tells every other rank what went wrong.
    """
    until = time.monotonic() + _ABORT_GRACE_S
    while store.add(f"{p}/abort_seen", 0) < readers and time.monotonic() < until:
        time.sleep(_POLL_FIRST_S)


def _check_members(store: Store, plan: JobPlan, joined: int) -> dict[str, Any] | str:
    """On rank 0: validate who joined; return the node layout, or what is wrong."""
    p = plan.store_prefix
    infos: list[dict[str, Any]] = []
    for r in range(plan.world_size):
        if store.add(f"{p}/count/{r}", 0) == 0:
            infos.append({})
            continue
        infos.append(json.loads(store.get(f"{p}/info/{r}")))
    problems = [
        f"rank {r} (host {info['host']}) was started with world_size={info['world_size']}"
        for r, info in enumerate(infos)
        if info and info["world_size"] != plan.world_size
    ]
    missing = [r for r, info in enumerate(infos) if not info]
    if joined > plan.world_size or missing:
        problems.append(
            f"{joined} processes joined but ranks {_ranks(missing)} never did: some processes "
            f"were given ranks outside 0..{plan.world_size - 1}"
        )
    if problems:
        return (
            f"the ranks at {plan.url} disagree on the job: rank 0 has world_size="
            f"{plan.world_size}, but " + "; ".join(problems) + ".\nworld_size is the total "
            "number of processes (nodes x processes per node), the same on every node. "
            + see("the-ranks-disagree-on-the-job")
        )
    hosts: list[str] = []
    places: list[tuple[int, int]] = []
    for info in infos:
        if info["host"] not in hosts:
            hosts.append(info["host"])
        node = hosts.index(info["host"])
        local = sum(1 for prev in places if prev[0] == node)
        places.append((node, local))
    sizes = [sum(1 for q in places if q[0] == node) for node in range(len(hosts))]
    return {"world_size": plan.world_size, "places": [[n, lr, sizes[n]] for n, lr in places]}


def _place(layout: dict[str, Any], plan: JobPlan) -> Layout:
    node, local, size = layout["places"][plan.rank]
    return Layout(local_rank=int(local), local_world_size=int(size), node_rank=int(node))


def _timeout_message(store: Store, plan: JobPlan) -> str:
    p = plan.store_prefix
    joined = [r for r in range(plan.world_size) if store.add(f"{p}/count/{r}", 0) > 0]
    missing = [r for r in range(plan.world_size) if r not in joined]
    return (
        f"rendezvous at {plan.url} timed out: {len(joined)} of {plan.world_size} ranks joined "
        f"(ranks {_ranks(joined)}); missing rank(s) {_ranks(missing)}. Likely "
        f"world_size={plan.world_size} is not the same on every node (it counts processes, "
        "not nodes), or a node was not started or cannot reach this address. Start every "
        "node with the same world size; run `ddpkit doctor` on the missing ranks' node. "
        + see("rendezvous-timed-out")
    )


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if len(ranks) > 16:
        return ", ".join(map(str, ranks[:16])) + f", ... ({len(ranks)} in all)"
    return ", ".join(map(str, ranks))


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else repr(exc)
