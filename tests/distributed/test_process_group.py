"""init_distributed, DistInfo and shutdown, on real Gloo process groups."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_jobs import describe

import ddpkit
from ddpkit import DistInfo, RendezvousError, init_distributed
from ddpkit.testing import run_distributed

_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
)


@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process that no launcher started; network variables left to the test."""
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    ddpkit.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _join(rank: int, world_size: int, url: str, env_rank: bool) -> dict[str, object]:
    if env_rank:  # env:// reads the rank like torchrun's workers do
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        info = init_distributed(url)
    else:
        info = init_distributed(url, world_size=world_size, rank=rank)
    try:
        return describe(info)
    finally:
        ddpkit.shutdown()


@pytest.mark.parametrize("scheme", ["env", "tcp", "file"])
def test_two_processes_per_init_method(scheme: str, tmp_path: os.PathLike[str]) -> None:
    port = _free_port()
    url = {
        "env": "env://",
        "tcp": f"tcp://127.0.0.1:{port}",
        "file": f"file://{tmp_path}/rendezvous",
    }[scheme]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if scheme == "env" else {}
    out = run_distributed(_join, 2, args=(url, scheme == "env"), init=None, env=env, timeout=120)
    for rank, seen in enumerate(out):
        assert seen["sum"] == 3.0  # 1 + 2: a real all_reduce over both ranks
        assert (seen["rank"], seen["dist_rank"]) == (rank, rank)
        assert seen["world_size"] == seen["dist_world"] == 2
        assert seen["local_rank"] == rank
        # both processes are on this host: the rendezvous works that out itself
        assert seen["local_world_size"] == 2
        assert seen["node_rank"] == 0
        assert seen["device"] == "cpu"
        assert seen["backend"] == "gloo"
        assert seen["is_distributed"] is True
        assert seen["is_main"] is (rank == 0)
        assert seen["launcher"] == ("torchrun" if scheme == "env" else "explicit")
        if scheme != "file":
            assert seen["init_method"] == f"tcp://127.0.0.1:{port}"
            assert seen["GLOO_SOCKET_IFNAME"] == "lo"  # routes to 127.0.0.1


def test_single_process_without_launcher(plain_env: None) -> None:
    info = init_distributed()
    assert info == DistInfo(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        device=torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"),
        backend=None,
        is_distributed=False,
    )
    assert info.is_main
    assert not dist.is_initialized()


def test_world_size_without_rendezvous_is_explained(plain_env: None) -> None:
    with pytest.raises(ValueError, match="needs a rendezvous: pass init_method='tcp://"):
        init_distributed(world_size=2, rank=0)


def test_nccl_without_cuda_is_a_value_error(plain_env: None) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
        init_distributed(backend="nccl")
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
        init_distributed(f"tcp://127.0.0.1:{_free_port()}", "nccl", world_size=1, rank=0)


def test_context_manager_destroys_the_group(plain_env: None, tmp_path: os.PathLike[str]) -> None:
    url = f"file://{tmp_path}/rendezvous"
    with init_distributed(url, world_size=1, rank=0, network=None) as info:
        assert dist.is_initialized()
        assert info.is_distributed
        assert info.launcher == "explicit"
    assert not dist.is_initialized()
    ddpkit.shutdown()  # a second call is harmless


def _init_twice(rank: int, world_size: int) -> tuple[int, int, str]:
    # run_distributed already created the group: init_distributed describes it.
    with pytest.warns(RuntimeWarning, match="process group already exists"):
        info = init_distributed()
    return info.rank, info.world_size, info.launcher


def test_already_initialised_returns_existing_info() -> None:
    assert run_distributed(_init_twice, 2, timeout=60) == [(0, 2, "existing"), (1, 2, "existing")]


def _join_expecting_error(
    rank: int, world_size: int, url: str, job_world: int, job_rank: int | None, rdzv_s: float
) -> tuple[str, float]:
    start = time.monotonic()
    try:
        init_distributed(
            url,
            world_size=job_world,
            rank=rank if job_rank is None else job_rank,
            rendezvous_timeout=timedelta(seconds=rdzv_s),
        )
    except RendezvousError as exc:
        return str(exc), time.monotonic() - start
    ddpkit.shutdown()
    return "joined without error", time.monotonic() - start


def test_wrong_world_size_names_the_missing_rank() -> None:
    # The seed's hang: world_size=3, but only two processes were started.
    rdzv = 4.0
    url = f"tcp://127.0.0.1:{_free_port()}"
    out = run_distributed(
        _join_expecting_error, 2, args=(url, 3, None, rdzv), init=None, timeout=90
    )
    for message, elapsed in out:
        assert "2 of 3 ranks joined (ranks 0, 1); missing rank(s) 2" in message
        assert url in message
        assert "world_size=3 is not the same on every node" in message
        assert elapsed < rdzv + 10


