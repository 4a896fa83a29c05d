"""TCP port facts for ``ddpkit doctor``: is an address this machine, is a port free, does it answer.

Nothing here sends data: a port is tried by binding it, a host by opening
(and closing) one TCP connection.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Mapping

__all__ = ["bind_problem", "is_local", "probe_tcp"]


def is_local(addr: str, interfaces: Mapping[str, list[str]]) -> bool:
    """Is ``addr`` (a name or an address) this machine, i.e. would rank 0 run here?"""
    if addr == "localhost":
        return True
    ours = {ipaddress.ip_address(a) for addrs in interfaces.values() for a in addrs}
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if ip.is_loopback or ip in ours:
            return True
    return False


def bind_problem(port: int) -> int | None:
    """Try to listen on ``port`` on every address as the store would; return the errno."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # The store sets SO_REUSEADDR too: a port held only by TIME_WAIT
        # connections of an earlier run is free to it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.errno or errno.EADDRINUSE
    return None


def probe_tcp(addr: str, port: int, timeout: float) -> tuple[bool, str]:
    """Open (and close) a TCP connection to ``addr:port``.

    Returns:
        ``(True, "")`` when it connected, else ``(False, why)`` with the
        error's text, e.g. ``"Connection refused"``.
    """
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True, ""
    except socket.gaierror as exc:
        return False, f"cannot resolve {addr!r}: {exc.strerror or exc}"
    except TimeoutError:
        return False, f"no answer within {timeout:g} s (a firewall drops it, or wrong address)"
    except OSError as exc:
        return False, exc.strerror or str(exc)
