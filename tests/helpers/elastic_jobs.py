"""The example under an elastic torchrun, its training samples written to a ledger; jobs
that ask ``refuse_strangers`` about each rank's problem, under a stand-in torchrun agent.

``python elastic_jobs.py LEDGER_DIR PACE_S EXAMPLE_ARGS...`` runs
``examples/seresnext_lmdb.py`` unchanged except for its training set: a
``LazyLMDBDataset`` that waits ``PACE_S`` per sample (so the test has time to
stop and start servers inside an epoch) and appends each index it reads to a
file of its own process. The file's first line says where the process started:
the global optimizer step its run resumed at, the world size and the
per-process batch; with ``-j 0`` the n-th index read belongs to step
``start + n // batch``, so the test can tell the steps the job kept from those a
leave threw away. While a file ``hold`` is in the ledger's directory, every read
waits: the test holds training still while a server starts, joins or is killed;
once a file ``fail`` is there, every read fails.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

import ddpkit
from ddpkit.distributed.membership import JoinRefused, refuse_strangers

_MANAGER: list[Any] = []  # the run's CheckpointManager, once fit has it


class Ledgered(ddpkit.LazyLMDBDataset):
    """The training set, slowed down and writing each index it reads."""

    ledger: Path
    pace: float

    def __getitem__(self, index: int) -> Any:
        if Path(self.paths[0]).name == "train.lmdb":
            self._note(index)
        return super().__getitem__(index)

    def _note(self, index: int) -> None:
        time.sleep(self.pace)
        while (self.ledger / "hold").exists():
            time.sleep(0.01)
        if (self.ledger / "fail").exists():
            raise RuntimeError("the training data failed (the test's file 'fail')")
        if not hasattr(self, "_file"):
            position = _MANAGER[0].position if _MANAGER else None
            file = self.ledger / f"{os.uname().nodename}-{os.getpid()}-{time.time_ns()}.txt"
            self._file = open(file, "a", encoding="utf-8")  # noqa: SIM115 - for the process
            head = {
                "time": time.time(),
                "step": position.step if position is not None else 0,
                "world": int(os.environ["WORLD_SIZE"]),
                "rank": int(os.environ["RANK"]),
                "node": os.environ.get("LEDGER_NODE", "?"),
            }
            self._file.write(json.dumps(head) + "\n")
        self._file.write(f"{index}\n")
        self._file.flush()


def _fit(*args: Any, **kwargs: Any) -> Any:
    _MANAGER.append(kwargs["checkpoints"])
    return _FIT(*args, **kwargs)


_FIT = ddpkit.fit


def strangers(rank: int, world_size: int, plan: dict[str, Any]) -> list[Any]:
    """``refuse_strangers`` for each of ``plan["cases"]`` (each rank's problem, by rank).

    Each rank is a server of its own (``GROUP_RANK``) unless ``plan["one_node"]``.
    """
    node = 0 if plan.get("one_node") else rank
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), GROUP_RANK=str(node))
    said = []
    for problems in plan["cases"]:
        try:
            said.append(["returned", refuse_strangers(problems[rank])])
        except JoinRefused as exc:
            said.append(["refused", str(exc)])
    return said


def joined(rank: int, world_size: int, plan: dict[str, Any]) -> list[Any]:
    """The checks of a resume after a join, on each of ``plan["cases"]``: every rank's
    (ddpkit version, extra) by rank, against a checkpoint of ddpkit ``plan["saved"]``."""
    import ddpkit.checkpoint.manager as manager

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), GROUP_RANK=str(rank))
    state = {"ddpkit": plan["saved"], "extra": {"--seed": 0}}
    said = []
    for case in plan["cases"]:
        manager.__version__, extra = case[rank]  # type: ignore[attr-defined]
        try:
            manager._check_joined(state, "ck/interrupted.pth", extra)
            said.append(["ok", None])
        except JoinRefused as exc:
            said.append(["refused", str(exc)])
        except ddpkit.CheckpointError as exc:
            said.append(["error", str(exc)])
    return said


class _Labelled(torch.utils.data.Dataset[int]):
    """24 samples whose labels are the data's identity (``data_identity``)."""

    def __init__(self, targets: list[int]) -> None:
        self.targets = targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> int:
        return index


def other_data(rank: int) -> list[Any]:
    """A mid-epoch resume where rank 1's training set has other labels than the checkpoint's."""
    from ddpkit.data.resume import data_identity, resume_verdict
    from ddpkit.position import Position

    saved = _Labelled([i % 3 for i in range(24)])
    mine = saved if rank == 0 else _Labelled([(i + 1) % 3 for i in range(24)])
    size, digest = data_identity(saved)
    start = Position(0, 1, 12, 1, 2, data_size=size, data_digest=digest)
    loader = torch.utils.data.DataLoader(mine, batch_size=6)
    try:
        return ["returned", list(resume_verdict(loader, start, 2, rank))]
    except JoinRefused as exc:
        return ["refused", str(exc)]


def checks(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, list[Any]]:
    """:func:`strangers` and :func:`joined` on their cases in ``plan``, then what the
    interpreter's exit runs (a rank of ``run_distributed`` ends without it): a refused
    server's stop of its agent."""
    said = {
        "strangers": strangers(rank, world_size, plan["strangers"]),
        "joined": joined(rank, world_size, plan["joined"]),
        "data": other_data(rank),
    }
    atexit._run_exitfuncs()
    return said


def as_agent(out: str, plan: str) -> None:
    """Be a torchrun agent for :func:`checks`: run it on 2 ranks, write what they said and
    how many SIGTERMs this process got (a refused server's ranks stop their agent)."""
    from ddpkit.testing import run_distributed

    got: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(1))
    results = run_distributed(checks, 2, args=(json.loads(plan),), timeout=90, start_method="spawn")
    Path(out).write_text(json.dumps({"results": results, "sigterms": len(got)}))


if __name__ == "__main__":
    from ddpkit.examples import seresnext_lmdb

    Ledgered.ledger, Ledgered.pace = Path(sys.argv[1]), float(sys.argv[2])
    ddpkit.LazyLMDBDataset = Ledgered  # type: ignore[misc]
    ddpkit.fit = _fit
    seresnext_lmdb.main(sys.argv[3:])
