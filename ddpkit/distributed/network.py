"""The NCCL and Gloo network plan: decided once, applied by ``init_distributed``, shown by doctor.

Multi-node jobs most often hang at start-up because NCCL or Gloo picked an
interface that cannot reach the other machines (a docker bridge, a second
NIC), or NCCL looked for InfiniBand that is not there. :func:`plan_network`
decides, from this machine's interfaces (``ddpkit.distributed.interfaces``) and the
environment, what ``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``,
``NCCL_IB_DISABLE``, ``NCCL_DEBUG`` and ``NCCL_DEBUG_SUBSYS`` should be,
never overriding a value the user set; :func:`configure_network` applies that
plan, and ``ddpkit doctor`` prints it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ddpkit import _graveyard
from ddpkit._docs import see
from ddpkit.distributed.interfaces import (
    IB_SYSFS,
    NetworkConfigError,
    check_socket_ifname,
    infiniband_devices,
    list_interfaces,
    parse_ifname,
    route_interface,
)
from ddpkit.distributed.interfaces import ifname_selects as _selects
from ddpkit.distributed.launchers import master_endpoint

__all__ = [
    "NCCL_DEBUG_LEVELS",
    "NetworkPlan",
    "Setting",
    "configure_network",
    "plan_network",
    "shown",
]

logger = logging.getLogger("ddpkit")

NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
_VARIABLES = (*_IFNAME_VARS, "NCCL_IB_DISABLE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS")


@dataclass(frozen=True)
class Setting:
    """One network variable in a plan.

    Attributes:
        name: the variable, e.g. ``"NCCL_SOCKET_IFNAME"``.
        value: its value once the plan is applied.
        action: ``"set"`` (the plan writes it) or ``"keep"`` (the environment's
            value stays).
        reason: why this value (``"routes to 10.0.0.1"``, ``"from the environment"``;
            for a kept value the plan would not choose, what it would set and why).
        previous: for ``"set"``: the value before (None: unset).
        wanted: for ``"keep"``: what the plan would set instead, when the kept value
            does not do what it wants (None: it does, or the plan wants nothing).
        problem: for ``"keep"``: why the environment's value cannot work
            (``"NAME='value' in the environment: ..."``), if so.
    """

    name: str
    value: str
    action: Literal["set", "keep"]
    reason: str
    previous: str | None = None
    wanted: str | None = None
    problem: str | None = None


@dataclass(frozen=True)
class NetworkPlan:
    """What :func:`configure_network` will do, and the facts it decided from.

    Attributes:
        settings: every network variable that will be set or is kept.
        master_addr: the master the interfaces were chosen for, or None.
        route: the interface the kernel uses to reach ``master_addr``, or None.
        route_error: why there is no route (an unresolvable name ...), or None.
        interfaces: this machine's interfaces and their addresses.
        ib_devices: the InfiniBand devices found in ``ib_sysfs``.
        ib_sysfs: where InfiniBand devices were looked for.
        errors: what makes the plan unusable; :meth:`apply` raises the first.
        warnings: what :meth:`apply` logs as a warning. Each error and warning
            says what to do; ``ddpkit doctor`` shows them as they are.
        backend: the backend the plan is for (None: not said); with ``"gloo"``
            :meth:`apply` sets the NCCL variables without logging them.
    """

    settings: tuple[Setting, ...]
    master_addr: str | None
    route: str | None
    route_error: str | None
    interfaces: Mapping[str, list[str]]
    ib_devices: tuple[str, ...]
    ib_sysfs: str
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    backend: str | None = None

    @property
    def changes(self) -> tuple[Setting, ...]:
        """The settings the plan writes into the environment."""
        return tuple(s for s in self.settings if s.action == "set")

    def setting(self, name: str) -> Setting | None:
        """The setting of variable ``name``, or None when the plan neither sets nor keeps it."""
        return next((s for s in self.settings if s.name == name), None)

    def apply(
        self, environ: MutableMapping[str, str] | None = None, *, log: bool = True
    ) -> dict[str, str]:
        """Write the changes into ``environ`` (``os.environ``); return them, name -> value.

        Each change is logged at INFO with ``log`` (one process per node is
        enough: its peers take the same decisions), at DEBUG otherwise; the
        NCCL variables of a Gloo plan always at DEBUG. Warnings are always logged.

        Raises:
            NetworkConfigError: the plan has an error (a kept variable that
                cannot work, no route to the master); nothing is written then.
        """
        if self.errors:
            raise NetworkConfigError(self.errors[0])
        env = os.environ if environ is None else environ
        for message in self.warnings:
            logger.warning("network: %s", message)
        changed = {}
        for s in self.settings:
            if s.action == "set":
                env[s.name] = changed[s.name] = s.value
            if s.action == "set" or s.wanted is not None:
                what = ("set " if s.action == "set" else "kept ") + shown(s.name, s.value)
                logger.log(self._level(s, log), "network: %s (%s)", what, s.reason)
        return changed

    def _level(self, setting: Setting, log: bool) -> int:
        unused = self.backend == "gloo" and setting.name.startswith("NCCL_")
        return logging.INFO if log and not unused else logging.DEBUG


def shown(name: str, value: str) -> str:
    """``NAME=value`` as a person reads it: NCCL's ``=`` (exactly) and ``^`` (all but) spelt out."""
    if value.startswith("="):
        return f"{name}='{value}' (exactly {value[1:]})"
    if value.startswith("^"):
        return f"{name}='{value}' (all but {value[1:]})"
    return f"{name}={value}"


