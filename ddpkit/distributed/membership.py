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

import atexit
import contextlib
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from ddpkit.distributed import comm
from ddpkit.distributed.launchers import LaunchEnv, detect_launcher

__all__ = ["Agent", "JoinRefused", "elastic_warnings", "find_agent", "refuse_strangers"]

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
        if _torchrun_at(argv) is not None:
            return Agent(current, _nnodes(argv, _environ(current)), tuple(argv))
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


def _torchrun_at(argv: list[str]) -> int | None:
    """Where torchrun's own arguments start: after ``torchrun`` or ``python [-opts] -m
    torch.distributed.run``; None when ``argv`` is another program's."""
    if argv and _marks_torchrun(argv[0]):
        return 1
    for i, part in enumerate(argv[1:], 1):
        if part == "-m" and i + 1 < len(argv) and _marks_torchrun(argv[i + 1]):
            return i + 2
        if not part.startswith("-"):  # python's script: no -m torch.distributed.run before it
            return i + 1 if _marks_torchrun(part) else None
    return None


def _nnodes(argv: list[str], environ: dict[str, str] | None = None) -> tuple[int, int]:
    """``--nnodes`` of a torchrun command line (read up to the training script), else its
    environment's ``PET_NNODES`` (torchrun takes its options from ``PET_*`` variables too)."""
    start = _torchrun_at(argv) or 1
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
        value = (environ or {}).get("PET_NNODES")
    if value is None:
        return (1, 1)
    low, _, high = value.partition(":")
    try:
        return (int(low), int(high or low))
    except ValueError:
        return (1, 1)


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


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
            f"torchrun --nnodes {low}:{high} without --rdzv-id: after a server joins, the "
            "workers cannot tell this job's checkpoints from another's, and a run without "
            "--resume refuses them; pass --rdzv-id with the job's name on every server"
        )
    return said


def node_name(launch: LaunchEnv | None = None) -> str:
    """This process's server as messages name it: ``node <n> (<host>)``."""
    launch = launch if launch is not None else detect_launcher()
    node = launch.node_rank if launch is not None else 0
    return f"node {node} ({socket.gethostname()})"


_STOPPING: set[int] = set()  # the agents this process stops when it exits


def _stop(pid: int) -> None:
    """SIGTERM to the agent ``pid``: it stops its workers and exits, the rendezvous left open."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


def refuse_strangers(problem: str | None) -> str | None:
    """Agree on each rank's ``problem`` with the run; refuse the servers that alone have one.

    A collective. ``problem`` is this rank's reason it cannot train on with
    the run it resumes (None: it can). Returns None when no rank has one, else
    the first rank's (named when the ranks differ), for the caller to act on
    on every rank: the run's own problem. When some servers have one and
    others not, and each of those runs under an elastic torchrun agent
    (``--nnodes MIN:MAX``, which may go on without it), those servers joined
    with something the run does not have: every rank raises
    :class:`JoinRefused` naming them, and their ranks stop their agent when
    they exit (so that it neither starts them again nor closes the rendezvous
    for the others); the others' agents start their workers again without them. In a job of
    fixed size (``srun``, ``--nnodes 2``) nobody joined: the run's own.

    Raises:
        JoinRefused: on every rank, when some servers are refused.
    """
    if comm.get_world_size() < 2:
        return problem
    launch = detect_launcher()
    agent = find_agent()
    elastic = agent is not None and agent.elastic
    views = comm.all_gather_object((node_name(launch), problem, elastic))
    found = [(rank, p) for rank, (_, p, _) in enumerate(views) if p is not None]
    if not found:
        return None
    rank, first = found[0]
    agreed = (
        first
        if len(found) == len(views) and all(p == first for _, p in found)
        else (f"on rank {rank}, {first}")
    )
    bad = {node: p for node, p, _ in reversed(views) if p is not None}
    stoppable = all(elastic for node, _, elastic in views if node in bad)
    if len(bad) == len({node for node, _, _ in views}) or not stoppable:
        return agreed  # every server has one, or theirs cannot be told to go: the run's own
    mine = node_name(launch)
    refused = "; ".join(f"{node}: {why}" for node, why in sorted(bad.items()))
    if mine in bad:
        assert agent is not None  # stoppable
        # At exit, after the error is said: the agent's SIGTERM to its workers comes then.
        if agent.pid not in _STOPPING:
            _STOPPING.add(agent.pid)
            atexit.register(_stop, agent.pid)
        raise JoinRefused(
            f"this server, {mine}, is refused by the running job: {bad[mine]}. Its torchrun "
            "agent is stopped, so the other servers go on without it; start it again with the "
            "job's data, settings and ddpkit version"
        )
    left = (
        None
        if launch is None or launch.max_restarts is None
        else (launch.max_restarts - launch.restart_count)
    )
    then = (
        f"torchrun has no restart left (--max-restarts {launch.max_restarts}), so the job ends"
        if launch is not None and left is not None and left <= 0
        else "torchrun starts them again without it (one of its --max-restarts), from the "
        "step they stopped at"
    )
    raise JoinRefused(f"refused a server that joined: {refused}. The workers stop here and {then}")