def test_wrong_world_size_on_file_store(tmp_path: os.PathLike[str]) -> None:
    url = f"file://{tmp_path}/rendezvous"
    out = run_distributed(_join_expecting_error, 2, args=(url, 3, None, 3.0), init=None, timeout=90)
    for message, _ in out:
        assert "missing rank(s) 2" in message


def _join_with_rank_list(
    rank: int, world_size: int, url: str, ranks: list[int], worlds: list[int]
) -> str:
    message, _ = _join_expecting_error(rank, world_size, url, worlds[rank], ranks[rank], 10.0)
    return message


def test_duplicated_rank_is_named() -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    # Three processes, world size 3, but two of them were told --rank 1.
    out = run_distributed(
        _join_with_rank_list, 3, args=(url, [0, 1, 1], [3, 3, 3]), init=None, timeout=90
    )
    assert all("rank 1 joined" in m and "twice" in m for m in out), out


def test_nodes_disagreeing_on_world_size_are_named() -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    out = run_distributed(
        _join_with_rank_list, 2, args=(url, [0, 1], [2, 3]), init=None, timeout=90
    )
    for message in out:
        assert "rank 1 (host" in message
        assert "was started with world_size=3" in message
        assert "rank 0 has world_size=2" in message


def test_port_in_use_is_named(plain_env: None) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RendezvousError) as info:
            init_distributed(
                f"tcp://127.0.0.1:{port}",
                world_size=2,
                rank=0,
                rendezvous_timeout=timedelta(seconds=5),
            )
    message = str(info.value)
    assert f"port {port} is already in use" in message
    suggested = int(message.split("e.g. tcp://127.0.0.1:")[1].split(" ")[0])
    assert suggested != port
    with socket.socket() as probe:  # the suggestion really is free
        probe.bind(("127.0.0.1", suggested))


def test_unreachable_master_is_explained(plain_env: None) -> None:
    port = _free_port()  # nobody listens there
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="could not reach the rendezvous store") as info:
        init_distributed(
            f"tcp://127.0.0.1:{port}",
            world_size=2,
            rank=1,
            rendezvous_timeout=timedelta(seconds=3),
        )
    assert time.monotonic() - start < 3 + 10
    assert "rank 0 is not running" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_method": "tcp://127.0.0.1", "world_size": 2, "rank": 0}, "needs a host and a port"),
        ({"init_method": "udp://x:1", "world_size": 2, "rank": 0}, "is not supported"),
        ({"init_method": "tcp://127.0.0.1:1", "world_size": 2, "rank": 2}, "outside 0..1"),
        ({"init_method": "tcp://127.0.0.1:1"}, "needs world_size= and rank="),
        ({"init_method": "env://", "world_size": 2, "rank": 0}, "needs MASTER_ADDR"),
    ],
)
def test_bad_arguments(plain_env: None, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        init_distributed(**kwargs)  # type: ignore[arg-type]


def test_explicit_rank_contradicting_launcher(
    plain_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"world_size=3\) disagrees with torchrun"):
        init_distributed("tcp://127.0.0.1:1", world_size=3)


def _slurm_job(rank: int, world_size: int, port: int) -> dict[str, object]:
    # What srun exports for task `rank` of a 2-task step on one node.
    os.environ.update(
        {
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_TASKS_PER_NODE": "2",
            "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": "4242",
            "MASTER_PORT": str(port),
        }
    )
    with init_distributed() as info:
        return describe(info)


def test_slurm_variables_start_a_real_job() -> None:
    out = run_distributed(_slurm_job, 2, args=(_free_port(),), init=None, timeout=120)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["launcher"] == "slurm" and o["sum"] == 3.0 for o in out)
    assert all(str(o["init_method"]).startswith("tcp://localhost:") for o in out)


