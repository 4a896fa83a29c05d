"""Servers that leave and join a torchrun job: its agent, its checks, who may join.

torchrun's elastic agent owns the membership (``--nnodes MIN:MAX``, the c10d
rendezvous): on any change it stops every worker and starts them again with a
new ``RANK``/``WORLD_SIZE``. A worker sees only its variables; this module
finds the agent that started it (its command line, in ``/proc``), says at
start-up what would break a join, and decides collectively whether every
server that joined may train on: one whose ranks found a problem that the
others did not (other data, other settings, another ddpkit) is refused, and
its agent is stopped with SIGTERM, the one way torch leaves the rendezvous
open for the others (an agent that exits on its own closes it for all).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from ddpkit.distributed import comm
from ddpkit.distributed.launchers import LaunchEnv, detect_launcher

__all__ = ["Agent", "JoinRefused", "elastic_warnings", "find_agent", "refuse_strangers"]

logger = logging.getLogger("ddpkit")

# How many parents up a worker's agent may be: torchrun -> worker, or torchrun -> a
# wrapper (a shell, a shim) -> worker.
_ANCESTORS = 4


class JoinRefused(RuntimeError):
    """A server joined with other data, settings or ddpkit than the run: refused, named."""


@dataclass(frozen=True)
class Agent:
    """The torchrun agent that started this worker.

    Attributes:
        pid: its process id.
        nnodes: its ``--nnodes`` as (min, max); (1, 1) when not given.
        argv: its command line.
    """

    pid: int
    nnodes: tuple[int, int]
    argv: tuple[str, ...]

    @property
    def elastic(self) -> bool:
        """Whether servers may leave and join (``--nnodes MIN:MAX`` with MIN < MAX)."""
        return self.nnodes[0] < self.nnodes[1]


def find_agent(pid: int | None = None) -> Agent | None:
    """The torchrun agent among this process's parents, or None (not torchrun, not Linux)."""
    current = os.getppid() if pid is None else pid
    for _ in range(_ANCESTORS):
        if current <= 1:
            return None
        argv = _command_line(current)
        if argv is None:
            return None
        if _is_torchrun(argv):
            return Agent(current, _nnodes(argv), tuple(argv))
        current = _parent(current)
    return None


def _command_line(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'
    return int(stat.rsplit(")", 1)[1].split()[1])


def _marks_torchrun(part: str) -> bool:
    return part in ("torch.distributed.run", "torch.distributed.launch") or (
        Path(part).name == "torchrun"
    )


def _is_torchrun(argv: list[str]) -> bool:
    return any(_marks_torchrun(part) for part in argv[:3])


def _nnodes(argv: list[str]) -> tuple[int, int]:
    """``--nnodes`` of a torchrun command line, read up to the training script."""
    start = next((i for i, part in enumerate(argv[:3]) if _marks_torchrun(part)), 0) + 1
    value = None
    for i in range(start, len(argv)):
        part = argv[i]
        if part.endswith(".py") or part in ("-m", "--module", "--no-python", "--no_python"):
            break
        if part == "--nnodes" and i + 1 < len(argv):
            value = argv[i + 1]
        elif part.startswith("--nnodes="):
            value = part.split("=", 1)[1]
    if value is None:
        return (1, 1)
    low, _, high = value.partition(":")
    try:
        return (int(low), int(high or low))
    except ValueError:
        return (1, 1)


def elastic_worlds(local_world_size: int, agent: Agent | None = None) -> list[int]:
    """Every world size this job can have as servers leave and join; [] when not elastic.

    ``local_world_size`` processes on each server, ``--nnodes MIN:MAX`` servers
    (``agent``: default, the one that started this worker).
    """
    agent = find_agent() if agent is None else agent
    if agent is None or not agent.elastic:
        return []
    low, high = agent.nnodes
    return [n * local_world_size for n in range(max(low, 1), high + 1)]


def elastic_warnings(launch: LaunchEnv | None, agent: Agent | None) -> list[str]:
    """What would break a server's join in a job whose agent is ``agent``; [] when nothing.

    torch's c10d rendezvous shares the agent's TCPStore with the workers by
    default, and a node that joins a running job then waits for a
    ``MASTER_ADDR`` the job's rank 0 never writes again (it keeps the first
    round's), so the rendezvous times out after 60 s and ends the job;
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes every round write it. A job
    without ``--rdzv-id`` is named "none", as every other such job is, so a
    worker cannot tell its own job's checkpoints from another's.
    """
    if launch is None or launch.launcher != "torchrun" or agent is None or not agent.elastic:
        return []
    low, high = agent.nnodes
    said = []
    if launch.store_is_external:
        said.append(
            f"torchrun --nnodes {low}:{high}: a server that joins this job would wait 60 s for "
            "the rendezvous and end it (torch's shared rendezvous store); start torchrun on "
            "every server with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
        )
    if launch.run_id in ("", "none"):
        said.append(
            f"torchrun --nnodes {low}:{high} without --rdzv-id: after a server joins, this "
            "server's workers cannot tell this job's checkpoints from another's and restart "
            "once more to resume them; pass --rdzv-id with the job's name on every server"
        )
    return said


def node_name(launch: LaunchEnv | None = None) -> str:
    """This process's server as messages name it: ``node <n> (<host>)``."""
    launch = launch if launch is not None else detect_launcher()
    node = launch.node_rank if launch is not None else 0
    return f"node {node} ({socket.gethostname()})"


def refuse_strangers(problem: str | None) -> str | None:
    """Agree on each rank's ``problem`` with the run; refuse the servers that alone have one.

    A collective. ``problem`` is this rank's reason it cannot train on with
    the run it resumes (None: it can). Returns None when no rank has one, and
    the first rank's (named when the ranks differ) when every server has one:
    the run's own problem, for the caller to raise on every rank. When some
    servers have one and others not, those servers joined with something the
    run does not have: each of their ranks stops its torchrun agent (so the
    agent neither restarts it nor closes the rendezvous for the others) and
    every rank raises :class:`JoinRefused` naming them; the others' agents
    start their workers again without them.

    Raises:
        JoinRefused: on every rank, when some servers are refused.
    """
    if comm.get_world_size() < 2:
        return problem
    launch = detect_launcher()
    views = comm.all_gather_object((node_name(launch), problem))
    nodes = {node for node, _ in views}
    bad = {node: p for node, p in reversed(views) if p is not None}
    if not bad:
        return None
    if len(bad) == len(nodes):
        first = next(p for _, p in views if p is not None)
        same = all(p == first for _, p in views)
        rank = next(r for r, (_, p) in enumerate(views) if p is not None)
        return first if same else f"on rank {rank}, {first}"
    mine = node_name(launch)
    refused = "; ".join(f"{node}: {why}" for node, why in sorted(bad.items()))
    if mine in bad:
        agent = find_agent()
        stopped = agent is not None and agent.elastic
        if stopped and comm.get_rank() == min(
            r for r, (node, _) in enumerate(views) if node == mine
        ):
            assert agent is not None
            os.kill(agent.pid, signal.SIGTERM)
        raise JoinRefused(
            f"this server, {mine}, is refused by the running job: {bad[mine]}. "
            + (
                "Its torchrun agent is stopped, so the other servers go on without it; "
                if stopped
                else ""
            )
            + "start it again with the job's data, settings and ddpkit version"
        )
    raise JoinRefused(
        f"refused a server that joined: {refused}. The workers stop here and torchrun starts "
        "them again without it (one of its --max-restarts), from the step they stopped at"
    )
