"""This machine's loopback and an own address, for the network tests."""

from __future__ import annotations

from ddpkit.distributed.interfaces import list_interfaces


def loopback() -> str:
    return next(name for name, addrs in list_interfaces().items() if "127.0.0.1" in addrs)


def own_ipv4() -> tuple[str, str] | None:
    """Return (interface, address) for a non-loopback IPv4 address of this machine."""
    for name, addrs in list_interfaces().items():
        for addr in addrs:
            if "." in addr and not addr.startswith("127."):
                return name, addr
    return None
