"""The network plan: plan_network decides, configure_network applies, on this machine."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from net_fixtures import loopback, own_ipv4

from ddpkit import NetworkConfigError, configure_network, plan_network
from ddpkit.distributed import network
from ddpkit.distributed.network import shown

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux interfaces")


@pytest.fixture
def no_ib(tmp_path: Path) -> str:
    return str(tmp_path / "no-infiniband")


def test_configure_auto_routes_to_master(no_ib: str, caplog: pytest.LogCaptureFixture) -> None:
    env: dict[str, str] = {}
    lo = loopback()
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        out = configure_network(environ=env, master_addr="127.0.0.1", ib_sysfs=no_ib)
    assert out == {
        "NCCL_SOCKET_IFNAME": "=" + lo,
        "GLOO_SOCKET_IFNAME": lo,
        "NCCL_IB_DISABLE": "1",
    }
    assert env == out
    assert f"set NCCL_SOCKET_IFNAME='={lo}' (exactly {lo}) (routes to 127.0.0.1)" in caplog.text
    assert "==" not in caplog.text  # NCCL's exact-match syntax, spelt out


def test_configure_auto_reads_master_addr_from_environ(no_ib: str) -> None:
    env = {"MASTER_ADDR": "localhost"}
    out = configure_network(environ=env, ib_sysfs=no_ib)
    assert out["GLOO_SOCKET_IFNAME"] == loopback()


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
    lo = loopback()
    env = {"NCCL_SOCKET_IFNAME": lo, "GLOO_SOCKET_IFNAME": lo, "NCCL_IB_DISABLE": "0"}
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        out = configure_network(environ=env, master_addr="127.0.0.1", ib_sysfs=no_ib)
    assert out == {}
    assert env == {"NCCL_SOCKET_IFNAME": lo, "GLOO_SOCKET_IFNAME": lo, "NCCL_IB_DISABLE": "0"}
    assert (
        "kept NCCL_IB_DISABLE=0 (from the environment; ddpkit would set NCCL_IB_DISABLE=1: "
        f"no InfiniBand devices in {no_ib})"
    ) in caplog.text
    assert "kept NCCL_SOCKET_IFNAME" not in caplog.text  # a prefix that takes the route


def test_a_kept_interface_is_judged_by_the_interface_it_takes(no_ib: str) -> None:
    lo = loopback()
    for value, wanted in ((lo, None), ("=" + lo, None), ("^" + lo, "=" + lo)):
        env = {"NCCL_SOCKET_IFNAME": value}
        setting = plan_network(master_addr="127.0.0.1", environ=env, ib_sysfs=no_ib).setting(
            "NCCL_SOCKET_IFNAME"
        )
        assert setting is not None
        assert (setting.action, setting.wanted, setting.problem) == ("keep", wanted, None), value


def test_a_kept_value_that_cannot_work_is_judged_whatever_it_takes(no_ib: str) -> None:
    own = own_ipv4()
    if own is None:
        pytest.skip("this machine has no IPv4 address besides the loopback")
    iface, addr = own  # Gloo's '^lo' would take iface, but Gloo cannot read it
    plan = plan_network(master_addr=addr, environ={"GLOO_SOCKET_IFNAME": "^lo"}, ib_sysfs=no_ib)
    setting = plan.setting("GLOO_SOCKET_IFNAME")
    assert setting is not None
    assert setting.problem is not None
    assert setting.wanted == iface


def test_configure_force_overwrites(no_ib: str) -> None:
    lo = loopback()
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
    lo = loopback()
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
    assert loopback() in str(info.value)  # lists what exists
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
    off = plan_network(environ={"NCCL_IB_DISABLE": "1"}, socket_ifname=None, ib_sysfs=str(tmp_path))
    assert off.warnings == (
        f"NCCL_IB_DISABLE=1 in the environment, so NCCL will not use the InfiniBand devices in "
        f"{tmp_path} (mlx5_0): unset it, unless that is on purpose",
    )
    assert configure_network(environ={}, socket_ifname=None, ib=True) == {"NCCL_IB_DISABLE": "0"}
    assert configure_network(environ={}, socket_ifname=None, ib=False) == {"NCCL_IB_DISABLE": "1"}


def test_configure_debug() -> None:
    out = configure_network(
        environ={}, socket_ifname=None, ib=True, debug="warn", debug_subsys="INIT,NET"
    )
    assert out == {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_IB_DISABLE": "0"}
    with pytest.raises(NetworkConfigError, match=r"debug='verbose'.*VERSION, WARN, INFO, TRACE"):
        configure_network(environ={}, socket_ifname=None, debug="verbose")


def test_plan_changes_nothing_and_apply_writes_exactly_its_changes(no_ib: str) -> None:
    lo = loopback()
    env = {"NCCL_DEBUG": "WARN"}
    plan = plan_network(master_addr="127.0.0.1", environ=env, ib_sysfs=no_ib)
    assert env == {"NCCL_DEBUG": "WARN"}  # planning alone writes nothing
    assert plan.route == lo
    assert plan.master_addr == "127.0.0.1"
    assert {s.name: s.value for s in plan.changes} == {
        "NCCL_SOCKET_IFNAME": "=" + lo,
        "GLOO_SOCKET_IFNAME": lo,
        "NCCL_IB_DISABLE": "1",
    }
    kept = plan.setting("NCCL_DEBUG")
    assert kept is not None
    assert (kept.action, kept.value) == ("keep", "WARN")
    assert all(s.previous is None for s in plan.changes)
    assert plan.apply(env) == {s.name: s.value for s in plan.changes}
    assert env["NCCL_SOCKET_IFNAME"] == "=" + lo


def test_configure_network_applies_the_plan(no_ib: str) -> None:
    for env in ({}, {"GLOO_SOCKET_IFNAME": "lo"}, {"NCCL_IB_DISABLE": "0"}):
        planned = plan_network(master_addr="localhost", environ=dict(env), ib_sysfs=no_ib)
        applied = configure_network(master_addr="localhost", environ=dict(env), ib_sysfs=no_ib)
        assert applied == {s.name: s.value for s in planned.changes}, env


def test_plan_records_what_configure_network_refuses() -> None:
    env = {"GLOO_SOCKET_IFNAME": "nosuch9"}
    plan = plan_network(socket_ifname=None, environ=env)
    setting = plan.setting("GLOO_SOCKET_IFNAME")
    assert setting is not None
    assert setting.problem is not None
    assert "nosuch9" in setting.problem
    assert plan.errors
    with pytest.raises(NetworkConfigError, match="nosuch9"):
        plan.apply(env)
    assert env == {"GLOO_SOCKET_IFNAME": "nosuch9"}


def test_force_records_the_previous_values(no_ib: str) -> None:
    lo = loopback()
    env = {"NCCL_SOCKET_IFNAME": "^docker", "NCCL_IB_DISABLE": "0"}
    plan = plan_network(master_addr="127.0.0.1", environ=env, force=True, ib_sysfs=no_ib)
    previous = {s.name: s.previous for s in plan.changes}
    assert previous == {"NCCL_SOCKET_IFNAME": "^docker", "GLOO_SOCKET_IFNAME": None,
                        "NCCL_IB_DISABLE": "0"}  # fmt: skip
    assert plan.setting("NCCL_SOCKET_IFNAME").value == "=" + lo  # type: ignore[union-attr]


def test_master_from_a_slurm_node_list(no_ib: str) -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_ID": "7",
    }
    plan = plan_network(environ=env, ib_sysfs=no_ib)
    assert plan.master_addr == "localhost"
    assert plan.route == loopback()


def test_unroutable_master_with_both_variables_set_is_not_an_error(no_ib: str) -> None:
    lo = loopback()
    env = {"NCCL_SOCKET_IFNAME": lo, "GLOO_SOCKET_IFNAME": lo}
    plan = plan_network(master_addr="no-such-host.invalid", environ=env, ib_sysfs=no_ib)
    assert plan.route is None
    assert plan.route_error is not None
    assert not plan.errors
    assert plan.apply(dict(env)) == {"NCCL_IB_DISABLE": "1"}


def test_shown_spells_out_nccl_syntax() -> None:
    assert shown("NCCL_SOCKET_IFNAME", "=eth1") == "NCCL_SOCKET_IFNAME='=eth1' (exactly eth1)"
    assert shown("NCCL_SOCKET_IFNAME", "^docker") == "NCCL_SOCKET_IFNAME='^docker' (all but docker)"
    assert shown("GLOO_SOCKET_IFNAME", "eth1") == "GLOO_SOCKET_IFNAME=eth1"


@pytest.mark.parametrize(("backend", "log"), [("gloo", True), ("nccl", True), ("nccl", False)])
def test_apply_logs_once_per_node_and_no_nccl_for_gloo(
    no_ib: str, caplog: pytest.LogCaptureFixture, backend: str, log: bool
) -> None:
    env: dict[str, str] = {}
    plan = plan_network(master_addr="127.0.0.1", environ=env, ib_sysfs=no_ib, backend=backend)
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        changed = plan.apply(env, log=log)
    assert "NCCL_IB_DISABLE" in changed  # set all the same: a later NCCL group uses them
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    if not log:
        assert info == []
    elif backend == "gloo":
        assert info == [f"network: set GLOO_SOCKET_IFNAME={loopback()} (routes to 127.0.0.1)"]
    else:
        assert any("NCCL_IB_DISABLE=1" in line for line in info)


def test_no_interface_is_a_warning(monkeypatch: pytest.MonkeyPatch, no_ib: str) -> None:
    monkeypatch.setattr(network, "list_interfaces", dict)
    plan = plan_network(environ={}, ib_sysfs=no_ib)
    assert plan.warnings == ("no network interface found here: run on Linux with a network",)
