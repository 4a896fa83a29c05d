"""The launcher's variables: torchrun, SLURM, Open MPI, MASTER_ADDR / MASTER_PORT."""

from __future__ import annotations

import pytest

from ddpkit.distributed.launchers import (
    MasterEndpoint,
    detect_launcher,
    expand_hostlist,
    local_world_size,
    master_endpoint,
    parse_port,
    slurm_master_port,
)


def test_plain_process_has_no_launcher() -> None:
    assert detect_launcher({}) is None
    assert detect_launcher({"PATH": "/usr/bin"}) is None
    # One SLURM task (python run inside salloc) or one MPI rank is a plain process.
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    assert detect_launcher({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}) is None


def test_torchrun() -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    got = detect_launcher(env)
    assert got is not None
    assert (got.launcher, got.rank, got.local_rank, got.world_size) == ("torchrun", 5, 1, 8)
    assert (got.local_world_size, got.node_rank) == (4, 1)
    assert (got.master_addr, got.master_port, got.store_is_external) == ("10.0.0.1", 29500, True)
    assert ("RANK", "5") in got.variables


def test_torchrun_minimal_variables_fill_in() -> None:
    got = detect_launcher({"RANK": "3", "WORLD_SIZE": "4"})
    assert got is not None
    assert (got.local_rank, got.local_world_size, got.node_rank) == (3, 4, 0)
    assert got.master_addr is None
    assert not got.store_is_external


def test_torchrun_wins_inside_slurm() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    got = detect_launcher(env)
    assert got is not None
    assert got.launcher == "torchrun"


def test_slurm_two_nodes() -> None:
    env = {
        "SLURM_PROCID": "6",
        "SLURM_LOCALID": "2",
        "SLURM_NTASKS": "8",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[01-04,07]",
        "SLURM_JOB_ID": "123456",
    }
    got = detect_launcher(env)
    assert got is not None
    assert got.launcher == "slurm"
    assert (got.rank, got.local_rank, got.world_size) == (6, 2, 8)
    assert (got.local_world_size, got.node_rank) == (4, 1)
    assert got.master_addr == "gpu01"  # the first host, parsed without scontrol
    assert got.master_port == slurm_master_port("123456") == 15000 + 123456 % 20000


def test_slurm_uneven_tasks_and_master_override() -> None:
    env = {
        "SLURM_PROCID": "8",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "9",
        "SLURM_TASKS_PER_NODE": "4(x2),1",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "a[1-3]",
        "MASTER_ADDR": "login-node",
        "MASTER_PORT": "40000",
    }
    got = detect_launcher(env)
    assert got is not None
    assert (got.local_world_size, got.node_rank) == (1, 2)
    assert (got.master_addr, got.master_port) == ("login-node", 40000)


def test_openmpi() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
    }
    got = detect_launcher(env)
    assert got is not None
    assert got.launcher == "openmpi"
    assert (got.rank, got.local_rank, got.world_size, got.local_world_size) == (5, 1, 8, 4)
    assert got.node_rank == 1
    assert (got.master_addr, got.master_port) == ("node0", 29500)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(y3)"},
            "cannot parse",
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-"}, "unbalanced"),
    ],
)
def test_malformed_variables_are_named(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        detect_launcher(env)


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("node1,node2", ["node1", "node2"]),
        ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
        (
            "rack[1-2]-n[08-10]",
            ["rack1-n08", "rack1-n09", "rack1-n10", "rack2-n08", "rack2-n09", "rack2-n10"],
        ),
        ("c[9-11]", ["c9", "c10", "c11"]),
        ("single", ["single"]),
        ("x[001,010]", ["x001", "x010"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[a-b]", "n[5-2]", "n[1-2"])
def test_expand_hostlist_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


def test_master_endpoint_prefers_master_variables() -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "gpu[03-04]",
        "SLURM_JOB_ID": "42",
    }
    found = master_endpoint(env)
    assert (found.addr, found.port, found.source) == (
        "gpu03",
        str(slurm_master_port("42")),
        "slurm",
    )
    found = master_endpoint({**env, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "23456"})
    assert (found.addr, found.port, found.source) == ("10.0.0.9", "23456", "MASTER_ADDR")
    assert master_endpoint({}) == MasterEndpoint(None, None, "")


def test_master_endpoint_without_detection_reads_only_master_variables() -> None:
    env = {"RANK": "zero", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(ValueError, match="RANK='zero'"):
        master_endpoint(env)
    assert master_endpoint(env, detect=False) == MasterEndpoint("h", "1", "MASTER_ADDR")


@pytest.mark.parametrize("bad", ["0", "65536", "-1", "http", ""])
def test_parse_port_refuses_what_is_not_a_port(bad: str) -> None:
    with pytest.raises(ValueError, match=f"MASTER_PORT='{bad}' is not a port number 1..65535"):
        parse_port(bad, "MASTER_PORT")
    assert parse_port("29500", "MASTER_PORT") == 29500


def test_malformed_master_port_of_a_launcher_is_named() -> None:
    with pytest.raises(ValueError, match="MASTER_PORT='x'"):
        detect_launcher({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "x"})


def test_local_world_size() -> None:
    assert local_world_size({}) == 1
    assert local_world_size({"LOCAL_WORLD_SIZE": "3"}) == 3
    assert local_world_size({"LOCAL_WORLD_SIZE": "0"}) == 1
    assert local_world_size({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_world_size({"RANK": "x", "WORLD_SIZE": "8"}) == 1  # malformed: none


def test_torchelastic_restart_is_read() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r1"}
    got = detect_launcher({**env, "TORCHELASTIC_RESTART_COUNT": "3"})
    assert got is not None
    assert (got.run_id, got.restart_count) == ("r1", 3)
