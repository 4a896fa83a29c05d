"""Read the launcher's environment variables: the only module that reads them.

torchrun (and torchelastic), SLURM's ``srun`` and Open MPI's ``mpirun`` each
describe a process's place in the job with their own variables, and
``MASTER_ADDR`` / ``MASTER_PORT`` say where the ranks meet. This module turns
them into one :class:`LaunchEnv` and one :class:`MasterEndpoint`; everything
downstream (``ddpkit.distributed.job``, ``ddpkit.distributed.network``, ``ddpkit doctor``) receives
those objects and never reads the environment for them itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LaunchEnv",
    "MasterEndpoint",
    "detect_launcher",
    "expand_hostlist",
    "launched_by",
    "launcher_job",
    "local_world_size",
    "master_endpoint",
    "parse_port",
    "slurm_master_port",
]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a job, as its launcher described it.

    Attributes:
        launcher: ``"torchrun"`` (also any launcher that exports torchrun's
            ``RANK``/``WORLD_SIZE`` variables), ``"slurm"`` or ``"openmpi"``;
            ``"spawn"`` when ``ddpkit.spawn`` builds one for its children.
        rank: global rank.
        local_rank: rank on this node.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node.
        master_addr: host of the rendezvous store, if the launcher told.
        master_port: port of the rendezvous store, if the launcher told.
        store_is_external: the launcher hosts the rendezvous store (torchrun's
            agent, or ``ddpkit.spawn``'s parent): rank 0 must connect to it,
            not create it.
        run_id: torchelastic's run id (``TORCHELASTIC_RUN_ID``), or "".
        restart_count: how often torchelastic restarted the workers.
        max_restarts: torchrun's ``--max-restarts`` (``TORCHELASTIC_MAX_RESTARTS``), or None.
        variables: the environment variables this was read from.
    """

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None = None
    master_port: int | None = None
    store_is_external: bool = False
    run_id: str = ""
    restart_count: int = 0
    max_restarts: int | None = None
    variables: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class MasterEndpoint:
    """Where rank 0's rendezvous store is, as the environment tells it.

    Attributes:
        addr: the host, or None when nothing says.
        port: the port as written (check it with :func:`parse_port`), or None.
        source: where ``addr`` came from: ``"MASTER_ADDR"``, a launcher's
            name (``"slurm"``: the first host of the node list), or "".
    """

    addr: str | None
    port: str | None
    source: str


def detect_launcher(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """Return the launcher that started this process, or None for a plain process.

    Looked for in this order: torchrun-style variables (``RANK`` and
    ``WORLD_SIZE``), SLURM (``SLURM_PROCID`` in a step of more than one task),
    Open MPI (``OMPI_COMM_WORLD_RANK``). torchrun comes first so that
    ``srun torchrun ...`` is described by torchrun.

    Args:
        environ: the environment to read; ``os.environ`` by default.

    Raises:
        ValueError: a launcher's variables are present but malformed; the
            message names the variable and its value.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun(env)
    if "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", 1) > 1:
        return _slurm(env)
    if "OMPI_COMM_WORLD_RANK" in env and _int(env, "OMPI_COMM_WORLD_SIZE", 1) > 1:
        return _openmpi(env)
    return None


def launched_by() -> str | None:
    """The launcher that started this process: ``"torchrun"``, ``"slurm"``, ``"openmpi"``; or None.

    None: a plain process, which may start its own with ``ddpkit.spawn``. A
    script that can run either way asks this before it spawns, so that under a
    launcher it takes the launcher's processes instead of starting more.

    Raises:
        ValueError: a launcher's variables are present but malformed.
    """
    found = detect_launcher()
    return None if found is None else found.launcher


def launcher_job(environ: Mapping[str, str] | None = None) -> str | None:
    """The launcher's name for this job: the same in all its processes and across its restarts.

    torchrun's ``--rdzv-id`` (``TORCHELASTIC_RUN_ID``; ``--standalone`` makes one
    up per torchrun). None: not torchrun, or its default id ``none``, which every
    job started without one shares. A checkpoint records it, so a worker that
    torchrun starts again after a server joined (``TORCHELASTIC_RESTART_COUNT``
    stays 0: a membership change is not a restart) continues its job's run.
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    job = env.get("TORCHELASTIC_RUN_ID", "")
    return None if job in ("", "none") else job


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    rank = _int(env, "RANK")
    world_size = _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK", rank)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    node_rank = _int(env, "GROUP_RANK", _int(env, "NODE_RANK", rank // max(local_world_size, 1)))
    return LaunchEnv(
        launcher="torchrun",
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_port(env),
        store_is_external=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        run_id=env.get("TORCHELASTIC_RUN_ID", ""),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS")
        if "TORCHELASTIC_MAX_RESTARTS" in env
        else None,
        variables=_pick(env, "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
    )


def _slurm(env: Mapping[str, str]) -> LaunchEnv:
    node_rank = _int(env, "SLURM_NODEID", 0)
    local_world_size = _slurm_tasks_on_node(env, node_rank)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    master_addr = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else None)
    master_port = _port(env) or slurm_master_port(env.get("SLURM_JOB_ID", ""))
    return LaunchEnv(
        launcher="slurm",
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=_int(env, "SLURM_NTASKS"),
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        variables=_pick(
            env,
            "SLURM_PROCID",
            "SLURM_LOCALID",
            "SLURM_NTASKS",
            "SLURM_NTASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
            "SLURM_NODEID",
            "SLURM_JOB_NODELIST",
            "SLURM_JOB_ID",
        ),
    )


