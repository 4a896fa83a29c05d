"""Start (and stop) a distributed job: ``init_distributed``, ``DistInfo``, ``shutdown``.

``init_distributed`` finds out where this process sits in the job (explicit
arguments, else torchrun / SLURM / Open MPI variables, else a single plain
process), configures the network, and joins the other ranks through a c10d
store of its own before handing that store to ``init_process_group``. The
join has a deadline separate from the collective timeout, and when it fails
the error says which ranks came, which did not, and why that usually happens.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from ddpkit.launchers import LaunchEnv, detect_launcher
from ddpkit.network import configure_network

__all__ = ["DistInfo", "RendezvousError", "init_distributed", "shutdown"]

logger = logging.getLogger("ddpkit")

_POLL_FIRST_S = 0.02
_POLL_MAX_S = 0.5
# How much longer the other ranks wait than rank 0, and rank 0 waits for them to
# read its verdict, so that rank 0's message (which names every rank) reaches all.
_ABORT_GRACE_S = 3.0


class RendezvousError(RuntimeError):
    """The ranks of a job could not find each other; the message says why and what to do."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job. Returned by :func:`init_distributed`.

    Also a context manager: ``with init_distributed() as info:`` destroys the
    process group on the way out.

    Attributes:
        rank: global rank, 0 .. world_size - 1.
        local_rank: rank on this node; selects the GPU.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, 0 .. number of nodes - 1.
        device: the device this process computes on (``cuda:<local_rank>`` or ``cpu``).
        backend: ``"nccl"``, ``"gloo"`` ..., or None without a process group.
        is_distributed: a process group exists (also true for a job of one rank
            started through a launcher or an init method).
        launcher: ``"torchrun"``, ``"spawn"``, ``"slurm"``, ``"openmpi"``,
            ``"explicit"`` (ranks passed as arguments) or ``"none"``.
        init_method: the rendezvous address, e.g. ``tcp://10.0.0.1:23456``.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str | None
    is_distributed: bool
    launcher: str = "none"
    init_method: str | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        if self.local_rank < 0 or self.local_world_size < 1:
            raise ValueError(
                f"local_rank={self.local_rank} and local_world_size={self.local_world_size} "
                "must be >= 0 and >= 1"
            )

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that writes checkpoints and logs."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0: one process per node (for per-node work like caching)."""
        return self.local_rank == 0

    def __enter__(self) -> DistInfo:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        shutdown()


