"""Servers leave and join a torchrun job: the agent found, the checks, refused joins, real runs.

The runs are two torchrun agents (``--nnodes 1:2``, c10d rendezvous, Gloo) as
two servers, on the loopback and in two network namespaces, each training
the real example (``tests/helpers/elastic_jobs.py``: its training set slowed
down and writing a ledger of the samples it reads) on a small shapes LMDB:
96 images, ``-b 12``, 8 steps an epoch, a step checkpoint every 2 steps.
The rendezvous is tuned to notice a lost server within seconds
(``--rdzv-conf``), as a user's may be.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from elastic_jobs import joined, strangers  # type: ignore[import-not-found]
from launched import kill_tree  # type: ignore[import-not-found]
from net_fixtures import two_namespaces  # type: ignore[import-not-found]
from warm import torchrun_warm_env, warm_popen  # type: ignore[import-not-found]

from ddpkit.distributed.launchers import LaunchEnv, launcher_job
from ddpkit.distributed.membership import Agent, elastic_warnings, find_agent
from ddpkit.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "tests" / "helpers" / "elastic_jobs.py"
# A lost server is dropped after 3 missed heartbeats of 1 s; a round waits 3 s for more.
# Server a hosts the rendezvous (is_host: torchrun cannot tell from a namespace's address).
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
PACE = 0.05  # seconds per training sample read: an epoch lasts 3-5 s
SAMPLES, BATCH, STEPS = 96, 12, 8  # per epoch
LIMIT_S = 150


# --- the agent and what breaks a join ----------------------------------------------------


def test_the_agent_is_found_among_the_parents_with_its_nnodes_range() -> None:
    code = "import time; time.sleep(60)"
    fake = subprocess.Popen(  # a process whose command line is torchrun's
        [
            "bash",
            "-c",
            f'exec -a torchrun {sys.executable} -c "{code}" --nnodes 1:3 x.py --nnodes 5',
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{fake.pid}/cmdline").read_bytes().split(b"\0")[0] != b"torchrun":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        agent = find_agent(fake.pid)
        assert agent is not None
        assert agent.pid == fake.pid
        assert agent.nnodes == (1, 3)
        assert agent.elastic
    finally:
        fake.kill()
        fake.wait()
    assert find_agent() is None  # pytest runs under no torchrun


def test_a_global_batch_that_a_world_the_job_can_have_does_not_divide_is_refused() -> None:
    # A worker of an agent with --nnodes 1:3 and 2 processes a server: worlds 2, 4 and 6.
    code = (
        "import torch, ddpkit; "
        "info = ddpkit.DistInfo(0, 0, 2, 2, 0, torch.device('cpu'), 'gloo', True); "
        "data = torch.utils.data.TensorDataset(torch.zeros(48, 1)); "
        "ddpkit.build_loader(data, global_batch_size=6, train=True, workers=0, info=info)"
    )
    agent = (
        f"import subprocess, sys; sys.exit(subprocess.call([{sys.executable!r}, '-c', {code!r}]))"
    )
    done = subprocess.run(
        ["bash", "-c", 'exec -a torchrun "$0" -c "$1" --nnodes 1:3 x.py', sys.executable, agent],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "global_batch_size=6 does not divide over 4 processes, a world this job can" in (
        done.stderr
    )
    assert "world sizes [2, 4, 6]): use a multiple of 12, such as 12" in done.stderr


def _launch(**kw: Any) -> LaunchEnv:
    return LaunchEnv(launcher="torchrun", rank=0, local_rank=0, world_size=2,
                     local_world_size=1, node_rank=0, **kw)  # fmt: skip


def test_what_would_break_a_join_is_said_only_for_an_elastic_job() -> None:
    elastic, fixed = Agent(1, (1, 2), ()), Agent(1, (2, 2), ())
    said = elastic_warnings(_launch(store_is_external=True, run_id="none"), elastic)
    assert len(said) == 2
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in said[0]
    assert "--nnodes 1:2" in said[0]
    assert "--rdzv-id" in said[1]
    assert elastic_warnings(_launch(store_is_external=False, run_id="job7"), elastic) == []
    assert elastic_warnings(_launch(store_is_external=True, run_id="none"), fixed) == []
    assert elastic_warnings(None, elastic) == []


def test_the_launcher_job_is_torchruns_rdzv_id_unless_the_default() -> None:
    worker = {"RANK": "0", "WORLD_SIZE": "2"}
    assert launcher_job({**worker, "TORCHELASTIC_RUN_ID": "job7"}) == "job7"
    assert launcher_job({**worker, "TORCHELASTIC_RUN_ID": "none"}) is None
    assert launcher_job(worker) is None
    assert launcher_job({"TORCHELASTIC_RUN_ID": "job7"}) is None  # not a worker


# --- who may join ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_server_that_alone_has_a_problem_is_refused_on_every_rank() -> None:
    cases = [[None, None], ["other data", None], [None, "other seed"], ["a", "b"]]
    ranks = run_distributed(strangers, 2, args=({"cases": cases},), timeout=90)
    (none0, first0, second0, both0), (none1, first1, second1, both1) = ranks
    assert none0 == none1 == ["returned", None]
    # The server alone with a problem is told it is refused; the other that it goes on.
    assert first0[0] == "refused"
    assert "this server, node 0" in first0[1]
    assert "other data" in first0[1]
    assert first1[0] == "refused"
    assert "refused a server that joined: node 0" in first1[1]
    assert "torchrun starts them again without it" in first1[1]
    assert second1[0] == "refused"
    assert "this server, node 1" in second1[1]
    assert second0[0] == "refused"
    assert "node 1" in second0[1]
    assert "other seed" in second0[1]
    # Every server has one: the run's own problem, the same answer on each rank.
    assert both0 == both1 == ["returned", "on rank 0, a"]
    # Two ranks of one server: nobody to refuse, the run's own problem.
    one = run_distributed(strangers, 2, args=({"cases": cases[1:2], "one_node": True},))
    assert one[0] == one[1] == [["returned", "on rank 0, other data"]]


@pytest.mark.timeout(120)
def test_a_join_with_another_ddpkit_or_settings_is_refused_and_an_upgrade_is_not() -> None:
    same, newer, other = (
        ("0.2.0", {"--seed": 0}),
        ("0.3.0", {"--seed": 0}),
        ("0.2.0", {"--seed": 5}),
    )
    cases = [[same, same], [same, newer], [newer, newer], [same, other], [other, other]]
    ranks = run_distributed(joined, 2, args=({"saved": "0.2.0", "cases": cases},), timeout=90)
    for rank, said in enumerate(ranks):
        assert said[0] == ["ok", None]
        assert said[1][0] == "refused"
        assert "ddpkit 0.3.0, and the run trains with ddpkit 0.2.0" in said[1][1]
        assert ("this server, node 1" in said[1][1]) == (rank == 1)
        assert said[2] == ["ok", None]  # every server upgraded: an upgrade, not a stranger
        assert said[3][0] == "refused"
        assert "--seed 0; this run has --seed 5" in said[3][1]
        assert said[4][0] == "error"  # every server: a resume with other settings, as ever
        assert "was trained with --seed 0; this run has --seed 5" in said[4][1]


# --- the real thing: two servers, a leave and a join -------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import ddpkit
    from ddpkit.data.shapes import make_shapes_dataset

    root = tmp_path_factory.mktemp("shapes")
    sizes = {"train_per_class": SAMPLES // 3, "val_per_class": 4, "size": 32}
    dirs = make_shapes_dataset(root / "src", classes=3, **sizes)
    for split, source in zip(("train", "val"), dirs, strict=True):
        ddpkit.build_lmdb(source, root / f"{split}.lmdb", progress=False)
    return root


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One torchrun agent with one worker: a server of the job, its log and checkpoints."""

    def __init__(self, name: str, tmp: Path, proc: Any, log: Path) -> None:
        self.name, self.tmp, self.proc, self.log = name, tmp, proc, log

    @property
    def checkpoints(self) -> Path:
        return self.tmp / f"ck-{self.name}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_step(self, step: int) -> None:
        name = self.checkpoints / f"step-{step:09d}.pth"
        deadline = time.monotonic() + LIMIT_S
        while not name.exists():
            assert self.proc.poll() is None, f"{self.name} ended:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"{name} never appeared:\n{self.output()[-3000:]}"
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the agent and its workers, as a server that loses power."""
        kill_tree(self.proc.pid)
        self.proc.wait(timeout=30)

    def end(self) -> int:
        try:
            return int(self.proc.wait(timeout=LIMIT_S))
        finally:
            if self.proc.poll() is None:
                kill_tree(self.proc.pid)


def _start(
    name: str,
    tmp: Path,
    data: Path,
    endpoint: str,
    *extra: str,
    prefix: tuple[str, ...] = (),
    warm: bool = True,
    restarts: int = 3,
    address: str | None = None,
) -> Server:
    ledger = tmp / "ledger"
    ledger.mkdir(exist_ok=True)
    conf = f"{RDZV_CONF},is_host={int(name == 'a')}"
    local = ["--local-addr", address] if address else []
    command = [
        *prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
        "--nproc-per-node", "1", "--max-restarts", str(restarts), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic-test", "--rdzv-conf", conf,
        "--monitor-interval", "0.2", *local, str(JOBS), str(ledger), str(PACE),
        "--data", str(data), "--arch", "test_resnet", "--image-size", "32", "--epochs", "3",
        "-b", str(BATCH), "-j", "0", "--requires-grad", "--lr", "0.05",
        "--checkpoints", str(tmp / f"ck-{name}"), "--save-on-each-node", "--save-every-steps",
        "2", "--network", "tiny", "--dist-backend", "gloo", *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LEDGER_NODE=name)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # what the docs' commands say
    log = tmp / f"{name}-{time.monotonic_ns()}.log"
    with log.open("w") as out:
        if warm and not prefix:
            proc: Any = warm_popen(command, env=torchrun_warm_env(env), cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, end_with_caller=True)  # fmt: skip
        else:
            proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return Server(name, tmp, proc, log)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """The servers a test starts; any still running at its end are killed with their workers."""
    started: list[Server] = []
    yield started
    for server in started:
        if server.proc.poll() is None:
            kill_tree(server.proc.pid)


def _records(checkpoints: Path) -> list[dict[str, Any]]:
    lines = (checkpoints / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "epoch" in r]


def _ledger(directory: Path) -> dict[int, list[int]]:
    """Each epoch's samples in the steps the job kept, from every worker's ledger file.

    A worker's file starts with the step its run resumed at and its world size; its
    n-th index belongs to step ``start + n // (BATCH / world)``. The workers of one
    rendezvous round resume at one step; a round keeps its steps up to the next
    round's start (a leave throws away the steps after the last step checkpoint).
    """
    rounds: dict[tuple[int, int], list[tuple[float, list[int]]]] = collections.defaultdict(list)
    for file in directory.iterdir():
        head, *lines = file.read_text().splitlines()
        info = json.loads(head)
        rounds[(info["step"], info["world"])].append((info["time"], list(map(int, lines))))
    ordered = sorted(rounds.items(), key=lambda kv: min(t for t, _ in kv[1]))
    starts = [start for (start, _), _ in ordered] + [3 * STEPS]
    epochs: dict[int, list[int]] = collections.defaultdict(list)
    for k, ((start, world), files) in enumerate(ordered):
        per_rank = BATCH // world
        assert len(files) == world, (start, world, len(files))
        for _, indices in files:
            for n, index in enumerate(indices):
                step = start + n // per_rank
                if step < starts[k + 1]:
                    epochs[step // STEPS].append(index)
    return epochs


def _leave_and_join(servers: list[Server], tmp: Path, data: Path, endpoint: str,
                    hosts: list[tuple[tuple[str, ...], str | None]]) -> None:  # fmt: skip
    """``hosts``: each server's command prefix (a namespace) and address (None: its name's)."""
    (prefix_a, address_a), (prefix_b, address_b) = hosts
    warm = not prefix_a
    a = _start("a", tmp, data, endpoint, prefix=prefix_a, address=address_a, warm=warm)
    servers.append(a)
    time.sleep(0.5)  # a hosts the rendezvous store
    servers.append(_start("b", tmp, data, endpoint, prefix=prefix_b, address=address_b, warm=warm))
    a.wait_for_step(4)  # epoch 1 of 3, on 2 servers
    servers[1].kill()
    _wait_for(a.checkpoints / "latest.pth")  # epoch 1 ended, a alone: b comes back in epoch 2
    servers.append(_start("b", tmp, data, endpoint, prefix=prefix_b, address=address_b, warm=warm))
    codes = [a.end(), servers[2].end()]
    assert codes == [0, 0], "\n\n".join(s.output()[-4000:] for s in servers)

    out = a.output()
    # The join: a's worker stopped by its agent's SIGTERM saved the step it was at, and the
    # next round resumed there: no step lost.
    stopped = [int(s) for s in _find(r"stopped by SIGTERM after step (\d+)", out)]
    resumed = [int(s) for s in _find(r"resuming at epoch \d+ step (\d+)", out)]
    assert len(stopped) == 1, out[-4000:]
    assert stopped[0] in resumed, out[-4000:]
    assert torch.load(a.checkpoints / "latest.pth", weights_only=True)["position"]["step"] == 24
    # Every epoch trained on each sample once, on the world sizes it ran on.
    records = _records(a.checkpoints)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert [r["train_samples"] for r in records] == [SAMPLES] * 3
    sizes = [r["world_sizes"] for r in records]
    assert sizes[0] == [2, 1], sizes
    assert sizes[1][0] == 1, sizes
    assert 2 in sizes[1] + sizes[2], sizes
    lines = [line for line in out.splitlines() if line.startswith("epoch 1/3")]
    assert "world sizes [2, 1]: 12 samples a step, as 2 x 6 then 1 x 12" in lines[-1]
    epochs = _ledger(tmp / "ledger")
    for epoch in range(3):
        counts = collections.Counter(epochs[epoch])
        twice = {i: c for i, c in counts.items() if c != 1}
        assert not twice, (epoch, twice)
        assert sorted(counts) == list(range(SAMPLES)), (epoch, set(range(SAMPLES)) - set(counts))


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _find(pattern: str, text: str) -> list[str]:
    import re

    return re.findall(pattern, text)


@pytest.mark.timeout(300)
def test_a_server_leaves_and_joins_on_the_loopback_each_sample_once(
    data: Path, tmp_path: Path, servers: list[Server]
) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    _leave_and_join(servers, tmp_path, data, endpoint, [((), None), ((), None)])


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_a_server_leaves_and_joins_across_two_hosts_each_sample_once(
    data: Path, tmp_path: Path, servers: list[Server], two_hosts: list[tuple[str, str]]
) -> None:
    endpoint = f"198.18.0.1:{29400 + os.getpid() % 1000}"
    # Each names its own address: the namespaces share this machine's host name.
    hosts = [
        (("ip", "netns", "exec", ns), f"198.18.0.{i + 1}") for i, (ns, _) in enumerate(two_hosts)
    ]
    _leave_and_join(servers, tmp_path, data, endpoint, hosts)  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_a_join_with_other_settings_is_refused_and_the_others_go_on(
    data: Path, tmp_path: Path, servers: list[Server]
) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    a = _start("a", tmp_path, data, endpoint, restarts=1)
    servers.append(a)
    a.wait_for_step(2)
    # b trains with another seed, which decides the samples: refused, a goes on alone.
    b = _start("b", tmp_path, data, endpoint, "--seed", "7", warm=False)
    servers.append(b)
    assert b.end() != 0
    said = b.output()
    assert "is refused by the running job" in said, said[-3000:]
    assert "--seed" in said
    assert "torchrun agent is stopped" in said
    a.wait_for_step(STEPS + 2)  # a goes on, alone
    out = a.output()
    assert "refused a server that joined" in out
    # A second refused join uses a's last restart: its job ends, its checkpoint intact.
    c = _start("c", tmp_path, data, endpoint, "--seed", "8", warm=False)
    servers.append(c)
    assert c.end() != 0
    assert a.end() != 0
    out = a.output()
    assert "torchrun --max-restarts 1: every restart is used" in out, out[-4000:]
    newest = torch.load(a.checkpoints / "interrupted.pth", weights_only=True)
    assert newest["position"]["step"] >= STEPS + 2


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str]]]:
    with two_namespaces() as hosts:
        yield hosts