def plan_network(
    *,
    socket_ifname: str | None = "auto",
    ib: bool | None = None,
    debug: str | None = None,
    debug_subsys: str | None = None,
    master_addr: str | None = None,
    backend: str | None = None,
    force: bool = False,
    environ: Mapping[str, str] | None = None,
    ib_sysfs: str = IB_SYSFS,
) -> NetworkPlan:
    """Decide the NCCL and Gloo network variables for this machine, changing nothing.

    Arguments as for :func:`configure_network`. Problems with what the
    environment already holds, and a master that cannot be routed to, are
    recorded in :attr:`NetworkPlan.errors` (``ddpkit doctor`` shows them;
    :meth:`NetworkPlan.apply` raises them).

    Raises:
        NetworkConfigError: an argument cannot work: an interface this machine
            lacks, NCCL's ``^`` syntax with ``backend="gloo"``, a bad ``debug``.
    """
    env = os.environ if environ is None else environ
    wanted: dict[str, tuple[str, str]] = {}  # name -> (value, reason)
    notes: list[str] = []
    if debug is not None:
        level = debug.strip().upper()
        if level not in NCCL_DEBUG_LEVELS:
            levels = ", ".join(NCCL_DEBUG_LEVELS)
            raise NetworkConfigError(
                f"debug={debug!r} is not an NCCL_DEBUG level; use one of {levels}"
            )
        wanted["NCCL_DEBUG"] = (level, "debug")
    if debug_subsys is not None:
        if not debug_subsys.strip():
            raise NetworkConfigError("debug_subsys='' is empty; pass e.g. 'INIT,NET' or None")
        wanted["NCCL_DEBUG_SUBSYS"] = (debug_subsys, "debug_subsys")

    interfaces = list_interfaces()
    master = master_addr or (_master_from(env) if socket_ifname == "auto" else None)
    route, route_error = None, None
    if socket_ifname is not None and master:
        try:
            route = route_interface(master, interfaces=interfaces)
        except NetworkConfigError as exc:
            route_error = str(exc)
    errors: list[str] = []
    if not interfaces:
        notes.append("no network interface found here: run on Linux with a network")
    if route is not None and master and _loopback_route(master, route, interfaces):
        notes.append(
            f"{master} resolves to a loopback address on this machine, so the interface that "
            f"reaches it is {route}: fine for one machine, but ranks on other machines cannot "
            "reach this one through it. Use this machine's network address (or fix the name "
            "in /etc/hosts, where Debian maps the host name to 127.0.1.1)"
        )
    if socket_ifname == "auto":
        if route is not None:
            # NCCL reads a plain value as a prefix ("eth1" would also take eth10); '='
            # means this interface only, so NCCL and Gloo use the same one. A usable
            # value of the user's that already takes this interface is not second-guessed.
            for name, value in (("NCCL_SOCKET_IFNAME", "=" + route), ("GLOO_SOCKET_IFNAME", route)):
                kept = env.get(name, "")  # '' takes no interface
                takes = _selects(kept, route, for_gloo=name[0] == "G")
                if force or not takes or _problem(name, kept, interfaces):
                    wanted[name] = (value, f"routes to {master}")
        elif route_error is not None and (force or not all(v in env for v in _IFNAME_VARS)):
            errors.append(route_error)
    elif socket_ifname is not None:
        wanted.update(_explicit_ifname(socket_ifname, interfaces, backend, env, force, notes))

    devices = tuple(infiniband_devices(ib_sysfs))
    if ib is not None:
        wanted["NCCL_IB_DISABLE"] = ("0" if ib else "1", f"ib={ib}")
    elif not devices:
        wanted["NCCL_IB_DISABLE"] = ("1", f"no InfiniBand devices in {ib_sysfs}")
    elif env.get("NCCL_IB_DISABLE", "").strip() == "1":
        notes.append(
            f"NCCL_IB_DISABLE=1 in the environment, so NCCL will not use the InfiniBand "
            f"devices in {ib_sysfs} ({', '.join(devices)}): unset it, unless that is on purpose"
        )

    settings = []
    for name in _VARIABLES:
        if name in env and not (force and name in wanted):
            value, problem = env[name], _problem(name, env[name], interfaces)
            if problem is not None:
                problem = f"{name}={value!r} in the environment: {problem}"
                (errors if name in _IFNAME_VARS else notes).append(problem)
            want, why = wanted.get(name, (value, ""))
            other = f"; ddpkit would set {shown(name, want)}: {why}" if want != value else ""
            keep = Setting(name, value, "keep", "from the environment" + other, problem=problem)
            settings.append(replace(keep, wanted=want) if other else keep)
        elif name in wanted:
            value, reason = wanted[name]
            settings.append(Setting(name, value, "set", reason, previous=env.get(name)))
    return NetworkPlan(
        backend=backend,
        settings=tuple(settings),
        master_addr=master,
        route=route,
        route_error=route_error,
        interfaces=interfaces,
        ib_devices=devices,
        ib_sysfs=ib_sysfs,
        errors=tuple(errors),
        warnings=tuple(notes),
    )


