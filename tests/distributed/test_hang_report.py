"""The hang report: real ranks that disagree, stop or die, named with collectives and lines.

Two jobs run side by side (one fixture): three ranks where rank 1 broadcasts
while the others all-reduce, and four where rank 1 is stopped (SIGSTOP) and
rank 2 killed (SIGKILL) mid-run. The report's text is also checked on its own
from hand-made answers.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from warm import WarmProcess, warm_popen  # type: ignore[import-not-found]

from ddpkit.distributed.hang_report import REPORT_FILE, first_disagreement, render
from ddpkit.distributed.rendezvous import free_port
from ddpkit.testing import DistributedTestError, run_distributed

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "hang_jobs.py"
HANG_S = 2.0
LIMIT_S = 90.0  # start-up on a busy machine, the hang timeout and the promise of 30 s


def _line(marker: str) -> int:
    """The line of the job's source that holds ``marker``."""
    lines = JOB.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text)


ALL_REDUCE = f"hang_jobs.py:{_line('dist.all_reduce(grads)')} (sum_gradients)"
BROADCAST = f"hang_jobs.py:{_line('dist.broadcast(state')} (share_rank_1_state)"


def _start(tmp: Path, scenario: str, world: int) -> list[WarmProcess]:
    port, procs = free_port(), []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for rank in range(world):
        args = [scenario, str(rank), str(world), str(port), str(HANG_S), str(tmp)]
        with (tmp / f"rank{rank}.log").open("wb") as log:
            command = [sys.executable, str(JOB), *args]
            procs.append(warm_popen(command, stderr=log, cwd=ROOT, env=env))
    return procs


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, float]]:
    """Each scenario's report and the seconds from start to rank 0's exit."""
    dirs = {s: tmp_path_factory.mktemp(s) for s in ("desync", "stop_kill")}
    began = time.monotonic()
    jobs = {"desync": _start(dirs["desync"], "desync", 3)}
    jobs["stop_kill"] = _start(dirs["stop_kill"], "stop_kill", 4)
    ended = {}
    try:
        for scenario, procs in jobs.items():
            procs[0].wait(timeout=LIMIT_S - (time.monotonic() - began))
            ended[scenario] = time.monotonic() - began
    finally:
        for procs in jobs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)  # a stopped rank, then killed
                    proc.kill()
                proc.wait()
    out = {}
    for scenario, path in dirs.items():
        report = path / REPORT_FILE
        logs = "\n".join(p.read_text(errors="replace") for p in sorted(path.glob("rank*.log")))
        assert report.is_file(), logs
        out[scenario] = (report.read_text(), ended[scenario])
        out[scenario + "_log0"] = ((path / "rank0.log").read_text(errors="replace"), 0.0)
    return out


@pytest.mark.timeout(2 * LIMIT_S)
def test_a_desync_names_the_rank_both_collectives_their_numbers_and_lines(
    reports: dict[str, tuple[str, float]],
) -> None:
    text, _ = reports["desync"]
    assert "ranks that answered: 0, 1, 2" in text
    first = text.split("FIRST DISAGREEMENT: process group 0, collective #", 1)[1]
    seq = first.split(":", 1)[0]
    assert f"rank 1: broadcast #{seq}" in first
    assert f"rank 0: all_reduce #{seq}" in first
    assert f"rank 2: all_reduce #{seq}" in first
    # The lines of the job's own code that issued each of them.
    assert BROADCAST in first
    assert first.count(ALL_REDUCE) == 2
    assert "troubleshooting.md#a-hang-report" in text
    assert "===== rank 1" in text
    assert "Python stacks" in text


@pytest.mark.timeout(2 * LIMIT_S)
def test_the_report_signal_on_any_rank_makes_rank_0_report_and_the_job_go_on(
    reports: dict[str, tuple[str, float]],
) -> None:
    log, _ = reports["desync_log0"]
    asked = log.split("report asked by signal SIGUSR2 on rank 2; the job goes on", 1)[1]
    assert "ranks that answered: 0, 1, 2" in asked.split("\n\n", 1)[0]
    # The job went on to the desync after it, reported in its turn.
    assert "FIRST DISAGREEMENT" in asked