def _openmpi_job(rank: int, world_size: int, port: int) -> dict[str, object]:
    os.environ.update(
        {
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    with init_distributed() as info:
        return describe(info)


def test_openmpi_variables_start_a_real_job() -> None:
    out = run_distributed(_openmpi_job, 2, args=(_free_port(),), init=None, timeout=120)
    assert [(o["rank"], o["local_rank"], o["launcher"]) for o in out] == [
        (0, 0, "openmpi"),
        (1, 1, "openmpi"),
    ]


def _fail_inside_with(rank: int, world_size: int, url: str) -> tuple[str, float]:
    try:
        with init_distributed(url, world_size=2, rank=rank) as _:
            if rank == 1:
                raise RuntimeError("rank 1 gives up")
            start = time.monotonic()
            try:
                dist.barrier()  # rank 1 never arrives
            except RuntimeError:
                return "barrier failed", time.monotonic() - start
            return "barrier passed", time.monotonic() - start
    except RuntimeError as exc:
        return str(exc), 0.0


def test_a_failing_rank_does_not_leave_the_others_waiting() -> None:
    # The collective timeout is 30 minutes; leaving the `with` block destroys
    # rank 1's group, so rank 0's barrier fails at once instead.
    url = f"tcp://127.0.0.1:{_free_port()}"
    (outcome0, waited), (outcome1, _) = run_distributed(
        _fail_inside_with, 2, args=(url,), init=None, timeout=120
    )
    assert outcome1 == "rank 1 gives up"
    assert outcome0 == "barrier failed"
    assert waited < 30


def _environment_around_a_job(rank: int, world_size: int, url: str) -> dict[str, object]:
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"):
        os.environ.pop(name, None)  # as on a machine where nobody set them
    before = dict(os.environ)
    info = init_distributed(url, world_size=world_size, rank=rank)
    during = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    gloo = os.environ.get("GLOO_SOCKET_IFNAME")
    local = ddpkit.get_local_rank()
    ddpkit.shutdown(info)
    return {
        "during": during,
        "gloo": gloo,
        "set": sorted(name for name, _ in info.environ_before),
        "restored": dict(os.environ) == before,
        "local_rank": info.local_rank,
        "get_local_rank": local,
    }


def test_init_writes_no_rank_and_puts_back_what_it_set() -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    out = run_distributed(_environment_around_a_job, 2, args=(url,), init=None, timeout=120)
    for rank, seen in enumerate(out):
        # Where the process sits travels in DistInfo, not through the environment.
        assert seen["during"] == {"RANK": None, "LOCAL_RANK": None, "WORLD_SIZE": None}
        assert seen["local_rank"] == rank
        assert seen["get_local_rank"] == 0  # no launcher set one; DistInfo knows better
        assert seen["gloo"] == "lo"
        assert {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} <= set(seen["set"])  # type: ignore[arg-type]
        assert seen["restored"] is True


def test_a_failed_join_puts_the_environment_back(plain_env: None) -> None:
    before = dict(os.environ)
    with pytest.raises(RendezvousError):
        init_distributed(
            f"tcp://127.0.0.1:{_free_port()}",
            world_size=2,
            rank=1,
            rendezvous_timeout=timedelta(seconds=1),
        )
    assert dict(os.environ) == before


def _collectives_of_init(rank: int, world_size: int, url: str) -> list[str]:
    from ddpkit.distributed.recorder import local_history

    init_distributed(url, world_size=world_size, rank=rank)
    try:
        trace = local_history("gloo") or {}
        return [entry["profiling_name"] for entry in trace.get("entries", [])]
    finally:
        ddpkit.shutdown()


def test_init_returns_once_every_pair_is_connected(tmp_path: os.PathLike[str]) -> None:
    # Creating a Gloo group is no synchronisation point; init's barrier is, so a rank
    # that ends before any collective cannot close a connection a peer still makes.
    url = f"file://{tmp_path}/rendezvous"
    out = run_distributed(_collectives_of_init, 2, args=(url,), init=None, timeout=120)
    assert out == [["gloo:barrier"], ["gloo:barrier"]]


_LEAVES = """
import atexit, os, sys
import torch.distributed as dist
import ddpkit

where, how = sys.argv[1], sys.argv[2]
# Registered first, so it runs last: after ddpkit's own exit hook.
atexit.register(lambda: open(where, "w").write(str(dist.is_initialized())))
info = ddpkit.init_distributed("file://" + where + ".rdzv", world_size=1, rank=0)
assert dist.is_initialized()
dist.all_reduce(__import__("torch").ones(1))
if how == "exit":
    sys.exit(3)
"""


@pytest.mark.parametrize(("how", "status"), [("return", 0), ("exit", 3)])
def test_a_process_leaving_without_the_with_block_takes_its_group_down(
    how: str, status: int, tmp_path: Path, plain_env: None
) -> None:
    import subprocess
    import sys

    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    where = tmp_path / "initialized-at-exit"
    done = subprocess.run([sys.executable, str(script), str(where), how], timeout=120,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == status, done.stderr  # its own status, not a SIGABRT
    assert where.read_text() == "False", done.stderr
