"""Preflight checks for a multi-node job: ``ddpkit doctor``.

Run on every node, before the job or while it hangs. Each check looks at one
thing that commonly stops ranks from finding each other (the launcher's
variables, the network, whether the rendezvous port answers) and says what
to change. The network lines are :func:`ddpkit.distributed.network.plan_network`'s
plan and its own verdicts, judged nowhere else: exactly what ``init_distributed``
would set on this machine, and what it would refuse or warn about. Nothing
here joins a job or sends data beyond a TCP connect to the master port.
"""

from __future__ import annotations

import errno
import logging
import os
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ddpkit._numbers import positive_seconds
from ddpkit._version import __version__
from ddpkit.distributed.interfaces import IB_SYSFS, list_interfaces
from ddpkit.distributed.launchers import LaunchEnv, detect_launcher, master_endpoint, parse_port
from ddpkit.distributed.network import NetworkPlan, Setting, plan_network, shown
from ddpkit.distributed.ports import bind_problem, is_local
from ddpkit.distributed.ports import probe_tcp as _probe_tcp  # the name tests and callers knew
from ddpkit.distributed.recorder import recorder_state

__all__ = ["Check", "Status", "exit_code", "format_report", "run_checks"]

logger = logging.getLogger("ddpkit")

Status = Literal["OK", "WARN", "FAIL", "INFO"]

_TAGS: dict[str, str] = {"OK": "[ OK ]", "WARN": "[WARN]", "FAIL": "[FAIL]", "INFO": "[INFO]"}
_PORT_FIX = (
    "start rank 0 first: it listens there once init_distributed runs; check the address and "
    "port are the same on every node; open the port in the firewall"
)


@dataclass(frozen=True)
class Check:
    """One line of the report.

    Attributes:
        name: what was checked, e.g. ``"route to master"``.
        status: ``"OK"``, ``"WARN"`` (may work, worth a look), ``"FAIL"`` (the
            job will not start or will hang) or ``"INFO"`` (facts, no verdict).
        detail: what was found, one line.
        fix: for WARN and FAIL, what to do about it, one line.
    """

    name: str
    status: Status
    detail: str
    fix: str = ""


def run_checks(
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    world_size: int | None = None,
    environ: Mapping[str, str] | None = None,
    connect_timeout: float = 3.0,
    ib_sysfs: str = IB_SYSFS,
) -> list[Check]:
    """Check this machine for what a multi-node job needs; never raises.

    Checks, in this order: versions, GPUs, launcher, the network plan
    (interfaces and InfiniBand devices, the route to the master, one line per
    variable the plan sets or keeps, then its errors and warnings not shown
    yet), the flight recorder, what the job does on a hang, and the master
    port. A check that raises becomes a FAIL line naming the exception; the
    others still run.

    Args:
        master_addr: host of rank 0's rendezvous store; defaults to
            ``MASTER_ADDR``, then to what the launcher (SLURM ...) says.
        master_port: its port; defaults to ``MASTER_PORT``, then to the launcher's.
        world_size: the number of processes the job should have; compared
            with the launcher's.
        environ: the environment to read; ``os.environ`` by default.
        connect_timeout: seconds to wait for a TCP connection to the master.
        ib_sysfs: where InfiniBand devices are listed.

    Returns:
        One :class:`Check` per line of the report, versions first.

    Raises:
        ValueError: ``connect_timeout`` is not a positive, finite number.
    """
    seconds = positive_seconds(connect_timeout)
    if seconds is None:
        raise ValueError(f"connect_timeout must be a positive number, got {connect_timeout!r}")
    connect_timeout = seconds
    env = os.environ if environ is None else environ
    try:
        launch: LaunchEnv | None = detect_launcher(env)
        launch_error: ValueError | None = None
    except ValueError as exc:
        launch, launch_error = None, exc
    found = master_endpoint(env, launch, detect=False)
    addr = master_addr or found.addr
    source = "--master-addr" if master_addr else found.source
    port: int | str | None = master_port if master_port is not None else found.port

    checks = _guard("versions", _check_versions)
    checks += _guard("GPUs", lambda: _check_gpus(env))
    checks += _guard("launcher", lambda: _check_launcher(launch, launch_error, world_size))
    plan: NetworkPlan | None = None
    try:
        plan = plan_network(master_addr=addr, environ=env, ib_sysfs=ib_sysfs)
        checks += _network_checks(plan, source)
    except Exception as exc:
        checks.append(_crashed("network plan", exc))
    checks += _guard("flight recorder", lambda: _check_recorder(env))
    checks += _guard("on a hang", lambda: _check_on_hang(env))
    interfaces = plan.interfaces if plan is not None else list_interfaces()
    checks += _guard(
        "master port", lambda: _check_port(addr, port, launch, connect_timeout, interfaces)
    )
    return checks


