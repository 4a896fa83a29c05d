"""Network environment for NCCL and Gloo: which interface, InfiniBand or not, debug output.

Multi-node jobs most often hang at start-up because NCCL or Gloo picked an
interface that cannot reach the other machines (a docker bridge, a second NIC).
:func:`configure_network` asks the kernel which interface routes to
``MASTER_ADDR`` and exports ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``,
never overriding a value the user set. Linux first: elsewhere (macOS) only the
interface names are known, so ``"auto"`` asks for an explicit ``socket_ifname``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
import sys
from collections.abc import MutableMapping

__all__ = [
    "NetworkConfigError",
    "check_socket_ifname",
    "configure_network",
    "ifname_selects",
    "infiniband_devices",
    "list_interfaces",
    "route_interface",
]

logger = logging.getLogger("ddpkit")

IB_SYSFS = "/sys/class/infiniband"
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")

_SIOCGIFADDR = 0x8915  # Linux ioctl: primary IPv4 address of an interface
_PROC_IF_INET6 = "/proc/net/if_inet6"


class NetworkConfigError(ValueError):
    """A network setting (interface name, its syntax, ``NCCL_DEBUG``) cannot work."""


def _ipv4_address(name: str) -> list[str]:
    if not sys.platform.startswith("linux"):
        return []
    import fcntl  # not on Windows; imported here so the module still loads there

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            ifreq = fcntl.ioctl(
                sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
            )
        except OSError:  # EADDRNOTAVAIL: the interface has no IPv4 address
            return []
    return [socket.inet_ntoa(ifreq[20:24])]


def _ipv6_addresses() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    try:
        with open(_PROC_IF_INET6, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))
            found.setdefault(fields[5], []).append(addr)
    return found


def list_interfaces() -> dict[str, list[str]]:
    """Return every network interface with its IPv4 and IPv6 addresses.

    IPv4 is the primary address of each interface (``SIOCGIFADDR``), IPv6 comes
    from ``/proc/net/if_inet6``; addresses carry no ``%scope`` suffix. Interfaces
    without an address map to ``[]``. Outside Linux only the names are known.

    Returns:
        Interface name -> addresses, IPv4 first, in ``if_nameindex()`` order.

    Example:
        >>> "127.0.0.1" in list_interfaces()["lo"]  # doctest: +SKIP
        True
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return {}
    ipv6 = _ipv6_addresses()
    return {name: _ipv4_address(name) + ipv6.get(name, []) for name in names}


def _interface_of(address: str, interfaces: dict[str, list[str]]) -> str | None:
    wanted = ipaddress.ip_address(address.split("%", 1)[0])
    for name, addrs in interfaces.items():
        if any(ipaddress.ip_address(a) == wanted for a in addrs):
            return name
    return None


def route_interface(master_addr: str, *, port: int = 9) -> str:
    """Return the interface whose address the kernel uses to reach ``master_addr``.

    The name is resolved (IPv4 preferred) and a UDP socket is connected to it,
    which picks a route and a source address but sends nothing; the source
    address is then mapped to its interface. On the master itself this yields
    the interface holding its own address; ``localhost`` yields the loopback.

    Args:
        master_addr: Host name or IP address of the rendezvous master.
        port: Port used for the route lookup; nothing is sent to it.

    Returns:
        The interface name, e.g. ``"eth0"``.

    Raises:
        NetworkConfigError: The name does not resolve, no route reaches it, or
            the local address belongs to no interface.
    """
    interfaces = list_interfaces()
    fix = (
        "Check MASTER_ADDR and that the host name resolves on this machine, or pass "
        f"socket_ifname='eth0' explicitly (interfaces here: {', '.join(interfaces) or 'none'})."
    )
    try:
        infos = socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise NetworkConfigError(
            f"cannot resolve master address {master_addr!r}: {exc}. {fix}"
        ) from exc
    family, kind, proto, _, sockaddr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.connect(sockaddr)
            local = str(sock.getsockname()[0])
    except OSError as exc:
        raise NetworkConfigError(
            f"no route from this machine to master address {master_addr!r} "
            f"({sockaddr[0]}): {exc.strerror or exc}. {fix}"
        ) from exc
    name = _interface_of(local, interfaces)
    if name is None:
        raise NetworkConfigError(
            f"the route to {master_addr!r} ({sockaddr[0]}) leaves from local address {local}, "
            f"which no interface lists as its address. {fix}"
        )
    return name


