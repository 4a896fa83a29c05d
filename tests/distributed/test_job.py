"""resolve_job and DistInfo: where a process sits, from arguments and the launcher's view."""

from __future__ import annotations

import os

import pytest
import torch

from ddpkit import DistInfo
from ddpkit.distributed.job import resolve_job, restore_environ
from ddpkit.distributed.launchers import LaunchEnv, MasterEndpoint, detect_launcher, master_endpoint


def _torchrun(rank: int = 1, world: int = 4, **extra: str) -> LaunchEnv:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % 2)}
    env.update({"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2), **extra})
    launch = detect_launcher(env)
    assert launch is not None
    return launch


def test_no_launcher_and_no_init_method_is_a_single_process() -> None:
    assert resolve_job(None) is None
    assert resolve_job(None, world_size=1, rank=0) is None


def test_explicit_tcp() -> None:
    plan = resolve_job("tcp://10.0.0.1:23456", world_size=3, rank=2)
    assert plan is not None
    assert (plan.rank, plan.world_size, plan.launcher) == (2, 3, "explicit")
    assert (plan.scheme, plan.url) == ("tcp", "tcp://10.0.0.1:23456")
    assert (plan.master_addr, plan.master_port) == ("10.0.0.1", 23456)
    # Only the rendezvous can tell which ranks share a host.
    assert (plan.local_rank, plan.local_world_size, plan.node_rank) == (None, None, None)
    assert not plan.store_is_external


def test_file_init_method() -> None:
    plan = resolve_job("file:///shared/rdzv", world_size=2, rank=0, local_rank=0)
    assert plan is not None
    assert (plan.scheme, plan.file_path, plan.local_rank) == ("file", "/shared/rdzv", 0)


def test_launcher_fills_in_and_env_meets_at_its_endpoint() -> None:
    launch = _torchrun(3, MASTER_ADDR="node0", MASTER_PORT="29500")
    endpoint = master_endpoint({"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}, launch)
    plan = resolve_job(None, launch=launch, endpoint=endpoint)
    assert plan is not None
    assert (plan.rank, plan.world_size, plan.local_rank) == (3, 4, 1)
    assert (plan.local_world_size, plan.node_rank, plan.launcher) == (2, 1, "torchrun")
    assert plan.url == "tcp://node0:29500"


def test_agent_store_keys_each_restart_apart() -> None:
    variables = {
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    launch = _torchrun(0, **variables)
    endpoint = master_endpoint(variables, launch)
    plan = resolve_job(None, launch=launch, endpoint=endpoint)
    assert plan is not None
    assert plan.store_is_external
    assert plan.store_prefix == "ddpkit/rdzv/job7/2"
    assert plan.restart_count == 2  # what join_job puts in DistInfo.restart_count


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_method": "tcp://h"}, "needs world_size= and rank="),
        ({"init_method": "tcp://h", "world_size": 2, "rank": 0}, "needs a host and a port"),
        ({"init_method": "tcp://h:0", "world_size": 2, "rank": 0}, "needs a host and a port"),
        ({"init_method": "tcp://h:99999", "world_size": 2, "rank": 0}, "needs a host and a port"),
        ({"init_method": "tcp://h:1", "world_size": 2, "rank": 2}, r"outside 0\.\.1"),
        ({"init_method": "tcp://h:1", "world_size": 2, "rank": -1}, r"outside 0\.\.1"),
        ({"init_method": "tcp://h:1", "world_size": 0, "rank": 0}, r"outside 0\.\.-1"),
        ({"init_method": "tcp://h:1", "world_size": 2, "rank": 0, "local_rank": -1}, ">= 0"),
        ({"init_method": "udp://h:1", "world_size": 2, "rank": 0}, "is not supported"),
        ({"init_method": "file://", "world_size": 2, "rank": 0}, "needs a path"),
        ({"init_method": "env://", "world_size": 2, "rank": 0}, "needs MASTER_ADDR"),
        ({"world_size": 2, "rank": 1}, "needs a rendezvous"),
    ],
)
def test_bad_jobs_are_explained(kwargs: dict[str, object], match: str) -> None:
    init_method = kwargs.pop("init_method", None)
    with pytest.raises(ValueError, match=match):
        resolve_job(init_method, **kwargs)  # type: ignore[arg-type]


def test_bad_master_port_is_named() -> None:
    endpoint = MasterEndpoint("h", "29500x", "MASTER_ADDR")
    with pytest.raises(ValueError, match="MASTER_PORT='29500x' is not a port number"):
        resolve_job("env://", world_size=2, rank=0, endpoint=endpoint)


def test_arguments_that_contradict_the_launcher_are_refused() -> None:
    with pytest.raises(ValueError, match=r"rank=0\) disagrees with torchrun, which says rank=1"):
        resolve_job(None, rank=0, launch=_torchrun(1))
    # Agreeing arguments are fine.
    plan = resolve_job(
        "tcp://h:1",
        rank=1,
        world_size=4,
        launch=_torchrun(1),
        endpoint=MasterEndpoint(None, None, ""),
    )
    assert plan is not None
    assert plan.rank == 1


def test_dist_info_puts_back_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPKIT_TEST_KEPT", "before")
    monkeypatch.delenv("DDPKIT_TEST_NEW", raising=False)
    before = (("DDPKIT_TEST_KEPT", "before"), ("DDPKIT_TEST_NEW", None))
    os.environ["DDPKIT_TEST_KEPT"] = "changed"
    os.environ["DDPKIT_TEST_NEW"] = "added"
    info = DistInfo(0, 0, 1, 1, 0, torch.device("cpu"), None, False, environ_before=before)
    # The record of the environment is not part of what a DistInfo equals.
    assert info == DistInfo(0, 0, 1, 1, 0, torch.device("cpu"), None, False)
    with info:
        pass
    assert os.environ["DDPKIT_TEST_KEPT"] == "before"
    assert "DDPKIT_TEST_NEW" not in os.environ
    restore_environ(before)  # twice is harmless
    assert os.environ["DDPKIT_TEST_KEPT"] == "before"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ((0, 0, 0, 1, 0), "world_size must be at least 1"),
        ((2, 0, 2, 1, 0), r"rank 2 is outside 0\.\.1"),
        ((0, -1, 1, 1, 0), "local_rank=-1"),
        ((0, 0, 1, 0, 0), "local_world_size=0"),
    ],
)
def test_dist_info_validates(fields: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DistInfo(*fields, torch.device("cpu"), None, False)  # type: ignore[call-arg]
