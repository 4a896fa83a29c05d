"""This machine's loopback and an own address, and two hosts in network namespaces."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

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


def _netns_usable() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs `ip` from iproute2 (.ci/run installs it)"
    probe = f"ddpk-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextlib.contextmanager
def two_namespaces() -> Iterator[list[tuple[str, str]]]:
    """Two hosts: namespaces with 198.18.0.1 and 198.18.0.2 on one veth link, removed after.

    Yields each one's (namespace, link); skips the test where they cannot be made.
    """
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    ns = (f"ddpk-{tag}-a", f"ddpk-{tag}-b")
    links = (f"dk{tag}a", f"dk{tag}b")  # interface names are at most 15 characters

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for name in ns:
            ip("netns", "add", name)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, addr in zip(ns, links, ("198.18.0.1/24", "198.18.0.2/24"), strict=True):
            ip("link", "set", link, "netns", name)
            ip("-n", name, "addr", "add", addr, "dev", link)
            ip("-n", name, "link", "set", link, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield list(zip(ns, links, strict=True))
    finally:
        for name in ns:  # deleting a namespace deletes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