def infiniband_devices(sysfs: str = IB_SYSFS) -> list[str]:
    """Return the InfiniBand device names (``mlx5_0`` ...) in ``sysfs``, sorted.

    Args:
        sysfs: The sysfs class directory to look in.

    Returns:
        The sorted device names; ``[]`` when the directory is missing or unreadable.
    """
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def _parse_ifname(value: str) -> tuple[bool, bool, list[str]]:
    """Split NCCL's ``[^][=]name[:port],...`` into (exclude, exact, names)."""
    exclude = value.startswith("^")
    rest = value[1:] if exclude else value
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    names = [item.split(":", 1)[0].strip() for item in rest.split(",")]
    return exclude, exact, [n for n in names if n]


def ifname_selects(value: str, interface: str, *, for_gloo: bool) -> bool:
    """Whether a ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` value picks ``interface``.

    NCCL matches name prefixes (exact names after ``=``) and excludes them
    after ``^``; Gloo matches exact names only.
    """
    exclude, exact, names = _parse_ifname(value)
    exact = exact or for_gloo
    return any(_matches(interface, n, exact) for n in names) != exclude


def check_socket_ifname(value: str, *, for_gloo: bool) -> str | None:
    """Check a ``NCCL_SOCKET_IFNAME`` or ``GLOO_SOCKET_IFNAME`` value against this machine.

    NCCL reads a comma list of interface-name prefixes, all excluded when the
    list starts with ``^`` and matched exactly when it starts with ``=`` (or
    ``^=``). Gloo reads exact names only. Every name in an including list must
    match an interface here; an excluding list must leave at least one.

    Args:
        value: The variable's value.
        for_gloo: Check it as ``GLOO_SOCKET_IFNAME`` rather than ``NCCL_SOCKET_IFNAME``.

    Returns:
        None when the value is usable, else a one-line description of the
        problem and how to fix it.
    """
    existing = list(list_interfaces())
    choices = f"one of: {', '.join(existing) or 'none found'}"
    exclude, exact, names = _parse_ifname(value)
    if not names:
        return f"{value!r} names no interface; set it to {choices}"
    if for_gloo:
        if exclude or exact:
            return (
                f"Gloo takes interface names, not NCCL's '^'/'=' syntax (got {value!r}); "
                f"set it to {choices}"
            )
        exact = True
    if exclude:
        left = [i for i in existing if not any(_matches(i, n, exact) for n in names)]
        return None if left else f"{value!r} excludes every interface here ({choices})"
    missing = [n for n in names if not any(_matches(i, n, exact) for i in existing)]
    if missing:
        kind = "named" if exact else "starting with"
        return f"no interface {kind} {', '.join(map(repr, missing))} in {value!r}; use {choices}"
    return None


def _matches(interface: str, name: str, exact: bool) -> bool:
    return interface == name if exact else interface.startswith(name)