def configure_network(
    *,
    socket_ifname: str | None = "auto",
    ib: bool | None = None,
    debug: str | None = None,
    debug_subsys: str | None = None,
    master_addr: str | None = None,
    backend: str | None = None,
    force: bool = False,
    environ: MutableMapping[str, str] | None = None,
    ib_sysfs: str = IB_SYSFS,
) -> dict[str, str]:
    """Export the NCCL and Gloo network variables for this machine.

    Applies :func:`plan_network`'s plan: sets ``NCCL_SOCKET_IFNAME``,
    ``GLOO_SOCKET_IFNAME``, ``NCCL_IB_DISABLE``, ``NCCL_DEBUG`` and
    ``NCCL_DEBUG_SUBSYS``. A variable already in ``environ`` is kept unless
    ``force`` is True, and kept interface variables are checked too.
    Everything is validated before ``environ`` changes. Call it before the
    process group is created: NCCL and Gloo read these variables at init.

    Args:
        socket_ifname: ``"auto"`` picks the interface that routes to the master
            (nothing when no master address is known); a string is an NCCL
            interface list (``"eth0"``, ``"=eth0"``, ``"^docker,lo"``); None
            leaves the interface variables alone.
        ib: True enables InfiniBand, False disables it, None disables it only
            when ``ib_sysfs`` lists no device.
        debug: ``NCCL_DEBUG`` level: VERSION, WARN, INFO or TRACE (any case).
        debug_subsys: ``NCCL_DEBUG_SUBSYS``, a comma list such as ``"INIT,NET"``.
        master_addr: Master host for ``"auto"``; defaults to ``MASTER_ADDR`` in
            ``environ``, then to what the launcher says (SLURM's first node).
        backend: ``"nccl"`` or ``"gloo"``; with ``"gloo"`` an interface list Gloo
            cannot read is an error instead of a warning.
        force: Overwrite variables already set in ``environ``.
        environ: The mapping to update; defaults to ``os.environ``.
        ib_sysfs: Where InfiniBand devices are listed.

    Returns:
        The variables this call set, name -> value.

    Raises:
        NetworkConfigError: An interface is missing or written in a syntax the
            backend cannot read, the master address cannot be routed to, or
            ``debug`` is not an NCCL level.

    Example:
        >>> configure_network(master_addr="10.0.0.1", debug="warn")  # doctest: +SKIP
        {'NCCL_SOCKET_IFNAME': '=eth0', 'GLOO_SOCKET_IFNAME': 'eth0', 'NCCL_DEBUG': 'WARN'}
    """
    env = os.environ if environ is None else environ
    plan = plan_network(
        socket_ifname=socket_ifname,
        ib=ib,
        debug=debug,
        debug_subsys=debug_subsys,
        master_addr=master_addr,
        backend=backend,
        force=force,
        environ=env,
        ib_sysfs=ib_sysfs,
    )
    return plan.apply(env)


