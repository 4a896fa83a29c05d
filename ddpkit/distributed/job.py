"""Where a process sits in the job: ``DistInfo``, and the one function that resolves it.

:func:`resolve_job` turns the arguments of ``init_distributed`` (or of a
``spawn`` child) and what the launcher said (a :class:`LaunchEnv` and a
:class:`MasterEndpoint`, read from the environment by ``ddpkit.distributed.launchers``)
into a :class:`JobPlan`: this process's rank, the world size and where the
ranks meet. Everything downstream receives these objects; nothing reads the
rank, the device or the master address back from ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from types import TracebackType
from urllib.parse import urlparse

import torch

from ddpkit._docs import see
from ddpkit._numbers import as_int, positive_seconds
from ddpkit.distributed.comm import destroy_group
from ddpkit.distributed.launchers import LaunchEnv, MasterEndpoint, parse_port

__all__ = [
    "DistInfo",
    "JobPlan",
    "as_timeout",
    "resolve_job",
    "restore_environ",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job. Returned by :func:`ddpkit.init_distributed`.

    Also a context manager: ``with init_distributed() as info:`` destroys the
    process group on the way out and puts back the environment variables
    ``init_distributed`` set (the NCCL/Gloo network variables).

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
            ``"explicit"`` (ranks passed as arguments), ``"existing"`` (a group
            made elsewhere) or ``"none"``.
        init_method: the rendezvous address, e.g. ``tcp://10.0.0.1:23456``.
        restart_count: how often the launcher restarted the job's processes
            before this attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT``,
            ``spawn(max_restarts=...)``); above 0, resume from a checkpoint.
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
    restart_count: int = 0
    # (name, value before) of each environment variable init_distributed set.
    environ_before: tuple[tuple[str, str | None], ...] = field(
        default=(), compare=False, repr=False, kw_only=True
    )

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

    def restore_environment(self) -> None:
        """Put back the environment variables ``init_distributed`` set; safe to call twice."""
        restore_environ(self.environ_before)

    def __enter__(self) -> DistInfo:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        destroy_group()
        self.restore_environment()


def restore_environ(before: Iterable[tuple[str, str | None]]) -> None:
    """Set each variable back to its value before (None: remove it)."""
    for name, value in before:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@dataclass(frozen=True)
class JobPlan:
    """A resolved job: who this process is and where the ranks meet.

    Attributes:
        rank: global rank.
        world_size: number of processes.
        local_rank: rank on this node, or None when only the rendezvous can
            tell (ranks passed as arguments: it counts the ranks per host).
        local_world_size: processes on this node, or None (the rendezvous tells).
        node_rank: index of this node, or None (the rendezvous tells).
        launcher: who said so: a launcher's name, or ``"explicit"``.
        scheme: ``"tcp"`` or ``"file"``.
        url: the normalised init method, ``tcp://host:port`` or ``file:///path``.
        master_addr: the store's host (tcp).
        master_port: the store's port (tcp).
        file_path: the store's file (file).
        store_is_external: the launcher hosts the store; rank 0 connects to it.
        store_prefix: the key prefix of this attempt in the store.
        restart_count: how often the launcher restarted the processes before.
    """

    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    node_rank: int | None
    launcher: str
    scheme: str
    url: str
    master_addr: str | None = None
    master_port: int | None = None
    file_path: str | None = None
    store_is_external: bool = False
    store_prefix: str = "ddpkit/rdzv"
    restart_count: int = 0


def as_timeout(name: str, value: object) -> timedelta:
    """``value`` as a positive, finite ``timedelta``; a number counts as seconds.

    Raises:
        ValueError: anything else (0, a negative, nan, a string, a bool), naming ``name``.
    """
    seconds = positive_seconds(value.total_seconds() if isinstance(value, timedelta) else value)
    try:  # a duration below timedelta's microsecond, or past its days, is none either
        duration = timedelta(seconds=seconds) if seconds is not None else timedelta(0)
    except OverflowError:
        duration = timedelta(0)
    if duration <= timedelta(0):
        raise ValueError(
            f"{name} must be a positive, finite timedelta or number of seconds, got {value!r}"
        )
    return duration


def resolve_job(
    init_method: str | None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    launch: LaunchEnv | None = None,
    endpoint: MasterEndpoint | None = None,
) -> JobPlan | None:
    """Combine explicit arguments and the launcher's view into a :class:`JobPlan`.

    Explicit arguments win only where they agree with a launcher; an
    ``env://`` init method (the default under a launcher) meets at
    ``endpoint``. Without a launcher and without an init method this is a
    plain single process: None.

    Args:
        init_method: ``env://``, ``tcp://host:port``, ``file:///path`` or None.
        world_size: number of processes, if given.
        rank: global rank, if given.
        local_rank: rank on this node, if given.
        launch: the launcher that started this process, if any.
        endpoint: ``MASTER_ADDR``/``MASTER_PORT`` (or the launcher's), for ``env://``.

    Raises:
        ValueError: the arguments contradict the launcher, or cannot describe
            a job; the message names the values and the fix.
    """
    world_size, rank, local_rank = (
        None if value is None else as_int(name, value)
        for name, value in (("world_size", world_size), ("rank", rank), ("local_rank", local_rank))
    )
    if launch is not None:
        for name, given, found in (
            ("world_size", world_size, launch.world_size),
            ("rank", rank, launch.rank),
        ):
            if given is not None and given != found:
                raise ValueError(
                    f"init_distributed({name}={given}) disagrees with {launch.launcher}, "
                    f"which says {name}={found} ({_variables(launch)}). Drop the argument "
                    f"and let the launcher decide, or launch without {launch.launcher}. "
                    + see("starting-the-job-init_distributed-spawn")
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
    if local_rank is not None and launch is not None and local_rank != launch.local_rank:
        raise ValueError(
            f"init_distributed(local_rank={local_rank}) disagrees with {launch.launcher}, which "
            f"says local_rank={launch.local_rank} ({_variables(launch)}). Drop the argument. "
            + see("starting-the-job-init_distributed-spawn")
        )
    if local_rank is None and launch is not None:
        local_rank = launch.local_rank
    if local_rank is not None and local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    method = init_method if init_method is not None else "env://"
    where = _meeting_point(method, launch, endpoint)
    return replace(
        where,
        rank=rk,
        world_size=ws,
        local_rank=local_rank,
        local_world_size=launch.local_world_size if launch else None,
        node_rank=launch.node_rank if launch else None,
        launcher=launch.launcher if launch else "explicit",
        restart_count=launch.restart_count if launch else 0,
    )


def _meeting_point(
    method: str, launch: LaunchEnv | None, endpoint: MasterEndpoint | None
) -> JobPlan:
    """The rendezvous part of a plan (rank fields still to fill in)."""
    parsed = urlparse(method)
    blank = JobPlan(0, 1, None, None, None, "", "", "")
    if parsed.scheme == "env":
        found = endpoint or MasterEndpoint(None, None, "")
        if not found.addr or found.port is None:
            raise ValueError(
                "init_method='env://' needs MASTER_ADDR and MASTER_PORT: export "
                "MASTER_ADDR=<rank-0 host> MASTER_PORT=29500 on every node, or pass "
                "init_method='tcp://<rank-0 host>:29500'"
            )
        port = parse_port(found.port, "MASTER_PORT")
        external = launch is not None and launch.store_is_external
        return replace(
            blank,
            scheme="tcp",
            url=f"tcp://{found.addr}:{port}",
            master_addr=found.addr,
            master_port=port,
            store_is_external=external,
            store_prefix=_store_prefix(launch) if external else "ddpkit/rdzv",
        )
    if parsed.scheme == "tcp":
        try:
            tcp_port = parsed.port
        except ValueError:  # urlparse refuses ports outside 0..65535
            tcp_port = None
        if not parsed.hostname or not tcp_port:
            raise ValueError(
                f"init_method {method!r} needs a host and a port 1..65535: tcp://10.0.0.1:23456"
            )
        return replace(
            blank,
            scheme="tcp",
            url=f"tcp://{parsed.hostname}:{tcp_port}",
            master_addr=parsed.hostname,
            master_port=tcp_port,
        )
    if parsed.scheme == "file":
        path = parsed.path if parsed.netloc in ("", "localhost") else parsed.netloc + parsed.path
        if not path:
            raise ValueError(f"init_method {method!r} needs a path: file:///shared/dir/rendezvous")
        if parsed.netloc not in ("", "localhost") or not os.path.isabs(path):
            # file://./rdzv would otherwise meet at /rdzv, at the filesystem root.
            raise ValueError(
                f"init_method {method!r} is a relative path, which every node would resolve "
                f"against its own working directory; give the absolute path on the shared "
                f"filesystem, e.g. file://{os.path.abspath(path)}"
            )
        return replace(blank, scheme="file", url=f"file://{path}", file_path=path)
    raise ValueError(
        f"init_method {method!r} is not supported: use 'env://', 'tcp://host:port' or "
        "'file:///path/on/a/shared/filesystem'"
    )


def _store_prefix(launch: LaunchEnv | None) -> str:
    # A launcher-hosted store outlives worker restarts: key each attempt apart.
    if launch is None:
        return "ddpkit/rdzv"
    return f"ddpkit/rdzv/{launch.run_id}/{launch.restart_count}"


def _variables(launch: LaunchEnv) -> str:
    return ", ".join(f"{k}={v}" for k, v in launch.variables) or "no variables"
