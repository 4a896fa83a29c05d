"""ddpkit.network against this machine's real interfaces and routing table."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from ddpkit.network import (
    NetworkConfigError,
    check_socket_ifname,
    configure_network,
    infiniband_devices,
    list_interfaces,
    route_interface,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux interfaces")


def _loopback() -> str:
    return next(name for name, addrs in list_interfaces().items() if "127.0.0.1" in addrs)


def _own_ipv4() -> tuple[str, str] | None:
    """Return (interface, address) for a non-loopback IPv4 address of this machine."""
    for name, addrs in list_interfaces().items():
        for addr in addrs:
            if "." in addr and not addr.startswith("127."):
                return name, addr
    return None


@pytest.fixture
def no_ib(tmp_path: Path) -> str:
    return str(tmp_path / "no-infiniband")


def test_list_interfaces_has_loopback() -> None:
    interfaces = list_interfaces()
    lo = _loopback()
    assert "127.0.0.1" in interfaces[lo]
    assert all("%" not in a for addrs in interfaces.values() for a in addrs)


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost"])
def test_route_interface_loopback(addr: str) -> None:
    assert route_interface(addr) == _loopback()


def test_route_interface_own_address() -> None:
    own = _own_ipv4()
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


def test_configure_auto_routes_to_master(no_ib: str, caplog: pytest.LogCaptureFixture) -> None:
    env: dict[str, str] = {}
    lo = _loopback()
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        out = configure_network(environ=env, master_addr="127.0.0.1", ib_sysfs=no_ib)
    assert out == {
        "NCCL_SOCKET_IFNAME": "=" + lo,
        "GLOO_SOCKET_IFNAME": lo,
        "NCCL_IB_DISABLE": "1",
    }
    assert env == out
    assert f"set NCCL_SOCKET_IFNAME=={lo} (routes to 127.0.0.1)" in caplog.text


def test_configure_auto_reads_master_addr_from_environ(no_ib: str) -> None:
    env = {"MASTER_ADDR": "localhost"}
    out = configure_network(environ=env, ib_sysfs=no_ib)
    assert out["GLOO_SOCKET_IFNAME"] == _loopback()


def test_configure_auto_without_master_sets_no_interface(no_ib: str) -> None:
    env: dict[str, str] = {}
    assert configure_network(environ=env, ib_sysfs=no_ib) == {"NCCL_IB_DISABLE": "1"}
    assert configure_network(environ={}, socket_ifname=None, master_addr="127.0.0.1", ib=True) == {
        "NCCL_IB_DISABLE": "0"
    }


def test_configure_auto_unroutable_master() -> None:
    env: dict[str, str] = {}
    with pytest.raises(NetworkConfigError, match=r"no-such-host\.invalid"):
        configure_network(environ=env, master_addr="no-such-host.invalid")
    assert env == {}


def test_configure_keeps_user_values(no_ib: str, caplog: pytest.LogCaptureFixture) -> None:
    lo = _loopback()
    env = {"NCCL_SOCKET_IFNAME": lo, "GLOO_SOCKET_IFNAME": lo, "NCCL_IB_DISABLE": "0"}
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        out = configure_network(environ=env, master_addr="127.0.0.1", ib_sysfs=no_ib)
    assert out == {}
    assert env == {"NCCL_SOCKET_IFNAME": lo, "GLOO_SOCKET_IFNAME": lo, "NCCL_IB_DISABLE": "0"}
    assert "kept NCCL_IB_DISABLE=0" in caplog.text


def test_configure_force_overwrites(no_ib: str) -> None:
    lo = _loopback()
    env = {"NCCL_SOCKET_IFNAME": "^docker", "GLOO_SOCKET_IFNAME": "nosuch0", "NCCL_DEBUG": "WARN"}
    out = configure_network(
        environ=env, master_addr="127.0.0.1", debug="info", force=True, ib_sysfs=no_ib
    )
    assert out == {
        "NCCL_DEBUG": "INFO",
        "NCCL_SOCKET_IFNAME": "=" + lo,
        "GLOO_SOCKET_IFNAME": lo,
        "NCCL_IB_DISABLE": "1",
    }
    assert env == out


def test_configure_explicit_names(no_ib: str) -> None:
    lo = _loopback()
    out = configure_network(environ={}, socket_ifname=lo, ib_sysfs=no_ib)
    assert out["NCCL_SOCKET_IFNAME"] == lo
    assert out["GLOO_SOCKET_IFNAME"] == lo
    out = configure_network(environ={}, socket_ifname="=" + lo, ib_sysfs=no_ib)
    assert out["NCCL_SOCKET_IFNAME"] == "=" + lo
    assert out["GLOO_SOCKET_IFNAME"] == lo


def test_configure_rejects_missing_interface() -> None:
    env: dict[str, str] = {}
    with pytest.raises(NetworkConfigError, match="nosuch0") as info:
        configure_network(environ=env, socket_ifname="nosuch0")
    assert _loopback() in str(info.value)  # lists what exists
    assert env == {}


def test_configure_exclusion_syntax(no_ib: str, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(NetworkConfigError, match="Gloo takes interface names"):
        configure_network(environ={}, socket_ifname="^lo", backend="gloo")
    env: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        out = configure_network(environ=env, socket_ifname="^docker", backend="nccl", ib=False)
    assert out == {"NCCL_SOCKET_IFNAME": "^docker", "NCCL_IB_DISABLE": "1"}
    assert "Gloo will pick its own interface" in caplog.text


def test_configure_rejects_bad_values_already_set() -> None:
    with pytest.raises(NetworkConfigError, match=r"GLOO_SOCKET_IFNAME='\^lo'"):
        configure_network(environ={"GLOO_SOCKET_IFNAME": "^lo"}, socket_ifname=None)
    with pytest.raises(NetworkConfigError, match=r"NCCL_SOCKET_IFNAME='nosuch'.*nosuch"):
        configure_network(environ={"NCCL_SOCKET_IFNAME": "nosuch"}, socket_ifname=None)


def test_configure_ib(tmp_path: Path) -> None:
    assert configure_network(environ={}, socket_ifname=None, ib_sysfs=str(tmp_path)) == {
        "NCCL_IB_DISABLE": "1"
    }
    (tmp_path / "mlx5_0").mkdir()
    assert configure_network(environ={}, socket_ifname=None, ib_sysfs=str(tmp_path)) == {}
    assert configure_network(environ={}, socket_ifname=None, ib=True) == {"NCCL_IB_DISABLE": "0"}
    assert configure_network(environ={}, socket_ifname=None, ib=False) == {"NCCL_IB_DISABLE": "1"}


def test_configure_debug() -> None:
    out = configure_network(
        environ={}, socket_ifname=None, ib=True, debug="warn", debug_subsys="INIT,NET"
    )
    assert out == {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_IB_DISABLE": "0"}
    with pytest.raises(NetworkConfigError, match=r"debug='verbose'.*VERSION, WARN, INFO, TRACE"):
        configure_network(environ={}, socket_ifname=None, debug="verbose")


def test_check_socket_ifname() -> None:
    lo = _loopback()
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
    from ddpkit.network import ifname_selects

    assert ifname_selects(value, "eth0", for_gloo=for_gloo) is selected
