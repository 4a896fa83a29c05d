"""spawn(), torchrun and two real hosts in network namespaces."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dist_jobs import fail_on_rank_one, loader_in_a_rank, write_description, write_environment
from net_fixtures import two_namespaces  # type: ignore[import-not-found]
from warm import warm_popen  # type: ignore[import-not-found]

import ddpkit

TESTS_DIR = Path(__file__).resolve().parents[1] / "helpers"
JOBS = str(TESTS_DIR / "dist_jobs.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _read_ranks(outdir: Path, world: int) -> list[dict[str, object]]:
    found = sorted(outdir.glob("rank*.json"))
    assert len(found) == world, f"expected {world} rank files, got {[p.name for p in found]}"
    return [json.loads(outdir.joinpath(f"rank{r}.json").read_text()) for r in range(world)]


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.mark.timeout(120)
def test_spawn_two_processes(tmp_path: Path) -> None:
    assert ddpkit.spawn(write_description, 2, args=(str(tmp_path),)) == [None, None]
    out = _read_ranks(tmp_path, 2)
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["local_rank"] for o in out] == [0, 1]
    assert all(o["world_size"] == 2 and o["local_world_size"] == 2 for o in out)
    assert all(o["sum"] == 3.0 and o["launcher"] == "spawn" for o in out)
    assert all(str(o["init_method"]).startswith("tcp://127.0.0.1:") for o in out)


@pytest.mark.timeout(120)
def test_spawn_failure_terminates_siblings_and_carries_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(ddpkit.RankFailedError) as info:
        ddpkit.spawn(fail_on_rank_one, 2)
    assert time.monotonic() - start < 60
    # The cause, not rank 0's "connection closed" that follows it:
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 of 2 failed: RuntimeError: deliberate failure")
    assert "fail_on_rank_one" in info.value.remote_traceback


def test_spawn_argument_errors() -> None:
    with pytest.raises(ValueError, match="needs init_method='tcp://<node-0 address>"):
        ddpkit.spawn(write_description, 1, nnodes=2, node_rank=0)
    with pytest.raises(ValueError, match=r"node_rank=2 must be in 0\.\.1"):
        ddpkit.spawn(write_description, 1, nnodes=2, node_rank=2, init_method="tcp://x:1")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pass nprocs=N"):
            ddpkit.spawn(write_description)


def _two_nodes(
    wrappers: list[list[str]], url: str, outdir: Path, env: dict[str, str]
) -> list[dict[str, object]]:
    """Start node 0 and node 1 (2 processes each) under their command wrappers.

    Without wrappers a node's script starts from the suite's server (``warm_popen``);
    the ranks its ``spawn`` starts are fresh interpreters either way.
    """
    nodes = [
        warm_popen([sys.executable, JOBS, "node", str(node), "2", "2", url, str(outdir)], env=env)
        if not wrapper
        else subprocess.Popen(
            [*wrapper, sys.executable, JOBS, "node", str(node), "2", "2", url, str(outdir)],
            env=env,
        )
        for node, wrapper in enumerate(wrappers)
    ]
    try:
        codes = [p.wait(timeout=150) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert codes == [0, 0]
    return _read_ranks(outdir, 4)


@pytest.mark.timeout(180)
def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    out = _two_nodes([[], []], url, tmp_path, _child_env())
    assert sorted(o["rank"] for o in out) == [0, 1, 2, 3]
    assert all(o["world_size"] == 4 and o["sum"] == 10.0 for o in out)
    assert [(o["node_rank"], o["local_rank"]) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(o["local_world_size"] == 2 for o in out)


@pytest.mark.timeout(180)
def test_torchrun_without_arguments(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        JOBS,
        "torchrun",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    out = _read_ranks(tmp_path, 2)
    assert all(o["launcher"] == "torchrun" and o["sum"] == 3.0 for o in out)
    assert [o["local_rank"] for o in out] == [0, 1]


# --- two real hosts: network namespaces joined by a veth pair ----------------


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str]]]:
    with two_namespaces() as hosts:
        yield hosts


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_two_hosts_over_veth(two_hosts: list[tuple[str, str]], tmp_path: Path) -> None:
    url = f"tcp://198.18.0.1:{29500 + os.getpid() % 1000}"
    env = _child_env()
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out = _two_nodes([["ip", "netns", "exec", ns] for ns, _ in two_hosts], url, tmp_path, env)
    assert all(o["world_size"] == 4 and o["sum"] == 10.0 for o in out)
    # configure_network(socket_ifname="auto") found each host's veth end.
    veth = [link for _, link in two_hosts]
    assert [o["GLOO_SOCKET_IFNAME"] for o in out] == [veth[0], veth[0], veth[1], veth[1]]
    assert [o["NCCL_SOCKET_IFNAME"] for o in out] == [f"={veth[0]}"] * 2 + [f"={veth[1]}"] * 2


def test_spawned_children_see_what_a_torchrun_worker_sees(tmp_path: Path) -> None:
    ddpkit.spawn(write_environment, 2, args=(str(tmp_path),))
    for rank in range(2):
        seen = json.loads((tmp_path / f"env{rank}.json").read_text())
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank)
        assert (seen["WORLD_SIZE"], seen["LOCAL_WORLD_SIZE"], seen["GROUP_RANK"]) == ("2", "2", "0")
        assert seen["init_method"] == f"tcp://127.0.0.1:{seen['MASTER_PORT']}"


@pytest.mark.timeout(180)
def test_a_plain_dataloader_in_a_spawned_rank_starts_its_workers_as_under_torchrun(
    tmp_path: Path,
) -> None:
    # A rank torchrun starts is a fresh interpreter: its workers start the platform's way
    # (fork on Linux before 3.14). A spawned rank took 'spawn', every worker a fresh
    # interpreter: seconds to the first batch instead of a fraction of one.
    ddpkit.spawn(loader_in_a_rank, 1, args=(str(tmp_path),))
    spawned = json.loads((tmp_path / "spawned0.json").read_text())
    fresh = subprocess.run(
        [sys.executable, JOBS, "first-batch", str(tmp_path), "fresh"],
        env=_child_env(),
        timeout=120,
        check=True,
    )
    assert fresh.returncode == 0
    alone = json.loads((tmp_path / "fresh.json").read_text())
    assert spawned["method"] == alone["method"]
    ratio = spawned["seconds"] / alone["seconds"]
    # 'spawn' workers: about 10x on a 2-core machine; under a loaded suite, fork measured
    # up to 3.2x (a few tenths of a second each).
    assert ratio < 5.0, (spawned, alone)
