"""Servers leave and join a torchrun job: the agent found, the checks, refused joins, real runs.

The runs are two torchrun agents (``--nnodes 1:2``, c10d rendezvous, Gloo) as
two servers, on the loopback and in two network namespaces, each training
the real example (``tests/helpers/elastic_jobs.py``: its training set slowed
down and writing a ledger of the samples it reads) on a small shapes LMDB:
72 images, ``-b 12``, 6 steps an epoch, a step checkpoint every 2 steps.
The rendezvous is tuned to notice a lost server within seconds
(``--rdzv-conf``), as a user's may be.
"""

from __future__ import annotations

import collections
import contextlib
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
from elastic_jobs import strangers  # type: ignore[import-not-found]
from launched import children, kill_tree  # type: ignore[import-not-found]
from net_fixtures import two_namespaces  # type: ignore[import-not-found]
from warm import torchrun_warm_env, warm_popen  # type: ignore[import-not-found]

from ddpkit.distributed.launchers import LaunchEnv, launcher_job
from ddpkit.distributed.membership import Agent, elastic_warnings, find_agent
from ddpkit.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "tests" / "helpers" / "elastic_jobs.py"
# A lost server is dropped after 5 missed heartbeats of 1 s (fewer: a server slow to send
# one under load is dropped too, and forms a job of its own); a round waits 2 s for more.
# Server a hosts the rendezvous (is_host: torchrun cannot tell from a namespace's address).
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"
PACE = 0.03  # seconds per training sample read
SAMPLES, BATCH, STEPS = 72, 12, 6  # per epoch
LIMIT_S = 150


# --- the agent and what breaks a join ----------------------------------------------------


def _stand_in_agent(tmp_path: Path, code: str) -> list[str]:
    """``python .../torchrun --nnodes 1:3 x.py --nnodes 5``, running ``code``: a process whose
    command line is an elastic torchrun agent's (the script's own ``--nnodes`` is not its)."""
    script = tmp_path / "torchrun"
    script.write_text(code)
    return [sys.executable, str(script), "--nnodes", "1:3", "x.py", "--nnodes", "5"]


def test_the_agent_is_found_among_the_parents_with_its_nnodes_range(tmp_path: Path) -> None:
    # Its worker is a grandchild (a shell in between, as a wrapper script would be).
    worker = "subprocess.Popen(['bash', '-c', 'sleep 60; true'])"
    code = f"import subprocess, time\n{worker}\ntime.sleep(60)\n"
    fake = subprocess.Popen(_stand_in_agent(tmp_path, code), start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not children(fake.pid) or not any(children(c) for c in children(fake.pid)):
            assert time.monotonic() < deadline, "the stand-in agent started no worker"
            time.sleep(0.01)
        shell = children(fake.pid)[0]
        for start in (fake.pid, shell, children(shell)[0]):
            agent = find_agent(start)
            assert agent is not None
            assert agent.pid == fake.pid
            assert agent.nnodes == (1, 3)
            assert agent.elastic
        assert find_agent() is None  # pytest runs under no torchrun
    finally:
        kill_tree(fake.pid)
        fake.wait()


def test_a_global_batch_that_a_world_the_job_can_have_does_not_divide_is_refused(
    tmp_path: Path,
) -> None:
    # A worker of an agent with --nnodes 1:3 and 2 processes a server: worlds 2, 4 and 6.
    code = (
        "import torch, ddpkit; "
        "info = ddpkit.DistInfo(0, 0, 2, 2, 0, torch.device('cpu'), 'gloo', True); "
        "data = torch.utils.data.TensorDataset(torch.zeros(48, 1)); "
        "ddpkit.build_loader(data, global_batch_size=6, train=False, workers=0, info=info); "
        "ddpkit.build_loader(data, global_batch_size=6, train=True, workers=0, info=info)"
    )
    agent = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {code!r}]))"
    command = _stand_in_agent(tmp_path, agent)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    # Validation batches may be any size: only the training loader is refused.
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