def shutdown() -> None:
    """Destroy the default process group if there is one; safe to call twice.

    Also puts back the environment variables ``init_distributed`` set
    (``RANK``, ``LOCAL_RANK`` ..., and the network variables). Call it (or use
    ``with init_distributed():``) on every rank when training ends, and in
    ``finally``, so that a rank that fails leaves the group at once: the other
    ranks' next collective then fails quickly instead of waiting for the
    collective timeout.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _restore_env()


# Environment variables init_distributed set (network, torchrun's rank names),
# with their earlier values, so that shutdown() leaves the environment as it was.
_ENV_BEFORE_INIT: dict[str, str | None] = {}


def _remember_env(values: dict[str, str]) -> None:
    """Record variables that configure_network just set: it only sets unset ones."""
    for name in values:
        _ENV_BEFORE_INIT.setdefault(name, None)


def _set_env(values: dict[str, str]) -> None:
    for name, value in values.items():
        _ENV_BEFORE_INIT.setdefault(name, os.environ.get(name))
        os.environ[name] = value


def _restore_env() -> None:
    for name, value in _ENV_BEFORE_INIT.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _ENV_BEFORE_INIT.clear()


def init_distributed(
    init_method: str | None = None,
    backend: str = "auto",
    *,
    world_size: int | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    timeout: timedelta = timedelta(minutes=30),
    rendezvous_timeout: timedelta = timedelta(seconds=120),
    device: str | torch.device | None = None,
    network: str | None = "auto",
) -> DistInfo:
    """Join the job this process belongs to, or describe a single process.

    With no arguments the launcher is detected from the environment (torchrun,
    SLURM, Open MPI); without any, this is a plain single process: no process
    group is created and ``DistInfo.is_distributed`` is False, so one script
    runs anywhere.

    Args:
        init_method: ``"env://"`` (``MASTER_ADDR``/``MASTER_PORT``),
            ``"tcp://host:port"`` or ``"file:///shared/path"``; None: from the
            launcher.
        backend: ``"auto"`` (NCCL with CUDA, else Gloo), ``"nccl"``, ``"gloo"``.
        world_size: number of processes; default from the launcher.
        rank: global rank; default from the launcher.
        local_rank: rank on this node; default from the launcher, else worked
            out from which ranks share this host.
        timeout: collective timeout once the group is up.
        rendezvous_timeout: how long to wait for all ranks to join. Kept short
            so a misconfigured job fails in minutes, not after ``timeout``.
        device: ``"cpu"``, ``"cuda"`` (``cuda:local_rank``) or an explicit
            device; default ``cuda:local_rank`` when CUDA is available.
        network: ``"auto"`` runs :func:`ddpkit.configure_network` with the
            interface that routes to the master; an interface name uses that
            one; None leaves the network variables alone.

    Returns:
        A frozen :class:`DistInfo`.

    Raises:
        RendezvousError: the ranks did not all join within
            ``rendezvous_timeout``, a rank joined twice, the ranks disagree on
            the world size, or the port is taken. The message names them.
        ValueError: inconsistent arguments, or NCCL without CUDA.

    Example:
        >>> with init_distributed() as info:
        ...     model = wrap_ddp(model)  # trains on info.device
    """
    if dist.is_available() and dist.is_initialized():
        warnings.warn(
            "init_distributed: a process group already exists; returning its description "
            "(call ddpkit.shutdown() first to start a new one)",
            RuntimeWarning,
            stacklevel=2,
        )
        return _describe_existing()

    launch = detect_launcher()
    plan = _plan(init_method, world_size, rank, local_rank, launch)
    if plan is None:
        dev = _pick_device(device, 0, backend)
        _check_backend(_resolve_backend(backend, dev), dev)
        return DistInfo(0, 0, 1, 1, 0, dev, None, False)

    try:
        return _join(plan, backend, device, network, timeout, rendezvous_timeout)
    except BaseException:
        _restore_env()
        raise


def _join(
    plan: _Plan,
    backend: str,
    device: str | torch.device | None,
    network: str | None,
    timeout: timedelta,
    rendezvous_timeout: timedelta,
) -> DistInfo:
    dev = _pick_device(device, plan.local_rank, backend)
    resolved = _resolve_backend(backend, dev)
    _check_backend(resolved, dev)
    if network is not None:
        _remember_env(
            configure_network(socket_ifname=network, master_addr=plan.master_addr, backend=resolved)
        )
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    deadline = time.monotonic() + rendezvous_timeout.total_seconds()
    store = _open_store(plan, rendezvous_timeout)
    layout = _rendezvous(store, plan, deadline)
    local_rank_, local_world_size, node_rank = layout
    if plan.local_rank_known:
        local_rank_ = plan.local_rank
    if plan.launch is not None:
        local_world_size, node_rank = plan.launch.local_world_size, plan.launch.node_rank
    if dev.type == "cuda" and not plan.local_rank_known and device is None:
        # Only now is it known which GPU this rank takes on its host.
        dev = _pick_device(None, local_rank_, backend)
        torch.cuda.set_device(dev)

    _init_process_group(store, plan, resolved, dev, timeout, rendezvous_timeout)
    _export_env(plan, local_rank_, local_world_size, node_rank)
    info = DistInfo(
        rank=plan.rank,
        local_rank=local_rank_,
        world_size=plan.world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        device=dev,
        backend=resolved,
        is_distributed=True,
        launcher=plan.launcher,
        init_method=plan.url,
    )
    logger.info(
        "rank %d/%d (node %d, local rank %d) joined %s with %s on %s",
        info.rank,
        info.world_size,
        info.node_rank,
        info.local_rank,
        info.init_method,
        info.backend,
        info.device,
    )
    return info


@dataclass(frozen=True)
class _Plan:
    """The resolved rendezvous: who we are and where to meet."""

    scheme: str  # "tcp" or "file"
    url: str
    rank: int
    world_size: int
    local_rank: int
    local_rank_known: bool
    launcher: str
    launch: LaunchEnv | None
    master_addr: str | None = None
    master_port: int | None = None
    file_path: str | None = None
    store_is_external: bool = False


def _plan(
    init_method: str | None,
    world_size: int | None,
    rank: int | None,
    local_rank: int | None,
    launch: LaunchEnv | None,
) -> _Plan | None:
    if launch is not None:
        for name, given, found in (
            ("world_size", world_size, launch.world_size),
            ("rank", rank, launch.rank),
        ):
            if given is not None and given != found:
                raise ValueError(
                    f"init_distributed({name}={given}) disagrees with {launch.launcher}, "
                    f"which says {name}={found} ({_vars(launch)}). Drop the argument and let "
                    f"the launcher decide, or launch without {launch.launcher}."
                )
    if init_method is None and launch is None:
        if world_size not in (None, 1) or rank not in (None, 0):
            raise ValueError(
                f"init_distributed(world_size={world_size}, rank={rank}) needs a rendezvous: "
                "pass init_method='tcp://<rank-0 host>:<port>' (or 'env://' with MASTER_ADDR "
                "and MASTER_PORT set), or start the script with torchrun or srun."
            )
        return None

    ws = world_size if world_size is not None else (launch.world_size if launch else None)
    rk = rank if rank is not None else (launch.rank if launch else None)
    if ws is None or rk is None:
        raise ValueError(
            f"init_distributed({init_method!r}) needs world_size= and rank= (or a launcher "
            "such as torchrun that sets RANK and WORLD_SIZE)"
        )
    if ws < 1 or not 0 <= rk < ws:
        raise ValueError(
            f"rank {rk} is outside 0..{ws - 1} for world_size={ws}: each node's ranks must "
            "be below the total number of processes"
        )
    lr = local_rank if local_rank is not None else (launch.local_rank if launch else None)
    common: dict[str, Any] = {
        "rank": rk,
        "world_size": ws,
        "local_rank": lr if lr is not None else 0,
        "local_rank_known": lr is not None,
        "launcher": launch.launcher if launch else "explicit",
        "launch": launch,
    }

    method = init_method if init_method is not None else "env://"
    parsed = urlparse(method)
    if parsed.scheme == "env":
        addr = os.environ.get("MASTER_ADDR") or (launch.master_addr if launch else None)
        port_text = os.environ.get("MASTER_PORT") or (
            str(launch.master_port) if launch and launch.master_port else None
        )
        if not addr or not port_text:
            raise ValueError(
                "init_method='env://' needs MASTER_ADDR and MASTER_PORT: export "
                "MASTER_ADDR=<rank-0 host> MASTER_PORT=29500 on every node, or pass "
                "init_method='tcp://<rank-0 host>:29500'"
            )
        port = _port(port_text, method)
        external = launch.store_is_external if launch else False
        url = f"tcp://{addr}:{port}"
        return _Plan(
            "tcp", url, master_addr=addr, master_port=port, store_is_external=external, **common
        )
    if parsed.scheme == "tcp":
        if not parsed.hostname or parsed.port is None:
            raise ValueError(
                f"init_method {method!r} needs a host and a port: tcp://10.0.0.1:23456"
            )
        return _Plan(
            "tcp",
            f"tcp://{parsed.hostname}:{parsed.port}",
            master_addr=parsed.hostname,
            master_port=parsed.port,
            **common,
        )
    if parsed.scheme == "file":
        path = parsed.path
        if not path:
            raise ValueError(f"init_method {method!r} needs a path: file:///shared/dir/rendezvous")
        return _Plan("file", f"file://{path}", file_path=path, **common)
    raise ValueError(
        f"init_method {method!r} is not supported: use 'env://', 'tcp://host:port' or "
        "'file:///path/on/a/shared/filesystem'"
    )


def _port(text: str, method: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={text!r} (for {method}) is not a port number 1..65535")
    return port


def _vars(launch: LaunchEnv) -> str:
    return ", ".join(f"{k}={v}" for k, v in launch.variables) or "no variables"


def _pick_device(device: str | torch.device | None, local_rank: int, backend: str) -> torch.device:
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
    elif torch.cuda.is_available() and backend != "gloo":
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"device {dev} was asked for, but CUDA is not available here")
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"local rank {local_rank} wants {dev}, but only {count} GPU(s) are visible: "
                "start at most one process per GPU on each node (torchrun --nproc-per-node, "
                "srun --ntasks-per-node) or check CUDA_VISIBLE_DEVICES"
            )
    return dev


def _resolve_backend(backend: str, dev: torch.device) -> str:
    if backend == "auto":
        return "nccl" if dev.type == "cuda" else "gloo"
    return backend.lower()


def _check_backend(backend: str, dev: torch.device) -> None:
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend='nccl' needs CUDA GPUs, and torch.cuda.is_available() is False here: "
            "use backend='gloo' (or 'auto') to run on the CPU"
        )
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"backend='nccl' needs a CUDA device, got device={dev}; use 'gloo'")
    if not dist.is_available():
        raise ValueError("this PyTorch build has no torch.distributed support")


def _open_store(plan: _Plan, rendezvous_timeout: timedelta) -> dist.Store:
    if plan.scheme == "file":
        assert plan.file_path is not None
        directory = os.path.dirname(plan.file_path) or "."
        if not os.path.isdir(directory):
            raise RendezvousError(
                f"{plan.url}: directory {directory!r} does not exist on rank {plan.rank}. "
                "file:// rendezvous needs a path on a filesystem every node shares (NFS, Lustre)."
            )
        store: dist.Store = dist.FileStore(plan.file_path, plan.world_size)
        store.set_timeout(rendezvous_timeout)
        return store
    assert plan.master_addr is not None
    assert plan.master_port is not None
    host, port = plan.master_addr, plan.master_port
    is_master = plan.rank == 0 and not plan.store_is_external
    try:
        return dist.TCPStore(
            host,
            port,
            is_master=is_master,
            wait_for_workers=False,
            timeout=rendezvous_timeout,
        )
    except Exception as exc:  # c10d raises DistNetworkError / DistStoreError / RuntimeError
        text = str(exc)
        if is_master and ("EADDRINUSE" in text or "address already in use" in text.lower()):
            raise RendezvousError(
                f"rank 0 cannot host the rendezvous store at {plan.url}: port {port} is already "
                f"in use on this machine (another job, or an earlier run still exiting). Pick "
                f"a free port, e.g. tcp://{host}:{_free_port()} (the same on every node), or "
                f"find the process with `ss -ltnp 'sport = :{port}'`."
            ) from exc
        if is_master:
            raise RendezvousError(
                f"rank 0 cannot host the rendezvous store at {plan.url}: {text}. Check that "
                f"{host} is an address of this machine and the port is free."
            ) from exc
        raise RendezvousError(
            f"rank {plan.rank} could not reach the rendezvous store at {plan.url} within "
            f"{rendezvous_timeout.total_seconds():g} s: {text.splitlines()[0] if text else exc!r}. "
            f"Likely causes: rank 0 is not running (start it first, or check it did not fail), "
            f"MASTER_ADDR/--dist-url points to the wrong host, a firewall blocks port {port}, "
            f"or the port differs between nodes. `ddpkit doctor --master-addr {host} "
            f"--master-port {port}` checks the connection."
        ) from exc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def _prefix(plan: _Plan) -> str:
    # A launcher-hosted store outlives worker restarts: key each attempt apart.
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"ddpkit/rdzv/{run}/{restart}" if plan.store_is_external else "ddpkit/rdzv"


def _rendezvous(store: dist.Store, plan: _Plan, deadline: float) -> tuple[int, int, int]:
    """Register this rank, wait for all, and return (local_rank, local_world_size, node_rank).

    Every rank bumps a counter under its own rank key (a second process with
    the same rank sees 2), records its world size and host, then bumps the
    joined counter. Rank 0 checks the members once all have joined and
    publishes either the node layout or an abort message that every rank
    raises.
    """
    try:
        return _rendezvous_steps(store, plan, deadline)
    except RendezvousError:
        raise
    except RuntimeError as exc:  # c10d's DistError and friends: the store went away
        raise RendezvousError(
            f"rank {plan.rank} lost the rendezvous store at {plan.url} while waiting for the "
            f"other ranks ({str(exc).splitlines()[0] if str(exc) else exc!r}). Rank 0 hosts "
            "it: rank 0 probably exited or failed, and its own error says why."
        ) from exc


def _rendezvous_steps(store: dist.Store, plan: _Plan, deadline: float) -> tuple[int, int, int]:
    p = _prefix(plan)
    layout_key, joined_key = f"{p}/layout", f"{p}/joined"
    me = {"world_size": plan.world_size, "host": socket.gethostname(), "pid": os.getpid()}

    count = store.add(f"{p}/count/{plan.rank}", 1)
    store.set(f"{p}/info/{plan.rank}", json.dumps(me))
    if count > 1:
        message = (
            f"rank {plan.rank} joined {plan.url} twice: a second process was started with "
            f"rank {plan.rank} (latest from host {me['host']}, pid {me['pid']}). Each process "
            "needs its own rank: check --rank / node_rank on every node, and that no other "
            "job uses the same address and port."
        )
        if plan.scheme == "file":
            message += (
                f" With file://, a file left by an earlier run also does this: delete "
                f"{plan.file_path} before starting."
            )
        store.set(f"{p}/abort", message)
        raise RendezvousError(message)
    store.add(joined_key, 1)

    hosts_store = plan.rank == 0 and plan.scheme == "tcp" and not plan.store_is_external
    if plan.scheme == "tcp" and not hosts_store:
        # Let rank 0 time out first: it sees every rank and says which are missing.
        deadline += _ABORT_GRACE_S
    pause = _POLL_FIRST_S
    while True:
        _raise_if_aborted(store, p, hosts_store)
        if plan.rank == 0:
            joined = store.add(joined_key, 0)
            if joined >= plan.world_size:
                problem = _check_members(store, plan, p, joined)
                if isinstance(problem, str):
                    raise _abort(store, p, problem, hosts_store)
                store.set(layout_key, json.dumps(problem))
                return _my_place(problem, plan)
        elif store.check([layout_key]):
            layout = json.loads(store.get(layout_key))
            if layout["world_size"] != plan.world_size:
                raise RendezvousError(
                    f"this rank ({plan.rank}) was started with world_size={plan.world_size}, but "
                    f"rank 0 formed the job at {plan.url} with world_size="
                    f"{layout['world_size']}: give every node the same world size."
                )
            return _my_place(layout, plan)
        if time.monotonic() >= deadline:
            raise _abort(store, p, _timeout_message(store, plan, p), hosts_store)
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _raise_if_aborted(store: dist.Store, p: str, hosts_store: bool) -> None:
    if not store.check([f"{p}/abort"]):
        return
    message = store.get(f"{p}/abort").decode()
    if hosts_store:
        _linger(store, p, store.add(f"{p}/joined", 0) - 1)
    else:
        store.add(f"{p}/abort_seen", 1)
    raise RendezvousError(message)


def _abort(store: dist.Store, p: str, message: str, hosts_store: bool) -> RendezvousError:
    """Publish why the rendezvous failed; return the error for this rank to raise."""
    store.set(f"{p}/abort", message)
    if hosts_store:
        _linger(store, p, store.add(f"{p}/joined", 0) - 1)
    return RendezvousError(message)


def _linger(store: dist.Store, p: str, readers: int) -> None:
    """On the rank that hosts the store: let the other ranks read the verdict first.

    The store disappears when this process exits, and with it the message
    that tells every other rank what went wrong.
    """
    until = time.monotonic() + _ABORT_GRACE_S
    while store.add(f"{p}/abort_seen", 0) < readers and time.monotonic() < until:
        time.sleep(_POLL_FIRST_S)


def _check_members(store: dist.Store, plan: _Plan, p: str, joined: int) -> dict[str, Any] | str:
    """On rank 0: validate who joined; return the node layout, or what is wrong."""
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
            f"{plan.world_size}, but " + "; ".join(problems) + ". world_size is the total "
            "number of processes (nodes x processes per node) and must be the same on every node."
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


def _my_place(layout: dict[str, Any], plan: _Plan) -> tuple[int, int, int]:
    node, local, size = layout["places"][plan.rank]
    return int(local), int(size), int(node)


def _timeout_message(store: dist.Store, plan: _Plan, p: str) -> str:
    joined = [r for r in range(plan.world_size) if store.add(f"{p}/count/{r}", 0) > 0]
    missing = [r for r in range(plan.world_size) if r not in joined]
    return (
        f"rendezvous at {plan.url} timed out: {len(joined)} of {plan.world_size} ranks joined "
        f"(ranks {_ranks(joined)}); missing rank(s) {_ranks(missing)}. Likely causes: "
        f"world_size={plan.world_size} is not the same on every node (it is the total number "
        "of processes, not of nodes, once each node starts several); the missing ranks' "
        "node was not started or failed before joining; it points to another address or "
        "port; or a firewall blocks it. Check --world-size and --rank on every node, or run "
        "`ddpkit doctor` there."
    )


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if len(ranks) > 16:
        return ", ".join(map(str, ranks[:16])) + f", ... ({len(ranks)} in all)"
    return ", ".join(map(str, ranks))


def _init_process_group(
    store: dist.Store,
    plan: _Plan,
    backend: str,
    dev: torch.device,
    timeout: timedelta,
    rendezvous_timeout: timedelta,
) -> None:
    set_timeout = getattr(dist, "set_timeout", None) or getattr(
        dist.distributed_c10d, "_set_pg_timeout", None
    )
    # Connect with the short timeout so a wrong interface fails in minutes,
    # then switch to the collective timeout the caller asked for.
    first_timeout = min(timeout, rendezvous_timeout) if set_timeout else timeout
    kwargs: dict[str, Any] = {}
    if dev.type == "cuda" and backend == "nccl":
        kwargs["device_id"] = dev
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(_prefix(plan) + "/pg", store),
            rank=plan.rank,
            world_size=plan.world_size,
            timeout=first_timeout,
            **kwargs,
        )
        if backend == "nccl":
            dist.barrier(device_ids=[dev.index])
    except Exception as exc:
        shutdown()
        raise RendezvousError(
            f"all {plan.world_size} ranks joined {plan.url}, but the {backend} backend could "
            f"not connect them: {str(exc).splitlines()[0] if str(exc) else exc!r}. The ranks "
            "reach each other on other ports than the rendezvous one: check "
            "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name an interface that routes between "
            "the nodes (ddpkit.configure_network(socket_ifname='auto') picks it), that a "
            "firewall allows traffic between the nodes, and NCCL_IB_DISABLE=1 without "
            "InfiniBand. `ddpkit doctor` prints all of these."
        ) from exc
    if set_timeout is not None and first_timeout != timeout:
        set_timeout(timeout)
    store.set_timeout(timeout)


def _export_env(plan: _Plan, local_rank: int, local_world_size: int, node_rank: int) -> None:
    # torchrun's names, so code that reads them (and ddpkit.get_local_rank)
    # agrees; shutdown() puts the previous values back.
    values = {
        "RANK": str(plan.rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
    }
    if plan.master_addr and plan.master_port and "MASTER_ADDR" not in os.environ:
        values.update({"MASTER_ADDR": plan.master_addr, "MASTER_PORT": str(plan.master_port)})
    _set_env(values)


def _describe_existing() -> DistInfo:
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    backend = str(dist.get_backend())
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    return DistInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=int(os.environ.get("GROUP_RANK", "0") or 0),
        device=dev,
        backend=backend,
        is_distributed=True,
        launcher="existing",
    )
