"""Streams through fit on real Gloo ranks: data that end apart, stateful loaders, WebDataset.

Each rank reads a stream of its own length (``tests/helpers/stream_jobs.py``):
every rank stops the epoch after the same step with equal replicas, and says
what it dropped. A SIGKILL mid-epoch and a resume end ``torch.equal`` to a run
nothing stopped, for each kind of loader: torchdata's ``StatefulDataLoader``
with and without workers, a stateful ``IterableDataset`` read in the rank, a
plain stream read again up to its place, and WebDataset shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fault_jobs import assert_same_weights, killed_and_resumed
from stream_jobs import stream_run, write_shards

import ddpkit
from ddpkit import CheckpointError, RankFailedError
from ddpkit.testing import run_distributed

pytest.importorskip("torchdata")
pytest.importorskip("webdataset")

_TIMEOUT = 180
APART = [5, 7]  # batches of each rank's stream: rank 1 holds 2 more


def _run(plan: dict[str, Any], world: int = 2) -> list[dict[str, Any]]:
    return run_distributed(stream_run, world, args=(plan,), timeout=_TIMEOUT)


def _same_replicas(results: list[dict[str, Any]]) -> None:
    for result in results[1:]:
        for key, value in results[0]["weights"].items():
            assert torch.equal(result["weights"][key], value), key


def _killed_and_resumed(plan: dict[str, Any], directory: Path) -> list[dict[str, Any]]:
    """Kill rank 1 in step 9 (mid epoch 2: step 8's checkpoint on disk), then resume."""
    return killed_and_resumed(_run, plan, directory)


_assert_equal = assert_same_weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """2 epochs of a stream without a length, read in each rank, nothing stopped."""
    directory = tmp_path_factory.mktemp("reference")
    return _run({"kind": "stateful-dataset", "batches": APART, "dir": str(directory)})


def test_ranks_whose_unsized_streams_end_apart_stop_each_epoch_after_the_same_step(
    reference: list[dict[str, Any]],
) -> None:
    # Before, rank 0 left the epoch while rank 1 was in DDP's all-reduce: SIGABRT in Gloo.
    _same_replicas(reference)
    for result in reference:
        assert result["steps"] == [1, 2, 3, 4, 5] * 2  # the shorter stream's batches
        assert result["agreements"] >= 2 * 6  # batch by batch: no length to agree on once
        for record in result["records"]:
            assert record["rank_dropped_batches"] == [0, 2]
            assert record["train_samples"] == 2 * 5 * 4
    line = ddpkit.training.reporting.epoch_line(reference[0]["records"][0], 2)
    assert "batches dropped: 2 on rank 1" in line


def test_three_ranks_with_workers_and_accumulation_end_together() -> None:
    # Rank 0 ends in the middle of an accumulation of 2: every rank steps there, once.
    results = _run(
        {"kind": "plain", "batches": [5, 8, 6], "workers": 1, "grad_accum": 2, "epochs": 1},
        world=3,
    )
    _same_replicas(results)
    assert results[0]["steps"] == [2, 4, 5]
    assert results[0]["records"][0]["rank_dropped_batches"] == [0, 3, 1]


def test_loaders_with_a_length_agree_once_an_epoch() -> None:
    results = _run({"kind": "sized", "batches": APART, "epochs": 2})
    _same_replicas(results)
    assert results[0]["steps"] == [1, 2, 3, 4, 5] * 2
    assert results[1]["records"][0]["rank_dropped_batches"] == [0, 2]
    assert all(r["agreements"] == 0 for r in results)  # no agreement per batch


@pytest.mark.parametrize("kind", ["stateful-dataset", "stateful-loader", "plain"])
def test_a_stream_read_in_the_rank_resumes_bit_exact_after_a_kill(
    kind: str, reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    # stateful-*: the loader's place comes back from the checkpoint; plain: read up to it.
    results = _killed_and_resumed({"kind": kind, "batches": APART}, tmp_path)
    assert results[0]["start"].step == 8
    assert results[0]["start"].batches == 3
    assert results[0]["steps"] == [4, 5]
    _assert_equal(results, reference)


@pytest.fixture(scope="module")
def with_workers(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """A StatefulDataLoader with 2 workers per rank: a run nothing stopped, then a killed one."""
    plan = {"kind": "stateful-loader", "batches": APART, "workers": 2}
    reference = _run({**plan, "dir": str(tmp_path_factory.mktemp("ref2"))})
    killed = tmp_path_factory.mktemp("killed2")
    _assert_equal(_killed_and_resumed(plan, killed), reference)
    return reference, killed


def test_a_stateful_dataloader_with_workers_resumes_bit_exact_after_a_kill(
    with_workers: tuple[list[dict[str, Any]], Path],
) -> None:
    reference, _ = with_workers
    _same_replicas(reference)
    assert reference[0]["records"][0]["rank_dropped_batches"] == [0, 2]


def test_a_resume_right_after_a_workers_share_ended_trains_the_rest_once(
    with_workers: tuple[list[dict[str, Any]], Path], tmp_path: Path
) -> None:
    # Rank 0's worker 0 yields its last batch in step 5 of 6: the step-5 checkpoint holds it
    # ended. Its share was trained again on resume (3 steps instead of 1).
    reference, _ = with_workers
    plan = {"kind": "stateful-loader", "batches": APART, "workers": 2, "every_steps": 1}
    plan |= {"dir": str(tmp_path), "kill_at": (1, 6), "saved_before_kill": 5}
    with pytest.raises(RankFailedError, match="exited with code -9"):
        _run(plan)
    results = _run({**plan, "kill_at": None, "resume": True})
    assert results[0]["start"].batches == 5
    assert results[0]["steps"] == [6, 1, 2, 3, 4, 5, 6]
    for key in ("train_samples", "rank_dropped_batches"):
        assert results[0]["records"][0][key] == reference[0]["records"][0][key]
    _assert_equal(results, reference)


def test_a_streams_place_on_another_number_of_ranks_is_refused(
    with_workers: tuple[list[dict[str, Any]], Path],
) -> None:
    _, directory = with_workers
    step = sorted(directory.glob("step-*.pth"))[-1]
    from stream_jobs import make_loader
    from train_jobs import small_net

    model = small_net()
    loader = make_loader("stateful-loader", 20, 0, 0, {})
    with pytest.raises(CheckpointError, match=r"2 rank\(s\) read it, and this job has 1"):
        ddpkit.fit(
            model,
            loader,
            torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=torch.nn.CrossEntropyLoss(),
            epochs=2,
            config=ddpkit.TrainConfig(normalize=None),
            checkpoints=ddpkit.CheckpointManager(directory),
            resume=step,
            report=ddpkit.ReportConfig(progress=False),
        )


def test_webdataset_shards_from_an_lmdb_train_on_two_ranks_and_resume_exactly(
    tmp_path: Path,
) -> None:
    train, _ = ddpkit.make_shapes_dataset(
        tmp_path / "shapes", classes=3, train_per_class=16, val_per_class=1, size=16
    )
    ddpkit.build_lmdb(train, tmp_path / "train.lmdb", progress=False)
    shards = write_shards(str(tmp_path / "train.lmdb"), str(tmp_path / "shards/%04d.tar"), 12)
    assert len(shards) == 4  # 48 samples: rank 0 reads shards 0 and 2, rank 1 shards 1 and 3
    plan = {"kind": "webdataset", "shards": shards, "workers": 0, "every_steps": 2}
    reference = _run({**plan, "dir": str(tmp_path / "ref")})
    _same_replicas(reference)
    assert reference[0]["steps"] == [1, 2, 3, 4, 5, 6] * 2
    results = _killed_and_resumed(plan, tmp_path / "killed")
    _assert_equal(results, reference)


def test_streams_whose_length_differs_per_rank_resume_mid_epoch_exactly(
    tmp_path: Path,
) -> None:
    # Each rank's stream has a length of its own (split by node, with a length): the position
    # recorded rank 0's and rank 1 alone refused its own as changed data.
    plan = {"kind": "stateful-sized", "batches": APART}
    reference = _run({**plan, "dir": str(tmp_path / "reference")})
    results = _killed_and_resumed(plan, tmp_path / "killed")
    assert results[0]["start"].data_sizes == (20, 28)
    assert results[0]["start"].batches == 3
    _assert_equal(results, reference)


def test_a_rank_reading_out_its_longer_stream_is_not_called_hung() -> None:
    # Rank 1 holds 6 batches more, read slowly (3.6 s) after the agreed end, to count them.
    plan = {"kind": "plain", "batches": [3, 9], "slow_from": [12, 12], "hang_timeout": 1.5}
    results = _run({**plan, "epochs": 1})
    assert results[1]["records"][0]["rank_dropped_batches"] == [0, 6]
    _same_replicas(results)