def format_report(checks: Sequence[Check]) -> str:
    """Render checks as aligned lines, each WARN and FAIL followed by its fix.

    Returns:
        Lines like ``[ OK ] route to master: 10.0.0.1 is reached through eth0
        (10.0.0.2)``, an indented ``fix: ...`` line under each WARN and FAIL
        that has one (a network plan's message says what to do itself), and a
        last line counting each status.
    """
    width = max((len(c.name) for c in checks), default=0) + 1
    indent = " " * (len(_TAGS["OK"]) + 1)
    lines: list[str] = []
    for c in checks:
        lines.append(f"{_TAGS[c.status]} {c.name + ':':<{width}} {c.detail}")
        if c.status in ("WARN", "FAIL") and c.fix:
            lines.append(f"{indent}fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in ("FAIL", "WARN", "OK", "INFO")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def exit_code(checks: Iterable[Check]) -> int:
    """Return 1 when any check FAILed, else 0: the exit status of ``ddpkit doctor``."""
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def _guard(name: str, check: Callable[[], Check]) -> list[Check]:
    try:
        return [check()]
    except Exception as exc:
        return [_crashed(name, exc)]


def _crashed(name: str, exc: Exception) -> Check:
    logger.debug("doctor: the %s check raised", name, exc_info=True)
    return Check(
        name,
        "FAIL",
        f"the check itself failed: {type(exc).__name__}: {exc}",
        "this is a ddpkit doctor bug; the other checks still ran, please report it",
    )


def _check_versions() -> Check:
    cuda = torch.version.cuda or "CPU build"
    nccl = "n/a"
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        found: object = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        nccl = ".".join(map(str, found)) if isinstance(found, tuple) else str(found)
    return Check(
        "versions",
        "INFO",
        f"python {platform.python_version()}, torch {torch.__version__}, CUDA {cuda}, "
        f"NCCL {nccl}, ddpkit {__version__}",
    )


def _check_gpus(env: Mapping[str, str]) -> Check:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    seen = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        build = "" if torch.version.cuda else "; this torch is a CPU build"
        return Check(
            "GPUs",
            "WARN",
            f"no CUDA GPU visible: NCCL unavailable, Gloo on CPU will be used{seen}{build}",
            "check nvidia-smi and the driver, and that CUDA_VISIBLE_DEVICES is unset or lists "
            "this node's GPUs; a CPU build of torch needs reinstalling with CUDA",
        )
    names = ", ".join(f"{i}: {torch.cuda.get_device_name(i)}" for i in range(count))
    return Check("GPUs", "OK", f"{count} visible{seen}: {names}")


def _check_launcher(
    launch: LaunchEnv | None, error: ValueError | None, world_size: int | None
) -> Check:
    if error is not None:
        return Check(
            "launcher",
            "FAIL",
            str(error),
            "fix or unset the variable the message names (set by the launcher or a job script)",
        )
    if launch is None:
        expected = "" if world_size is None else f"; --world-size {world_size} not compared"
        return Check(
            "launcher", "INFO", f"none (single process, or ranks passed as arguments){expected}"
        )
    variables = ", ".join(f"{k}={v}" for k, v in launch.variables) or "no variables"
    where = f"rank {launch.rank} of {launch.world_size}, node {launch.node_rank}"
    if launch.store_is_external:
        where += ", the launcher hosts the rendezvous store"
    if world_size is not None and world_size != launch.world_size:
        return Check(
            "launcher",
            "FAIL",
            f"--world-size {world_size}, but {launch.launcher} says world_size="
            f"{launch.world_size} ({variables})",
            "world size is the total number of processes (nodes x processes per node), the "
            "same on every node: fix --world-size or the launcher's node and task counts",
        )
    return Check("launcher", "INFO", f"{launch.launcher}: {variables} ({where})")


def _network_checks(plan: NetworkPlan, source: str) -> list[Check]:
    """The plan's facts, its route, each setting, then each message not shown yet."""
    listed = "; ".join(f"{n} {', '.join(a) or '(no address)'}" for n, a in plan.interfaces.items())
    ib = f"devices: {', '.join(plan.ib_devices) or 'none'} in {plan.ib_sysfs}"
    checks = [Check("interfaces", "INFO", listed or "none found"), _route(plan, source)]
    checks += [*map(_setting, plan.settings), Check("InfiniBand", "INFO", ib)]
    named = {s.name for s in plan.settings}  # a variable the plan leaves alone: what it is for
    checks += [Check(v, "INFO", f"unset ({why})") for v, why in _UNSET.items() if v not in named]
    seen = {c.detail for c in checks}
    checks += [Check("network", "FAIL", e) for e in plan.errors if e not in seen]
    return checks + [Check("network", "WARN", w) for w in plan.warnings if w not in seen]


_UNSET = {
    "NCCL_SOCKET_IFNAME": "init_distributed sets it to the interface that routes to the master",
    "GLOO_SOCKET_IFNAME": "init_distributed sets it to the interface that routes to the master",
    "NCCL_DEBUG": "NCCL_DEBUG=INFO prints the interfaces NCCL uses",
}


def _route(plan: NetworkPlan, source: str) -> Check:
    name = "route to master"
    if plan.route_error is not None:  # it says what to do
        return Check(name, "FAIL", plan.route_error)
    if plan.route is None:
        return Check(
            name, "WARN", "no master address given", "pass --master-addr or set MASTER_ADDR"
        )
    addrs = plan.interfaces.get(plan.route, [])
    local = f" ({addrs[0]})" if addrs else ""
    origin = "" if source == "--master-addr" else f"; the address comes from {source}"
    return Check(name, "OK", f"{plan.master_addr} is reached through {plan.route}{local}{origin}")


def _setting(s: Setting) -> Check:
    seen = f"{shown(s.name, s.value)} ({s.reason})"
    if s.action == "set":
        return Check(s.name, "INFO", f"unset; init_distributed sets {seen}")
    fix = f"unset {s.name}" + (f" or export {s.name}={s.wanted}" if s.wanted else "")
    if s.problem:
        return Check(s.name, "FAIL", s.problem, fix + ("" if s.wanted else ", or correct it"))
    if s.wanted:
        return Check(s.name, "WARN", seen, fix + ", unless yours is on purpose")
    return Check(s.name, "OK", seen)


def _check_recorder(env: Mapping[str, str]) -> Check:
    state = recorder_state(env)
    detail = f"{state['buffer']}; NCCL dump on timeout {state['nccl dump on timeout']}"
    if state["buffer"].startswith("off"):
        return Check(
            "flight recorder",
            "WARN",
            detail,
            "unset TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE: a hang report then "
            "names each rank's last collective",
        )
    return Check("flight recorder", "OK", detail)


def _check_on_hang(env: Mapping[str, str]) -> Check:
    handling = recorder_state(env)["nccl error handling"]
    detail = (
        f"NCCL: {handling}; fit(faults=FaultConfig(hang_timeout=T)): after T s without "
        "progress rank 0 writes hang-report.txt beside the checkpoints (rank, collective, "
        "line), every rank exits 124; kill -USR2 <pid> writes the report while the job runs"
    )
    if not handling.startswith("a timed-out"):
        return Check(
            "on a hang",
            "WARN",
            detail,
            "unset TORCH_NCCL_ASYNC_ERROR_HANDLING (or set it to 3) so that a timed-out "
            "collective ends its rank",
        )
    return Check("on a hang", "INFO", detail)


def _check_port(
    addr: str | None,
    port: int | str | None,
    launch: LaunchEnv | None,
    timeout: float,
    interfaces: Mapping[str, list[str]],
) -> Check:
    name = "master port"
    if not addr:
        return Check(
            name, "WARN", "no master address given", "pass --master-addr or set MASTER_ADDR"
        )
    if port is None:
        return Check(
            name,
            "WARN",
            "no master port given",
            "pass --master-port or set MASTER_PORT (the same on every node)",
        )
    try:
        number = parse_port(port, "master port")
    except ValueError:
        return Check(
            name,
            "FAIL",
            f"master port {port!r} is not a port number 1..65535",
            "set MASTER_PORT (or --master-port) to a free port such as 29500, the same on "
            "every node",
        )
    if not is_local(addr, interfaces):
        ok, detail = _probe_tcp(addr, number, timeout)
        if ok:
            return Check(name, "OK", f"{addr}:{number} accepts TCP connections")
        return Check(name, "FAIL", f"{addr}:{number}: {detail}", _PORT_FIX)

    problem = bind_problem(number)
    if problem is None:
        return Check(
            name, "OK", f"port {number} is free: rank 0 can host the rendezvous store here"
        )
    if problem != errno.EADDRINUSE:
        return Check(
            name,
            "FAIL",
            f"rank 0 cannot listen on port {number} here: {os.strerror(problem)}",
            "pick a port above 1024 that is free, the same on every node (--master-port)",
        )
    ok, detail = _probe_tcp(addr, number, timeout)
    if ok and launch is not None and launch.store_is_external:
        return Check(name, "OK", f"{launch.launcher} hosts the rendezvous store on {number}")
    if ok:
        return Check(
            name,
            "WARN",
            f"something already listens on {number} (a running job, or another program)",
            f"if it is not this job's rank 0, pick another port; `ss -ltnp 'sport = :{number}'` "
            "shows the program",
        )
    return Check(
        name,
        "FAIL",
        f"port {number} is in use on this machine, but {addr}:{number} does not accept "
        f"connections: {detail}",
        f"pick another port (the same on every node), or find the program with "
        f"`ss -tanp 'sport = :{number}'`",
    )
