"""Fault-tolerant fit(): kills, stops and failed writes at any step end in a bit-exact resume.

Every job is 2 real Gloo ranks with 2 data workers each, random augmentation,
dropout and BatchNorm (``tests/helpers/fault_jobs.py``); a reference run that nothing
interrupts gives the weights every resumed run must end with, ``torch.equal``.
"""

from __future__ import annotations

import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_jobs import BATCH, faulty_run, resumed_then_fresh
from torch.utils.data import DistributedSampler

from ddpkit import HANG_EXIT_CODE, PREEMPTED_EXIT_CODE, RankFailedError, load_checkpoint
from ddpkit.testing import run_distributed
from ddpkit.training.reporting import epoch_line

STEPS_PER_EPOCH, EPOCHS = 6, 3
_TIMEOUT = 180


def _run(plan: dict[str, Any], world: int = 2) -> list[dict[str, Any]]:
    return run_distributed(faulty_run, world, args=(plan,), timeout=_TIMEOUT)


def _killed(plan: dict[str, Any]) -> None:
    with pytest.raises(RankFailedError, match="exited with code -9"):
        _run(plan)


Weights = list[dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Weights:
    """Each rank's weights after 3 epochs that nothing interrupted.

    Per rank: DDP broadcasts rank 0's BatchNorm statistics before each forward,
    and each rank then updates them with its own batch.
    """
    directory = tmp_path_factory.mktemp("reference")
    results = _run({"dir": str(directory), "every_steps": 2})
    assert results[0]["steps"] == STEPS_PER_EPOCH * EPOCHS
    return [r["weights"] for r in results]


@pytest.fixture(scope="module")
def reference_without_workers(tmp_path_factory: pytest.TempPathFactory) -> Weights:
    """As ``reference``, with the batches read in each rank (``workers=0``).

    The tests of where checkpoints are written and read need no data workers,
    whose start-up (a forkserver importing torch in each rank) is most of a run.
    """
    directory = tmp_path_factory.mktemp("reference0")
    results = _run({"dir": str(directory), "every_steps": 2, "workers": 0})
    assert results[0]["steps"] == STEPS_PER_EPOCH * EPOCHS
    return [r["weights"] for r in results]


def _assert_same(results: list[dict[str, Any]], reference: Weights, why: str) -> None:
    for rank, (result, expected) in enumerate(zip(results, reference, strict=True)):
        assert "error" not in result, result.get("error")
        for key, value in expected.items():
            assert torch.equal(result["weights"][key], value), f"rank {rank}: {key} ({why})"


_RANDOM_STEP = random.Random().randint(1, STEPS_PER_EPOCH * EPOCHS - 1)


# The fixed kill points (rank 1 mid-epoch 1, rank 0 in epoch 0) run in every `make test`;
# the random one, a fuzz over every step, in `make test-all`.
@pytest.mark.parametrize(
    "kill_at",
    [(1, 9), (0, 4), pytest.param((1, _RANDOM_STEP), marks=pytest.mark.slow)],
    ids=["rank1-step9", "rank0-step4", "random"],
)
def test_a_killed_job_resumes_bit_exactly(
    kill_at: tuple[int, int], reference: Weights, tmp_path: Path
) -> None:
    plan: dict[str, Any] = {"dir": str(tmp_path), "every_steps": 2, "kill_at": kill_at}
    newest = kill_at[1] - 1 - (kill_at[1] - 1) % 2  # the last step checkpoint due before it
    if newest >= 2 and newest % STEPS_PER_EPOCH:  # mid-epoch: a step checkpoint of its own
        plan["saved_before_kill"] = newest
    _killed(plan)
    record = str(tmp_path / "reads")
    results = _run({"dir": str(tmp_path), "every_steps": 2, "resume": True, "record": record})
    _assert_same(results, reference, f"killed at step {kill_at[1]} on rank {kill_at[0]}")
    start = results[0]["position"]
    done = kill_at[1] - 1  # killed inside step kill_at[1], before its checkpoint
    if done < 2:  # killed before the first checkpoint: the resume is a fresh start
        assert start is None
        return
    assert start.step == done - done % 2  # the newest checkpoint: every 2 steps
    assert results[0]["steps"] == STEPS_PER_EPOCH * EPOCHS - start.step
    # The resumed epoch read only what it had not consumed: nothing skipped was decoded.
    left = STEPS_PER_EPOCH - start.batches
    for rank in range(2):
        reads = [int(x) for x in Path(f"{record}.2.{rank}").read_text().split()]
        sampler = DistributedSampler(range(48), num_replicas=2, rank=rank, seed=5)
        sampler.set_epoch(start.epoch)
        share = list(sampler)
        assert sorted(reads[: left * BATCH]) == sorted(share[start.batches * BATCH :])


@pytest.mark.parametrize(("nth", "resumed"), [(2, 2), (3, 4)], ids=["step-write", "epoch-write"])
def test_a_kill_in_the_middle_of_a_write_loses_only_that_checkpoint(
    nth: int, resumed: int, reference_without_workers: Weights, tmp_path: Path
) -> None:
    # Rank 0's full checkpoints: step 2, step 4, the end of epoch 0 (step 6), step 8 ...
    plan = {"dir": str(tmp_path), "every_steps": 2, "workers": 0}
    _killed({**plan, "kill_in_write": (0, nth)})
    assert not list(tmp_path.glob("step-*.pth.tmp-*"))  # hidden names only
    results = _run({**plan, "resume": True})
    _assert_same(results, reference_without_workers, f"killed in write {nth}")
    assert results[0]["position"].step == resumed
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers == []  # the next saves removed what the killed write left


# SIGTERM with data workers (their shutdown at the stop); SIGUSR1 without, as the stop is the same.
@pytest.mark.parametrize(
    ("signal_name", "workers"), [("SIGTERM", 2), ("SIGUSR1", 0)], ids=["SIGTERM", "SIGUSR1"]
)
def test_a_signal_to_one_rank_stops_every_rank_at_one_step(
    signal_name: str, workers: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    reference = request.getfixturevalue("reference" if workers else "reference_without_workers")
    plan = {"dir": str(tmp_path), "every_steps": 4, "workers": workers}
    results = _run({**plan, "signal_at": (1, 8, signal_name)})
    stops = [r["preempted"] for r in results]
    assert {s[0] for s in stops} == {signal_name}
    assert {s[1] for s in stops} == {9}  # the step after the one the signal came in
    assert {s[3] for s in stops} == {PREEMPTED_EXIT_CODE}
    assert stops[0][2] == str(tmp_path / "interrupted.pth")
    assert stops[1][2] is None
    saved = load_checkpoint(tmp_path / "interrupted.pth")
    assert saved["kind"] == "interrupted"
    assert saved["position"]["step"] == 9
    results = _run({**plan, "resume": True})
    _assert_same(results, reference, f"stopped by {signal_name}")
    assert results[0]["position"].step == 9
    assert not (tmp_path / "interrupted.pth").exists()  # superseded by later checkpoints


def test_nodes_without_a_shared_disk_resume_from_whichever_holds_the_newest(
    reference_without_workers: Weights, tmp_path: Path
) -> None:
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    _killed({"dirs": dirs, "every_steps": 2, "workers": 0, "kill_at": (1, 9)})
    assert not Path(dirs[1]).exists()  # only rank 0 writes: node 1 has nothing
    results = _run({"dirs": dirs, "every_steps": 2, "workers": 0, "resume": True})
    _assert_same(results, reference_without_workers, "rank 1 was sent the checkpoint")


def test_a_copy_on_each_node_survives_the_loss_of_node_0s_disk(
    reference_without_workers: Weights, tmp_path: Path
) -> None:
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    plan = {"dirs": dirs, "every_steps": 2, "on_each_node": True, "workers": 0, "kill_at": (0, 11)}
    with pytest.raises(RankFailedError):
        run_distributed(faulty_run, 2, args=(plan,), timeout=_TIMEOUT, env={"LOCAL_RANK": "0"})
    assert (Path(dirs[1]) / "step-000000010.pth").exists()
    for path in Path(dirs[0]).iterdir():
        path.unlink()  # node 0's disk is gone
    plan = {"dirs": dirs, "every_steps": 2, "on_each_node": True, "workers": 0, "resume": True}
    results = run_distributed(faulty_run, 2, args=(plan,), timeout=_TIMEOUT,
                              env={"LOCAL_RANK": "0"})  # fmt: skip
    _assert_same(results, reference_without_workers, "resumed from node 1's copy")
    assert results[0]["position"].step == 10


@pytest.fixture(scope="module")
def stopped_with_reads(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """A 2-rank job stopped by SIGTERM after step 9, which recorded each sample it read.

    Its directory (checkpoints and records); each test resumes a copy of it.
    """
    directory = tmp_path_factory.mktemp("stopped")
    record = str(directory / "reads")
    plan = {"dir": str(directory), "workers": 0, "record": record, "signal_at": (0, 8, "SIGTERM")}
    return directory, _run(plan)


@pytest.mark.parametrize("world", [1, 3])
def test_resuming_on_another_number_of_ranks_sees_each_sample_once(
    world: int, stopped_with_reads: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    directory, first = stopped_with_reads
    assert {r["preempted"][1] for r in first} == {9}  # 1.5 epochs of 6 steps: epoch 1, batch 3
    tmp_path = tmp_path / "job"
    shutil.copytree(directory, tmp_path)
    record = str(tmp_path / "reads")
    per_epoch = STEPS_PER_EPOCH * BATCH  # reads of one rank in one epoch
    epoch1_before = [int(x) for r in range(2)
                     for x in Path(f"{record}.2.{r}").read_text().split()[per_epoch:]]  # fmt: skip
    plan = {"dir": str(tmp_path), "workers": 0, "record": record, "resume": True, "epochs": 2}
    results = _run(plan, world)
    for rank, r in enumerate(results):
        assert "error" not in r, r["error"]
        told = [w for w in r["warnings"] if "not bit-exact" in w]
        assert len(told) == (rank == 0), r["warnings"]  # rank 0 says it, once
    # The resumed epoch's record: every sample trained on, on the world sizes it ran on.
    resumed = results[0]["records"][0]
    assert (resumed["epoch"], resumed["train_samples"]) == (2, 48)
    assert resumed["world_sizes"] == [2, world]
    assert resumed["batch_splits"] == [[2, BATCH, 1], [world, BATCH, 1]]
    assert f"world sizes [2, {world}]: steps of other sizes" in epoch_line(resumed)
    after = [
        int(x) for r in range(world) for x in Path(f"{record}.{world}.{r}").read_text().split()
    ]
    assert len(after) == len(set(after)), "a sample was read twice"
    assert not set(after) & set(epoch1_before), "a sample seen before the stop was read again"
    assert set(after) | set(epoch1_before) == set(range(48)), "a sample was skipped"


def test_a_failed_background_write_stops_every_rank_at_the_next_step(tmp_path: Path) -> None:
    results = _run({"dir": str(tmp_path), "every_steps": 2, "fail_write": (0, 2)})
    assert results[0]["error"][0] == "OSError"
    assert "No space left" in results[0]["error"][1]
    assert results[1]["error"][0] == "CheckpointError"
    assert "No space left" in results[1]["error"][1]
    assert results[0]["steps"] == results[1]["steps"]
    assert 4 < results[0]["steps"] <= 7  # the write of step 4 failed; a step or two later
    assert (tmp_path / "step-000000002.pth").exists()  # the checkpoints before it are intact


def test_a_rank_whose_data_stalls_is_named_with_its_stack_and_the_job_exits_124(
    tmp_path: Path,
) -> None:
    timeout, log = 4.0, tmp_path / "log"
    plan = {"dir": str(tmp_path), "stall_at": (1, 8), "hang_timeout": timeout, "workers": 0,
            "log": str(log)}  # fmt: skip
    started = time.monotonic()
    with pytest.raises(RankFailedError, match=f"exited with code {HANG_EXIT_CODE}"):
        _run(plan)
    # Start-up and 8 steps take seconds; the watchdog adds at most its timeout + 30 s.
    assert time.monotonic() - started < 60 + timeout + 30
    rank0 = Path(f"{log}.0").read_text()
    assert "rank(s) 1 stopped at step 8 (waiting for training data)" in rank0, rank0[-3000:]
    stalled = Path(f"{log}.1").read_text()
    assert "stacks of rank 1, all threads:" in stalled, stalled[-3000:]
    dump = stalled.split("stacks of rank 1, all threads:", 1)[1]
    assert re.search(r"fault_jobs\.py\", line \d+, in __getitem__", dump), dump[-3000:]
    assert "stacks of rank 0, all threads:" in rank0


def test_copies_on_each_node_into_one_shared_directory_do_not_collide(
    reference_without_workers: Weights, tmp_path: Path
) -> None:
    # --save-on-each-node with /ckpt on NFS: both nodes' writers write the same files.
    plan = {"dir": str(tmp_path), "every_steps": 2, "on_each_node": True, "workers": 0}
    results = run_distributed(faulty_run, 2, args=(plan,), timeout=_TIMEOUT,
                              env={"LOCAL_RANK": "0"})  # fmt: skip
    _assert_same(results, reference_without_workers, "two writers, one directory")
    latest, previous = (load_checkpoint(tmp_path / n) for n in ("latest.pth", "previous.pth"))
    assert (latest["epoch"], previous["epoch"]) == (EPOCHS - 1, EPOCHS - 2)
    steps = sorted(p.name for p in tmp_path.glob("step-*.pth"))
    assert steps == ["step-000000014.pth", "step-000000016.pth"]
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.fixture(scope="module")
def modern_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Warm-up + cosine per step, EMA, Mixup/CutMix, soft FocalLoss and clipping, uninterrupted."""
    results = _run(
        {"dir": str(tmp_path_factory.mktemp("modern")), "every_steps": 2, "modern": True}
    )
    assert results[0]["steps"] == STEPS_PER_EPOCH * EPOCHS
    return results


def test_the_modern_recipe_resumes_bit_exactly_mid_warm_up_and_mid_epoch(
    modern_reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    # Killed in step 9 of the 9-step warm-up: the newest checkpoint is step 8, 2 batches into
    # epoch 2, with the schedule, the average and the mixing draws all mid-way.
    plan = {"dir": str(tmp_path), "every_steps": 2, "modern": True}
    _killed({**plan, "kill_at": (1, 9)})
    results = _run({**plan, "resume": True})
    assert results[0]["position"].step == 8
    assert results[0]["position"].mid_epoch
    for rank, (result, expected) in enumerate(zip(results, modern_reference, strict=True)):
        assert "error" not in result, result.get("error")
        for part in ("weights", "ema"):
            for key, value in expected[part].items():
                assert torch.equal(result[part][key], value), f"rank {rank}: {part} {key}"


def test_balanced_repeated_draws_with_randaugment_resume_bit_exactly(tmp_path: Path) -> None:
    """Class-balanced draws, each twice on two ranks, RandAugment and Random Erasing on:
    a SIGKILL mid-epoch, then a resume ends with the weights of a run nothing stopped
    (run after the resume in the same processes, to start Python once for both)."""
    plan = {"every_steps": 2, "balanced": True, "workers": 0, "epochs": 2}
    _killed({**plan, "dir": str(tmp_path / "run"), "kill_at": (1, 9)})
    fresh = str(tmp_path / "reference")
    results = run_distributed(
        resumed_then_fresh,
        2,
        args=({**plan, "dir": str(tmp_path / "run"), "fresh": fresh},),
        timeout=_TIMEOUT,
    )
    assert results[0]["fresh_steps"] == STEPS_PER_EPOCH * 2  # 24 draws x 2 copies / 2 ranks / 4
    assert results[0]["position"].step == 8  # resumed mid-epoch 1: 2 of its 6 batches done
    _assert_same(results, [r["reference"] for r in results], "balanced, repeated, RandAugment")
