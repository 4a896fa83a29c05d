"""ddpkit.distributed.ports: is an address this machine, is a port free, does it answer."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

import pytest

from ddpkit.distributed.ports import bind_problem, is_local, probe_tcp


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_loopback_and_own_addresses_are_local() -> None:
    assert is_local("localhost", {})
    assert is_local("127.0.0.1", {})
    assert is_local("::1", {})
    assert is_local("192.0.2.7", {"eth0": ["192.0.2.7"], "lo": ["127.0.0.1"]})


def test_other_and_unresolvable_addresses_are_not_local() -> None:
    assert not is_local("192.0.2.7", {"eth0": ["192.0.2.8"]})
    assert not is_local("no-such-host.invalid", {"eth0": ["192.0.2.8"]})
    assert not is_local("a" * 300, {})  # a name too long to encode is not this machine


def test_a_free_port_binds_and_a_listening_one_does_not(listening: int) -> None:
    assert bind_problem(_closed_port()) is None
    assert bind_problem(listening) == errno.EADDRINUSE


def test_a_port_left_in_time_wait_is_free_to_bind() -> None:
    # A closed connection of an earlier run leaves the port in TIME_WAIT: the store can bind it.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        accepted, _ = sock.accept()
        accepted.close()  # the server side closes first: its end goes to TIME_WAIT
        client.close()
    assert bind_problem(port) is None


def test_probe_connects_to_a_listener(listening: int) -> None:
    assert probe_tcp("127.0.0.1", listening, timeout=5) == (True, "")


def test_probe_of_a_closed_port_says_refused() -> None:
    ok, why = probe_tcp("127.0.0.1", _closed_port(), timeout=5)
    assert not ok
    assert "refused" in why.lower()


def test_probe_of_an_unresolvable_name_says_so() -> None:
    ok, why = probe_tcp("no-such-host.invalid", 29500, timeout=2)
    assert not ok
    assert why.startswith("cannot resolve 'no-such-host.invalid'")
