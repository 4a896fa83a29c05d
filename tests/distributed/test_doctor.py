"""ddpkit doctor against this machine's real sockets, interfaces and environment."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from net_fixtures import loopback

from ddpkit.cli import main
from ddpkit.distributed import network
from ddpkit.distributed.doctor import (
    Check,
    _guard,
    _probe_tcp,
    exit_code,
    format_report,
    run_checks,
)
from ddpkit.distributed.interfaces import list_interfaces
from ddpkit.distributed.network import configure_network, shown

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux interfaces")

# Everything doctor reads from the environment: tests start from none of it.
_ENV_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_DEBUG",
)

_NAMES = [
    "versions",
    "GPUs",
    "launcher",
    "interfaces",
    "route to master",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "InfiniBand",
    "NCCL_DEBUG",
    "flight recorder",
    "on a hang",
    "master port",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port held by a socket that is bound but not listening: connections are refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def no_ib(tmp_path: Path) -> str:
    return str(tmp_path / "no-infiniband")


def _check(checks: list[Check], name: str) -> Check:
    return next(c for c in checks if c.name == name)


def _line(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if f" {name}:" in line)


def test_checks_come_in_order_and_never_fail_on_a_plain_machine(free_port: int, no_ib: str) -> None:
    checks = run_checks(master_addr="127.0.0.1", master_port=free_port, environ={}, ib_sysfs=no_ib)
    assert [c.name for c in checks] == _NAMES
    assert exit_code(checks) == 0
    assert _check(checks, "versions").status == "INFO"
    assert "torch " in _check(checks, "versions").detail
    gpus = _check(checks, "GPUs")
    assert gpus.status == ("OK" if torch.cuda.is_available() else "WARN"), gpus
    assert "127.0.0.1" in _check(checks, "interfaces").detail
    route = _check(checks, "route to master")
    assert route.status == "OK"
    assert route.detail.startswith("127.0.0.1 is reached through ")
    assert all(c.fix for c in checks if c.status in ("WARN", "FAIL"))


def test_free_local_port_is_ok(free_port: int, no_ib: str) -> None:
    checks = run_checks(master_addr="localhost", master_port=free_port, environ={}, ib_sysfs=no_ib)
    port = _check(checks, "master port")
    assert port.status == "OK"
    assert port.detail == f"port {free_port} is free: rank 0 can host the rendezvous store here"


def test_listening_local_port_warns(listening_port: int, no_ib: str) -> None:
    checks = run_checks(
        master_addr="127.0.0.1", master_port=listening_port, environ={}, ib_sysfs=no_ib
    )
    port = _check(checks, "master port")
    assert port.status == "WARN"
    assert f"something already listens on {listening_port}" in port.detail


def test_local_port_held_but_not_listening_fails(closed_port: int, no_ib: str) -> None:
    checks = run_checks(
        master_addr="127.0.0.1", master_port=closed_port, environ={}, ib_sysfs=no_ib
    )
    port = _check(checks, "master port")
    assert port.status == "FAIL"
    assert "does not accept connections: Connection refused" in port.detail
    assert exit_code(checks) == 1


def test_launcher_hosted_store_on_the_port_is_ok(listening_port: int, no_ib: str) -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(listening_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    checks = run_checks(environ=env, ib_sysfs=no_ib)
    port = _check(checks, "master port")
    assert port.status == "OK"
    assert port.detail == f"torchrun hosts the rendezvous store on {listening_port}"


def test_probe_tcp_connects_to_a_listener(listening_port: int) -> None:
    assert _probe_tcp("127.0.0.1", listening_port, 3.0) == (True, "")


def test_probe_tcp_reports_refused_and_unresolvable(closed_port: int) -> None:
    assert _probe_tcp("127.0.0.1", closed_port, 3.0) == (False, "Connection refused")
    ok, detail = _probe_tcp("no-such-host.invalid", closed_port, 3.0)
    assert not ok
    assert detail.startswith("cannot resolve 'no-such-host.invalid'")


def test_master_from_environment(free_port: int, no_ib: str) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port)}
    checks = run_checks(environ=env, ib_sysfs=no_ib)
    assert "the address comes from MASTER_ADDR" in _check(checks, "route to master").detail
    assert _check(checks, "master port").status == "OK"


def test_malformed_master_port_fails(no_ib: str) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500x"}
    port = _check(run_checks(environ=env, ib_sysfs=no_ib), "master port")
    assert port.status == "FAIL"
    assert "'29500x' is not a port number" in port.detail


def test_no_master_warns_twice(no_ib: str) -> None:
    checks = run_checks(environ={}, ib_sysfs=no_ib)
    route, port = _check(checks, "route to master"), _check(checks, "master port")
    assert (route.status, route.detail) == ("WARN", "no master address given")
    assert route.fix == "pass --master-addr or set MASTER_ADDR"
    assert port.status == "WARN"
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):  # without a master: not yet chosen
        assert _check(checks, var).status == "INFO"
        assert _check(checks, var).detail == (
            "unset (init_distributed sets it to the interface that routes to the master)"
        )
    assert exit_code(checks) == 0


def test_unset_interface_variables_name_the_routed_interface(no_ib: str) -> None:
    checks = run_checks(master_addr="127.0.0.1", environ={}, ib_sysfs=no_ib)
    lo = _check(checks, "route to master").detail.split(" through ")[1].split()[0]
    assert _check(checks, "NCCL_SOCKET_IFNAME").detail == (
        f"unset; init_distributed sets NCCL_SOCKET_IFNAME='={lo}' (exactly {lo}) "
        "(routes to 127.0.0.1)"
    )
    assert _check(checks, "GLOO_SOCKET_IFNAME").detail == (
        f"unset; init_distributed sets GLOO_SOCKET_IFNAME={lo} (routes to 127.0.0.1)"
    )


def test_interface_variable_that_misses_the_route_warns(no_ib: str) -> None:
    others = [name for name in list_interfaces() if not name.startswith("lo")]
    if not others:
        pytest.skip("this machine has only a loopback interface")
    env = {"NCCL_SOCKET_IFNAME": "^lo", "GLOO_SOCKET_IFNAME": others[0]}
    checks = run_checks(master_addr="127.0.0.1", environ=env, ib_sysfs=no_ib)
    for var, wanted in (("NCCL_SOCKET_IFNAME", "=lo"), ("GLOO_SOCKET_IFNAME", "lo")):
        check = _check(checks, var)
        assert check.status == "WARN", check
        assert f"ddpkit would set {shown(var, wanted)}: routes to 127.0.0.1" in check.detail
        assert check.fix == f"unset {var} or export {var}={wanted}, unless yours is on purpose"


@pytest.mark.parametrize("nccl", ["=lo", "lo"])  # a plain name is a prefix that takes lo too
def test_interface_variable_that_selects_the_route_is_ok(nccl: str, no_ib: str) -> None:
    env = {"NCCL_SOCKET_IFNAME": nccl, "GLOO_SOCKET_IFNAME": "lo"}
    checks = run_checks(master_addr="127.0.0.1", environ=env, ib_sysfs=no_ib)
    assert _check(checks, "NCCL_SOCKET_IFNAME").status == "OK"
    assert _check(checks, "GLOO_SOCKET_IFNAME").status == "OK"


def test_missing_interface_fails(no_ib: str) -> None:
    env = {"NCCL_SOCKET_IFNAME": "nosuchif9"}
    checks = run_checks(environ=env, ib_sysfs=no_ib)
    check = _check(checks, "NCCL_SOCKET_IFNAME")
    assert check.status == "FAIL"
    assert "no interface starting with 'nosuchif9'" in check.detail
    assert check.fix == "unset NCCL_SOCKET_IFNAME, or correct it"
    assert [c.name for c in checks].count("network") == 0  # the plan's error, shown once


def test_infiniband(tmp_path: Path, no_ib: str) -> None:
    unset = _check(run_checks(environ={}, ib_sysfs=no_ib), "NCCL_IB_DISABLE")
    assert (unset.status, unset.detail) == (
        "INFO",
        f"unset; init_distributed sets NCCL_IB_DISABLE=1 (no InfiniBand devices in {no_ib})",
    )
    enabled = _check(
        run_checks(environ={"NCCL_IB_DISABLE": "0"}, ib_sysfs=no_ib), "NCCL_IB_DISABLE"
    )
    assert enabled.status == "WARN"
    assert f"ddpkit would set NCCL_IB_DISABLE=1: no InfiniBand devices in {no_ib}" in enabled.detail
    assert enabled.fix == (
        "unset NCCL_IB_DISABLE or export NCCL_IB_DISABLE=1, unless yours is on purpose"
    )
    disabled = run_checks(environ={"NCCL_IB_DISABLE": "1"}, ib_sysfs=no_ib)
    assert _check(disabled, "NCCL_IB_DISABLE").status == "OK"

    sysfs = tmp_path / "infiniband"
    (sysfs / "mlx5_0").mkdir(parents=True)
    present = run_checks(environ={}, ib_sysfs=str(sysfs))
    assert _check(present, "InfiniBand").detail == f"devices: mlx5_0 in {sysfs}"
    assert "NCCL_IB_DISABLE" not in [c.name for c in present]  # NCCL's default: use it
    unused = _check(run_checks(environ={"NCCL_IB_DISABLE": "1"}, ib_sysfs=str(sysfs)), "network")
    assert unused.status == "WARN"
    assert "NCCL will not use the InfiniBand devices" in unused.detail
    assert "unset it" in unused.detail


def test_a_master_name_that_leads_to_loopback_warns(
    monkeypatch: pytest.MonkeyPatch, no_ib: str
) -> None:
    monkeypatch.setattr(network, "route_interface", lambda addr, interfaces: loopback())
    checks = run_checks(master_addr="gpu-node-1", environ={}, ib_sysfs=no_ib)
    assert _check(checks, "route to master").status == "OK"
    warned = _check(checks, "network")
    assert warned.status == "WARN"
    assert "gpu-node-1 resolves to a loopback address on this machine" in warned.detail
    assert "Use this machine's network address" in warned.detail


def test_nccl_debug(no_ib: str) -> None:
    loud = _check(run_checks(environ={"NCCL_DEBUG": "LOUD"}, ib_sysfs=no_ib), "NCCL_DEBUG")
    assert loud.status == "FAIL"
    assert "NCCL_DEBUG='LOUD' in the environment: not an NCCL debug level" in loud.detail
    assert loud.fix == "unset NCCL_DEBUG, or correct it"
    info = _check(run_checks(environ={"NCCL_DEBUG": "info"}, ib_sysfs=no_ib), "NCCL_DEBUG")
    assert info.status == "OK"


def test_launcher_is_described(no_ib: str) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    launcher = _check(run_checks(world_size=2, environ=env, ib_sysfs=no_ib), "launcher")
    assert launcher.status == "INFO"
    assert launcher.detail.startswith("torchrun: RANK=1, LOCAL_RANK=1, WORLD_SIZE=2")
    plain = _check(run_checks(environ={}, ib_sysfs=no_ib), "launcher")
    assert plain.detail == "none (single process, or ranks passed as arguments)"


def test_malformed_launcher_variables_fail(no_ib: str) -> None:
    env = {"RANK": "zero", "WORLD_SIZE": "2"}
    launcher = _check(run_checks(environ=env, ib_sysfs=no_ib), "launcher")
    assert launcher.status == "FAIL"
    assert "RANK='zero' is not an integer" in launcher.detail


def test_a_check_that_raises_becomes_a_fail_line() -> None:
    def broken() -> Check:
        raise RuntimeError("boom")

    [check] = _guard("broken", broken)
    assert check.status == "FAIL"
    assert check.detail == "the check itself failed: RuntimeError: boom"
    assert check.fix


def test_format_report_aligns_and_adds_fixes() -> None:
    checks = [
        Check("a", "OK", "fine"),
        Check("longer name", "FAIL", "broken", "do this"),
        Check("c", "INFO", "facts", "not shown"),
    ]
    assert format_report(checks).splitlines() == [
        "[ OK ] a:           fine",
        "[FAIL] longer name: broken",
        "       fix: do this",
        "[INFO] c:           facts",
        "1 FAIL, 0 WARN, 1 OK, 1 INFO",
    ]
    assert exit_code(checks) == 1
    assert exit_code(checks[:1]) == 0


def test_cli_exit_zero_without_fail(
    listening_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["doctor", "--master-addr", "127.0.0.1", "--master-port", str(listening_port)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[ OK ] route to master:" in out
    assert _line(out, "master port").startswith("[WARN]")
    assert "[FAIL]" not in out


def test_cli_gloo_nccl_syntax_fails(
    free_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "^lo")
    code = main(["doctor", "--master-addr", "127.0.0.1", "--master-port", str(free_port)])
    out = capsys.readouterr().out
    assert code == 1
    line = _line(out, "GLOO_SOCKET_IFNAME")
    assert line.startswith("[FAIL]")
    assert "GLOO_SOCKET_IFNAME='^lo'" in line
    assert out.count("GLOO_SOCKET_IFNAME='^lo' in the environment") == 1


def test_cli_unresolvable_master_fails(free_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["doctor", "--master-addr", "no-such-host.invalid", "--master-port", str(free_port)]
    )
    out = capsys.readouterr().out
    assert code == 1
    line = _line(out, "route to master")
    assert line.startswith("[FAIL]")
    assert "cannot resolve master address 'no-such-host.invalid'" in line
    assert out.count("cannot resolve master address") == 1  # the plan's error, once
    assert _line(out, "master port").startswith("[FAIL]")


def test_cli_world_size_mismatch_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    code = main(["doctor", "--world-size", "3"])
    out = capsys.readouterr().out
    assert code == 1
    line = _line(out, "launcher")
    assert line.startswith("[FAIL]")
    assert "--world-size 3, but torchrun says world_size=2" in line


def test_console_script(free_port: int) -> None:
    script = Path(sys.executable).with_name("ddpkit")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable}")
    out = subprocess.run(
        [str(script), "doctor", "--master-addr", "127.0.0.1", "--master-port", str(free_port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert _line(out.stdout, "master port") == (
        f"[ OK ] master port:        port {free_port} is free: rank 0 can host the "
        "rendezvous store here"
    )


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"GLOO_SOCKET_IFNAME": "lo"},
        {"NCCL_IB_DISABLE": "1"},
        {"NCCL_SOCKET_IFNAME": "=lo", "GLOO_SOCKET_IFNAME": "lo"},
    ],
    ids=["nothing-set", "gloo-set", "ib-off", "both-set"],
)
def test_doctor_shows_what_configure_network_applies(
    env: dict[str, str], free_port: int, no_ib: str
) -> None:
    checks = run_checks(
        master_addr="127.0.0.1", master_port=free_port, environ=dict(env), ib_sysfs=no_ib
    )
    applied = configure_network(master_addr="127.0.0.1", environ=dict(env), ib_sysfs=no_ib)
    for name, value in applied.items():
        line = _check(checks, name).detail
        assert line.startswith(f"unset; init_distributed sets {shown(name, value)} ("), line
    for check in checks:
        if check.name not in applied:  # kept from the environment, or nothing to set
            assert "init_distributed sets" not in check.detail, check


def test_the_recorder_and_what_a_hang_does_are_reported(free_port: int, no_ib: str) -> None:
    plain = {c.name: c for c in run_checks(master_port=free_port, environ={}, ib_sysfs=no_ib)}
    assert plain["flight recorder"].status == "OK"
    assert (
        "200 collectives per process (init_distributed's default)"
        in plain["flight recorder"].detail
    )
    assert "hang-report.txt" in plain["on a hang"].detail
    env = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    off = {c.name: c for c in run_checks(master_port=free_port, environ=env, ib_sysfs=no_ib)}
    assert off["flight recorder"].status == "WARN"
    assert "TORCH_FR_BUFFER_SIZE" in off["flight recorder"].fix
    assert off["on a hang"].status == "WARN"
    assert "may wait for ever" in off["on a hang"].detail