def _socket_plan(
    socket_ifname: str | None, master: str | None, backend: str | None, gloo_kept: bool
) -> list[tuple[str, str, str]]:
    """Return the (variable, value, reason) interface settings to make."""
    if socket_ifname is None:
        return []
    if socket_ifname == "auto":
        if not master:
            logger.debug("network: no master_addr or MASTER_ADDR; leaving socket interfaces alone")
            return []
        name = route_interface(master)
        reason = f"routes to {master}"
        # NCCL reads a plain value as a prefix ("eth1" would also take eth10); '=' means this
        # interface only, so NCCL and Gloo are guaranteed to use the same one.
        return [("NCCL_SOCKET_IFNAME", "=" + name, reason), ("GLOO_SOCKET_IFNAME", name, reason)]
    problem = check_socket_ifname(socket_ifname, for_gloo=False)
    if problem:
        raise NetworkConfigError(f"socket_ifname: {problem}")
    plan = [("NCCL_SOCKET_IFNAME", socket_ifname, "socket_ifname")]
    exclude, exact, names = _parse_ifname(socket_ifname)
    existing = list_interfaces()
    if gloo_kept:
        pass  # the user's GLOO_SOCKET_IFNAME stays, whatever NCCL is given
    elif not exclude and (exact or all(n in existing for n in names)):
        plan.append(("GLOO_SOCKET_IFNAME", ",".join(names), "socket_ifname"))
    elif (backend or "").lower() == "gloo":
        raise NetworkConfigError(
            f"Gloo takes interface names, not NCCL's '^lo,docker' syntax (got socket_ifname="
            f"{socket_ifname!r}); pass socket_ifname='eth0' (one of: {', '.join(existing)})"
        )
    else:
        logger.warning(
            "network: GLOO_SOCKET_IFNAME left unset: Gloo takes exact interface names, "
            "not %r; Gloo will pick its own interface",
            socket_ifname,
        )
    return plan


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

    Sets ``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``, ``NCCL_IB_DISABLE``,
    ``NCCL_DEBUG`` and ``NCCL_DEBUG_SUBSYS``. A variable already in ``environ``
    is kept unless ``force`` is True, and kept interface variables are checked
    too. Everything is validated before ``environ`` changes. Call it before the
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
        master_addr: Master host for ``"auto"``; defaults to ``environ["MASTER_ADDR"]``.
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
    plan: list[tuple[str, str, str]] = []
    if debug is not None:
        level = debug.strip().upper()
        if level not in NCCL_DEBUG_LEVELS:
            levels = ", ".join(NCCL_DEBUG_LEVELS)
            raise NetworkConfigError(
                f"debug={debug!r} is not an NCCL_DEBUG level; use one of {levels}"
            )
        plan.append(("NCCL_DEBUG", level, "debug"))
    if debug_subsys is not None:
        if not debug_subsys.strip():
            raise NetworkConfigError("debug_subsys='' is empty; pass e.g. 'INIT,NET' or None")
        plan.append(("NCCL_DEBUG_SUBSYS", debug_subsys, "debug_subsys"))

    ifname_vars = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
    if socket_ifname == "auto" and not force and all(v in env for v in ifname_vars):
        socket_ifname = None  # both already chosen by the user: no route lookup to fail
    master = master_addr or env.get("MASTER_ADDR")
    gloo_kept = "GLOO_SOCKET_IFNAME" in env and not force
    plan += _socket_plan(socket_ifname, master, backend, gloo_kept)
    planned = {name for name, _, _ in plan}
    for var in ifname_vars:
        if var in env and not (force and var in planned):
            problem = check_socket_ifname(env[var], for_gloo=var.startswith("GLOO"))
            if problem:
                raise NetworkConfigError(f"{var}={env[var]!r} in the environment: {problem}")

    if ib is None:
        if not infiniband_devices(ib_sysfs):
            plan.append(("NCCL_IB_DISABLE", "1", f"no InfiniBand devices in {ib_sysfs}"))
    else:
        plan.append(("NCCL_IB_DISABLE", "0" if ib else "1", f"ib={ib}"))

    changed: dict[str, str] = {}
    for name, value, reason in plan:
        if name in env and not force:
            logger.info("network: kept %s=%s from the environment (not %s)", name, env[name], value)
            continue
        env[name] = value
        changed[name] = value
        logger.info("network: set %s=%s (%s)", name, value, reason)
    return changed
