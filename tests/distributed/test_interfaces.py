"""ddpkit.distributed.interfaces against this machine's real interfaces and routing table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from net_fixtures import loopback, own_ipv4

from ddpkit.distributed.interfaces import (
    NetworkConfigError,
    check_socket_ifname,
    ifname_selects,
    infiniband_devices,
    list_interfaces,
    route_interface,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux interfaces")


def test_list_interfaces_hasloopback() -> None:
    interfaces = list_interfaces()
    lo = loopback()
    assert "127.0.0.1" in interfaces[lo]
    assert all("%" not in a for addrs in interfaces.values() for a in addrs)


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost"])
def test_route_interface_loopback(addr: str) -> None:
    assert route_interface(addr) == loopback()


def test_route_interface_own_address() -> None:
    own = own_ipv4()
    if own is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    name, addr = own
    assert route_interface(addr) == name


def test_route_interface_unresolvable() -> None:
    with pytest.raises(NetworkConfigError, match=r"no-such-host\.invalid.*MASTER_ADDR"):
        route_interface("no-such-host.invalid")


def test_infiniband_devices(tmp_path: Path) -> None:
    assert infiniband_devices(str(tmp_path / "missing")) == []
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert infiniband_devices(str(tmp_path)) == ["mlx5_0", "mlx5_1"]


def test_check_socket_ifname() -> None:
    lo = loopback()
    for value in (lo, "=" + lo, lo[:1], "^docker", "^=docker0", f"{lo},{lo}"):
        assert check_socket_ifname(value, for_gloo=False) is None, value
    assert check_socket_ifname(lo, for_gloo=True) is None
    assert check_socket_ifname(f"{lo},{lo}", for_gloo=True) is None

    problem = check_socket_ifname("nosuch0", for_gloo=False)
    assert problem is not None
    assert "nosuch0" in problem
    assert lo in problem
    everything = "^=" + ",".join(list_interfaces())
    assert "excludes every interface" in (check_socket_ifname(everything, for_gloo=False) or "")
    assert "Gloo takes interface names" in (check_socket_ifname("^lo", for_gloo=True) or "")
    assert "Gloo takes interface names" in (check_socket_ifname("=" + lo, for_gloo=True) or "")
    assert check_socket_ifname(lo[:1] + "#", for_gloo=True) is not None  # a prefix is not a name
    assert check_socket_ifname("", for_gloo=False) is not None


@pytest.mark.parametrize(
    ("value", "for_gloo", "selected"),
    [
        ("eth", False, True),  # NCCL: a prefix
        ("eth", True, False),  # Gloo: exact names only
        ("=eth0", False, True),
        ("=eth", False, False),
        ("^docker,lo", False, True),
        ("^eth", False, False),
        ("lo,eth0", True, True),
    ],
)
def test_ifname_selects(value: str, for_gloo: bool, selected: bool) -> None:
    assert ifname_selects(value, "eth0", for_gloo=for_gloo) is selected