def _explicit_ifname(
    value: str,
    interfaces: Mapping[str, list[str]],
    backend: str | None,
    env: Mapping[str, str],
    force: bool,
    notes: list[str],
) -> dict[str, tuple[str, str]]:
    problem = check_socket_ifname(value, for_gloo=False, interfaces=interfaces)
    if problem:
        raise NetworkConfigError(f"socket_ifname: {problem}")
    wanted = {"NCCL_SOCKET_IFNAME": (value, "socket_ifname")}
    exclude, exact, names = parse_ifname(value)
    if "GLOO_SOCKET_IFNAME" in env and not force:
        return wanted  # the user's GLOO_SOCKET_IFNAME stays, whatever NCCL is given
    if not exclude and (exact or all(n in interfaces for n in names)):
        wanted["GLOO_SOCKET_IFNAME"] = (",".join(names), "socket_ifname")
    elif (backend or "").lower() == "gloo":
        raise NetworkConfigError(
            f"Gloo takes interface names, not NCCL's '^lo,docker' syntax (got socket_ifname="
            f"{value!r}); pass socket_ifname='eth0' (one of: {', '.join(interfaces)}). "
            + see("network-configure_network")
        )
    else:
        notes.append(
            f"GLOO_SOCKET_IFNAME left unset: Gloo takes exact interface names, not {value!r}; "
            "Gloo will pick its own interface"
        )
    return wanted


def _problem(name: str, value: str, interfaces: Mapping[str, list[str]]) -> str | None:
    if name in _IFNAME_VARS:
        return check_socket_ifname(value, for_gloo=name.startswith("GLOO"), interfaces=interfaces)
    if name == "NCCL_DEBUG" and value.strip().upper() not in NCCL_DEBUG_LEVELS:
        return f"not an NCCL debug level ({', '.join(NCCL_DEBUG_LEVELS)})"
    return None


def _loopback_route(master: str, route: str, interfaces: Mapping[str, list[str]]) -> bool:
    """A host name (not a loopback literal) that leads to a loopback interface here."""
    if master == "localhost" or not any(
        ipaddress.ip_address(a).is_loopback for a in interfaces.get(route, [])
    ):
        return False
    try:
        return not ipaddress.ip_address(master).is_loopback
    except ValueError:  # a host name
        return True


def _master_from(env: Mapping[str, str]) -> str | None:
    try:
        return master_endpoint(env).addr
    except ValueError:  # malformed launcher variables: init_distributed reports them
        return None


def __getattr__(name: str) -> Any:
    return _graveyard.moved_name(__name__, name)