@pytest.mark.timeout(2 * LIMIT_S)
def test_stopped_and_killed_ranks_are_named_and_the_others_last_collectives_shown(
    reports: dict[str, tuple[str, float]],
) -> None:
    text, seconds = reports["stop_kill"]
    silent = text.split("did not answer (stopped, dead or unreachable): ", 1)[1].split("\n")[0]
    assert {"1", "2"} <= set(silent.split(", ")), text
    assert "0" not in silent.split(", ")
    # Rank 0 waits in the step's all-reduce, which rank 1 and 2 never joined.
    assert "rank 0 (" in text
    assert "all_reduce (not finished), issued at" in text
    assert ALL_REDUCE in text
    assert seconds < LIMIT_S


def _answer(rank: int, *entries: tuple[int, str]) -> dict[str, object]:
    collectives = [
        {
            "pg": "0",
            "pg_desc": "default_pg",
            "seq": seq,
            "p2p": False,
            "name": name,
            "sizes": [[3]],
            "done": False,
            "issued": f"train.py:{seq} (step)",
            "user": "",
        }
        for seq, name in entries
    ]
    return {
        "rank": rank,
        "host": "gpu1",
        "pid": 100 + rank,
        "recorder": True,
        "collectives": collectives,
        "stacks": f"stack of {rank}",
    }


def test_the_first_disagreement_is_the_lowest_sequence_number_held_by_all() -> None:
    answers = {
        0: _answer(0, (811, "all_reduce"), (812, "all_reduce"), (813, "all_reduce")),
        1: _answer(1, (811, "all_reduce"), (812, "broadcast")),
        2: _answer(2, (811, "all_reduce")),
    }
    found = first_disagreement(answers)
    assert found is not None
    assert found["seq"] == 812
    assert found["by_rank"][1]["name"] == "broadcast"
    assert found["by_rank"][2] is None
    summary, text = render({**answers, 3: None}, 4, "test")
    assert "ranks that did not answer (stopped, dead or unreachable): 3" in summary
    assert "rank 2: never entered #812" in summary
    assert "stack of 1" in text
    assert "stack of" not in summary


def test_ranks_that_agree_have_no_disagreement_and_the_report_says_so() -> None:
    answers = {r: _answer(r, (5, "all_reduce"), (6, "all_reduce")) for r in range(2)}
    assert first_disagreement(answers) is None
    summary, _ = render(answers, 2, "test")
    assert "no disagreement: every rank entered the same collectives" in summary


class _DiesOnRank1(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Eight samples a rank; rank 1's process ends at its fourth read."""

    def __init__(self, rank: int) -> None:
        self.rank, self.reads = rank, 0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        if self.rank == 1 and self.reads == 4:
            os._exit(7)  # a lost node: no error, no goodbye
        return torch.full((4,), float(index)), index % 2


def _fit_until_a_peer_dies(rank: int, world_size: int, directory: str) -> None:
    from ddpkit import CheckpointManager, build_loader, fit, wrap_ddp
    from ddpkit.training.config import ReportConfig, TrainConfig

    torch.manual_seed(0)
    model = wrap_ddp(torch.nn.Linear(4, 2))
    loader = build_loader(_DiesOnRank1(rank), batch_size=1, train=True, workers=0)
    fit(
        model,
        loader,
        torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=torch.nn.CrossEntropyLoss(),
        epochs=1,
        checkpoints=CheckpointManager(directory),
        config=TrainConfig(normalize=None),
        report=ReportConfig(progress=False),
    )


def test_a_collective_that_loses_its_peer_leaves_that_ranks_report(tmp_path: Path) -> None:
    with pytest.raises(DistributedTestError):
        run_distributed(_fit_until_a_peer_dies, 2, args=(str(tmp_path),), timeout=90)
    text = (tmp_path / "hang-report-rank0.txt").read_text()
    assert "why: a collective failed on rank 0" in text
    assert "ranks that did not answer (stopped, dead or unreachable): 1" in text
    assert "all_reduce" in text  # DDP's gradient all-reduce, where rank 1 went missing
    assert "===== rank 0" in text
    assert "Traceback" in text