def _under_an_elastic_agent(plan: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """``elastic_jobs.checks`` on 2 ranks whose parent's command line is ``torchrun --nnodes
    1:3``: what each rank said, and how many SIGTERMs that stand-in agent got."""
    out = tmp_path / "said.json"
    call = f"elastic_jobs.as_agent({str(out)!r}, {json.dumps(plan)!r})"
    code = f"import elastic_jobs\nif __name__ == '__main__':\n    {call}\n"  # ranks: spawn
    done = subprocess.run(
        _stand_in_agent(tmp_path, code), capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(out.read_text()))


_STRANGERS = [[None, None], ["other data", None], [None, "other seed"], ["a", "b"]]
_SAME, _NEWER = ["0.2.0", {"--seed": 0}], ["0.3.0", {"--seed": 0}]
_OTHER = ["0.2.0", {"--seed": 5}]
_JOINED = [[_SAME, _SAME], [_SAME, _NEWER], [_NEWER, _NEWER], [_SAME, _OTHER], [_OTHER, _OTHER]]


@pytest.mark.timeout(180)
def test_a_server_that_alone_differs_is_refused_on_every_rank_and_its_agent_stopped(
    tmp_path: Path,
) -> None:
    plan = {"strangers": {"cases": _STRANGERS}, "joined": {"saved": "0.2.0", "cases": _JOINED}}
    said = _under_an_elastic_agent(plan, tmp_path)
    (none0, first0, second0, both0), (none1, first1, second1, both1) = (
        r["strangers"] for r in said["results"]
    )
    assert none0 == none1 == ["returned", None]
    # The server alone with a problem is told it is refused; the other that it goes on.
    assert first0[0] == "refused"
    assert "this server, node 0" in first0[1]
    assert "other data" in first0[1]
    assert first1[0] == "refused"
    assert "refused a server that joined: node 0" in first1[1]
    assert second1[0] == "refused"
    assert "this server, node 1" in second1[1]
    assert second0[0] == "refused"
    assert "node 1" in second0[1]
    assert "other seed" in second0[1]
    # Every server has one: the run's own problem, the same answer on each rank.
    assert both0 == both1 == ["returned", "on rank 0, a"]
    # The checks of a resume: another ddpkit or settings on one server is refused; on every
    # server it is an upgrade, or a resume with other settings, refused as ever.
    for rank, result in enumerate(said["results"]):
        joined = result["joined"]
        assert joined[0] == ["ok", None]
        assert joined[1][0] == "refused"
        assert "ddpkit 0.3.0, and the run trains with ddpkit 0.2.0" in joined[1][1]
        assert ("this server, node 1" in joined[1][1]) == (rank == 1)
        assert joined[2] == ["ok", None]
        assert joined[3][0] == "refused"
        assert "--seed 0; this run has --seed 5" in joined[3][1]
        assert joined[4][0] == "error"
        assert "was trained with --seed 0; this run has --seed 5" in joined[4][1]
    # A server whose training set has other labels than the checkpoint's: refused.
    data0, data1 = (r["data"] for r in said["results"])
    assert data1[0] == "refused"
    assert "this server, node 1" in data1[1]
    assert "same 24 samples but a different index" in data1[1]
    assert data0[0] == "refused"
    assert "refused a server that joined: node 1" in data0[1]
    # The refused servers' ranks stopped their agent as they ended (signals sent close
    # together arrive as one).
    assert said["sigterms"] >= 1


@pytest.mark.timeout(120)
def test_outside_an_elastic_job_the_ranks_agree_on_a_problem_and_refuse_no_server() -> None:
    # A fixed job (srun, torchrun --nnodes 2): nobody joined; every rank gets one answer.
    ranks = run_distributed(strangers, 2, args=({"cases": _STRANGERS},), timeout=90)
    assert (
        ranks[0]
        == ranks[1]
        == [
            ["returned", None],
            ["returned", "on rank 0, other data"],
            ["returned", "on rank 1, other seed"],
            ["returned", "on rank 0, a"],
        ]
    )


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

    def wait_for_text(self, text: str, count: int = 1) -> None:
        """Wait until ``text`` is in the output ``count`` times."""
        deadline = time.monotonic() + LIMIT_S
        while self.output().count(text) < count:
            assert self.proc.poll() is None, f"{self.name} ended:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r}:\n{self.output()[-3000:]}"
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


@contextlib.contextmanager
def _held(tmp: Path) -> Iterator[None]:
    """Every training read waits (``elastic_jobs``): the servers stand still in between."""
    hold = tmp / "ledger" / "hold"
    hold.touch()
    try:
        yield
    finally:
        hold.unlink()


# The agent's line when it stops its workers for a new round (a server came).
STOPPING = "closing signal SIGTERM"


def _leave_and_join(servers: list[Server], tmp: Path, data: Path, endpoint: str,
                    hosts: list[tuple[tuple[str, ...], str | None]]) -> None:  # fmt: skip
    """``hosts``: each server's command prefix (a namespace) and address (None: its name's)."""
    (prefix_a, address_a), (prefix_b, address_b) = hosts
    warm = not prefix_a
    a = _start("a", tmp, data, endpoint, prefix=prefix_a, address=address_a, warm=warm)
    servers.append(a)
    time.sleep(0.5)  # a hosts the rendezvous store
    servers.append(_start("b", tmp, data, endpoint, prefix=prefix_b, address=address_b, warm=warm))
    a.wait_for_step(2)  # written in the background: the ranks may be a step or two further
    with _held(tmp):  # in epoch 1 of 3, on 2 servers: b loses power
        servers[1].kill()
    _wait_for(a.checkpoints / "latest.pth")  # epoch 1 ended, a alone: b comes back in epoch 2
    with _held(tmp):
        servers.append(_start("b", tmp, data, endpoint, prefix=prefix_b, address=address_b,
                              warm=warm))  # fmt: skip
        a.wait_for_text(STOPPING)  # b is in the next round: a's worker got its SIGTERM
    codes = [a.end(), servers[2].end()]
    assert codes == [0, 0], "\n\n".join(s.output()[-4000:] for s in servers)

    out = a.output()
    # The join: a's worker stopped by its agent's SIGTERM saved the step it was at, and the
    # next round resumed there: no step lost.
    stopped = [int(s) for s in _find(r"stopped by SIGTERM after step (\d+)", out)]
    resumed = [int(s) for s in _find(r"resuming at epoch \d+ step (\d+)", out)]
    assert len(stopped) == 1, out[-4000:]
    assert stopped[0] in resumed, out[-4000:]
    latest = torch.load(a.checkpoints / "latest.pth", weights_only=True)
    assert latest["position"]["step"] == 3 * STEPS
    # Every epoch trained on each sample once, on the world sizes it ran on.
    records = _records(a.checkpoints)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert [r["train_samples"] for r in records] == [SAMPLES] * 3
    assert [r["world_sizes"] for r in records] == [[2, 1], [1, 2], [2]]
    lines = [line for line in out.splitlines() if line.startswith("epoch 1/3")]
    said = "world sizes [2, 1]: 12 samples a step, as 2 x 6 then 1 x 12 (the per-process batch"
    assert said in lines[-1]
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
    with _held(tmp_path):
        b = _start("b", tmp_path, data, endpoint, "--seed", "7", warm=False)
        servers.append(b)
        a.wait_for_text(STOPPING)
    assert b.end() != 0
    said = b.output()
    assert "is refused by the running job" in said, said[-3000:]
    assert "--seed" in said
    assert "torchrun agent is stopped" in said
    a.wait_for_step(STEPS + 2)  # a goes on, alone
    out = a.output()
    assert "refused a server that joined" in out
    assert "torchrun starts them again without it" in out
    # The refusal used a's last restart: the next failure ends its job, its checkpoints intact.
    (tmp_path / "ledger" / "fail").touch()
    assert a.end() != 0
    out = a.output()
    assert "torchrun --max-restarts 1: every restart is used" in out, out[-4000:]
    assert f"its newest checkpoint in {a.checkpoints} is intact" in out
    steps = sorted(a.checkpoints.glob("step-*.pth"))
    newest = torch.load(steps[-1], weights_only=True)
    assert newest["position"]["step"] >= STEPS + 2


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str]]]:
    with two_namespaces() as hosts:
        yield hosts
