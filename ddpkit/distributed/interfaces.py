"""Facts about this machine's network: interfaces, their addresses, routes, InfiniBand devices.

Also the syntax of ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` values and
whether one can work here. ``ddpkit.distributed.network`` builds its plan from these
facts; nothing here changes the environment. Linux first: elsewhere (macOS)
only the interface names are known.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Mapping

from ddpkit._docs import see

__all__ = [
    "IB_SYSFS",
    "NetworkConfigError",
    "check_socket_ifname",
    "ifname_selects",
    "infiniband_devices",
    "list_interfaces",
    "parse_ifname",
    "route_interface",
]

IB_SYSFS = "/sys/class/infiniband"

_SIOCGIFADDR = 0x8915  # Linux ioctl: primary IPv4 address of an interface
_PROC_IF_INET6 = "/proc/net/if_inet6"

Interfaces = Mapping[str, list[str]]


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


def _interface_of(address: str, interfaces: Interfaces) -> str | None:
    wanted = ipaddress.ip_address(address.split("%", 1)[0])
    for name, addrs in interfaces.items():
        if any(ipaddress.ip_address(a) == wanted for a in addrs):
            return name
    return None


def route_interface(
    master_addr: str, *, port: int = 9, interfaces: Interfaces | None = None
) -> str:
    """Return the interface whose address the kernel uses to reach ``master_addr``.

    The name is resolved (IPv4 preferred) and a UDP socket is connected to it,
    which picks a route and a source address but sends nothing; the source
    address is then mapped to its interface. On the master itself this yields
    the interface holding its own address; ``localhost`` yields the loopback.

    Args:
        master_addr: Host name or IP address of the rendezvous master.
        port: Port used for the route lookup; nothing is sent to it.
        interfaces: :func:`list_interfaces` if the caller has it already.

    Returns:
        The interface name, e.g. ``"eth0"``.

    Raises:
        NetworkConfigError: The name does not resolve, no route reaches it, or
            the local address belongs to no interface.
    """
    interfaces = list_interfaces() if interfaces is None else interfaces
    fix = (
        " Check MASTER_ADDR and that the host name resolves on this machine, or pass "
        f"socket_ifname='eth0' explicitly (interfaces here: {', '.join(interfaces) or 'none'}). "
        + see("network-configure_network")
    )
    try:
        infos = socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise NetworkConfigError(
            f"cannot resolve master address {master_addr!r}: {exc}.{fix}"
        ) from exc
    family, kind, proto, _, sockaddr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.connect(sockaddr)
            local = str(sock.getsockname()[0])
    except OSError as exc:
        raise NetworkConfigError(
            f"no route from this machine to master address {master_addr!r} "
            f"({sockaddr[0]}): {exc.strerror or exc}.{fix}"
        ) from exc
    name = _interface_of(local, interfaces)
    if name is None:
        raise NetworkConfigError(
            f"the route to {master_addr!r} ({sockaddr[0]}) leaves from local address {local}, "
            f"which no interface lists as its address.{fix}"
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


def parse_ifname(value: str) -> tuple[bool, bool, list[str]]:
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
    exclude, exact, names = parse_ifname(value)
    exact = exact or for_gloo
    return any(_matches(interface, n, exact) for n in names) != exclude


def check_socket_ifname(
    value: str, *, for_gloo: bool, interfaces: Interfaces | None = None
) -> str | None:
    """Check a ``NCCL_SOCKET_IFNAME`` or ``GLOO_SOCKET_IFNAME`` value against this machine.

    NCCL reads a comma list of interface-name prefixes, all excluded when the
    list starts with ``^`` and matched exactly when it starts with ``=`` (or
    ``^=``). Gloo reads exact names only. Every name in an including list must
    match an interface here; an excluding list must leave at least one.

    Args:
        value: The variable's value.
        for_gloo: Check it as ``GLOO_SOCKET_IFNAME`` rather than ``NCCL_SOCKET_IFNAME``.
        interfaces: :func:`list_interfaces` if the caller has it already.

    Returns:
        None when the value is usable, else a one-line description of the
        problem and how to fix it.
    """
    existing = list(list_interfaces() if interfaces is None else interfaces)
    choices = f"one of: {', '.join(existing) or 'none found'}"
    exclude, exact, names = parse_ifname(value)
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