def _openmpi(env: Mapping[str, str]) -> LaunchEnv:
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    local_world_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    return LaunchEnv(
        launcher="openmpi",
        rank=rank,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        world_size=_int(env, "OMPI_COMM_WORLD_SIZE"),
        local_world_size=local_world_size,
        # mpirun fills nodes in blocks by default (--map-by slot).
        node_rank=rank // max(local_world_size, 1),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_port(env),
        variables=_pick(
            env,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
    )


def master_endpoint(
    environ: Mapping[str, str] | None = None,
    launch: LaunchEnv | None = None,
    *,
    detect: bool = True,
) -> MasterEndpoint:
    """Where rank 0 hosts the store: ``MASTER_ADDR``/``MASTER_PORT``, else the launcher's.

    Args:
        environ: the environment to read; ``os.environ`` by default.
        launch: the launcher already detected in ``environ``.
        detect: with no ``launch`` given, detect it (False: read only the
            ``MASTER_*`` variables, e.g. when the launcher's are malformed).

    Raises:
        ValueError: ``detect`` and a launcher's variables are malformed.
    """
    env = os.environ if environ is None else environ
    if launch is None and detect:
        launch = detect_launcher(env)
    addr, source = env.get("MASTER_ADDR") or None, "MASTER_ADDR"
    if addr is None and launch is not None and launch.master_addr:
        addr, source = launch.master_addr, launch.launcher
    port = env.get("MASTER_PORT", "").strip() or None
    if port is None and launch is not None and launch.master_port is not None:
        port = str(launch.master_port)
    return MasterEndpoint(addr, port, source if addr else "")


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """How many processes share this node, as the launcher's variables say; 1 without any.

    The detected launcher's count, else a bare ``LOCAL_WORLD_SIZE``; malformed
    variables count as none (``init_distributed`` reports them).
    """
    env = os.environ if environ is None else environ
    try:
        launch = detect_launcher(env)
    except ValueError:
        launch = None
    if launch is not None:
        return launch.local_world_size
    bare = env.get("LOCAL_WORLD_SIZE", "").strip()
    return int(bare) if bare.isdigit() and int(bare) > 0 else 1


def parse_port(text: str | int, source: str) -> int:
    """Return ``text`` as a TCP port number, 1..65535.

    Raises:
        ValueError: it is not one; the message names ``source`` and the value.
    """
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"{source}={text!r} is not a port number 1..65535")
    return port


def slurm_master_port(job_id: str) -> int:
    """A rendezvous port derived from the SLURM job id, so concurrent jobs differ.

    Every task of the job computes the same port without talking to the
    others; two jobs sharing a first node get different ports unless their ids
    are 20000 apart. Set ``MASTER_PORT`` to choose one yourself.
    """
    digits = "".join(ch for ch in job_id if ch.isdigit())
    return 15000 + (int(digits) % 20000 if digits else 0)


_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _slurm_tasks_on_node(env: Mapping[str, str], node_rank: int) -> int:
    """Tasks on node ``node_rank`` from ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``)."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return _int(env, "SLURM_NTASKS_PER_NODE", 1)
    per_node: list[int] = []
    for item in spec.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            raise ValueError(
                f"cannot parse SLURM_TASKS_PER_NODE={spec!r} (expected e.g. '4(x2),3')"
            )
        per_node += [int(match.group(1))] * int(match.group(2) or 1)
    return per_node[node_rank] if node_rank < len(per_node) else per_node[-1]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM host list without calling ``scontrol``.

    Handles ranges with zero padding, several bracket groups and suffixes:
    ``"gpu[01-04,07]"`` gives ``gpu01 gpu02 gpu03 gpu04 gpu07``;
    ``"a[1-2]-ib,b3"`` gives ``a1-ib a2-ib b3``.

    Raises:
        ValueError: unbalanced brackets or a malformed range.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, body, rest = item[:start], item[start + 1 : end], item[end + 1 :]
    tails = _expand_item(rest)
    return [prefix + value + tail for value in _expand_range(body, item) for tail in tails]


def _expand_range(body: str, item: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"malformed range {part!r} in host list item {item!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in host list item {item!r}")
        values.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return values


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {name} is required by this launcher")
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> int | None:
    raw = env.get("MASTER_PORT", "").strip()
    return parse_port(raw, "MASTER_PORT") if raw else None


def _pick(env: Mapping[str, str], *names: str) -> tuple[tuple[str, str], ...]:
    return tuple((name, env[name]) for name in names if name in env)
