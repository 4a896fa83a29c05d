"""The GPU battery: every CUDA and NCCL path, run by ``make gpu-check`` (and skipped without CUDA).

NCCL through init_distributed, the gradient compression hooks, SyncBN
across ranks, fit with fp16 / bf16 / channels-last / torch.compile killed and
resumed bit-exactly, the flight recorder's NCCL report of a desync, the
example's demo, pinned batches, and decoding on the GPU. Each test has a hard
timeout; those that need two GPUs say so where there is one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_jobs import (
    comm_hooks,
    env_for_determinism,
    fit_on_gpu,
    loader_on_gpu,
    nccl_info,
    sync_bn,
)

import ddpkit
from ddpkit.distributed.hang_report import REPORT_FILE

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU"),
    pytest.mark.timeout(240),
]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")


def _world(wanted: int) -> int:
    return min(wanted, GPUS) or 1


def _spawn(fn: Any, world: int, *args: Any) -> None:
    ddpkit.spawn(fn, world, args=args, backend="nccl")


def test_init_distributed_with_nccl_binds_each_rank_to_its_gpu(tmp_path: Path) -> None:
    world = _world(2)
    _spawn(nccl_info, world, str(tmp_path))
    for rank in range(world):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["backend"] == "nccl"
        assert record["device"] == f"cuda:{rank}"
        assert record["current_device"] == record["local_rank"] == rank
        assert record["sum"] == world * (world + 1) / 2


def test_comm_hooks_run_over_nccl_and_powersgd_resumes_bit_exact(tmp_path: Path) -> None:
    world = _world(2)
    _spawn(comm_hooks, world, str(tmp_path))
    for rank in range(world):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        full = record["None"]["full"]
        assert record["None"]["per_step"] == full
        assert record["bf16"]["per_step"] == record["fp16"]["per_step"] == full / 2
        assert 0 < record["powersgd"]["per_step"] < full
        assert record["loaded"] is None
        assert record["resumed_equal"], record


def test_sync_bn_is_converted_and_steps(tmp_path: Path) -> None:
    _spawn(sync_bn, 1, str(tmp_path))
    got = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert got["sync_bn"] == 1
    assert got["plain_bn"] == 0


@two_gpus
def test_sync_bn_statistics_are_one_process_over_the_whole_batch_and_replicas_agree(
    tmp_path: Path,
) -> None:
    _spawn(sync_bn, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(ranks[1]["weights"][key], value), key
    for got in ranks:
        torch.testing.assert_close(got["running_mean"], got["expected_mean"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["running_var"], got["expected_var"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "plan",
    [
        {"amp": "fp16", "channels_last": True},
        {"amp": "bf16", "channels_last": True},
        {"amp": "bf16", "compile": True},
    ],
    ids=["fp16-channels-last", "bf16-channels-last", "bf16-compile"],
)
def test_fit_on_cuda_killed_mid_epoch_resumes_bit_exact(
    plan: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env_for_determinism().items():
        monkeypatch.setenv(name, value)
    world = _world(2)
    reference = tmp_path / "reference"
    _spawn(fit_on_gpu, world, {**plan, "dir": str(reference)})
    killed = tmp_path / "killed"
    steps = 64 // (8 * world)  # an epoch's optimizer steps
    with pytest.raises(Exception, match=r"-9|SIGKILL|signal 9"):
        _spawn(fit_on_gpu, world, {**plan, "dir": str(killed), "kill_at": (0, steps + 2)})
    _spawn(fit_on_gpu, world, {**plan, "dir": str(killed), "resume": True})
    for rank in range(world):
        want = torch.load(reference / f"weights{rank}.pt", weights_only=True)
        got = torch.load(killed / f"weights{rank}.pt", weights_only=True)
        for key, value in want.items():
            assert torch.equal(got[key], value), f"rank {rank}: {key} ({plan})"


@two_gpus
def test_a_desync_over_nccl_is_named_by_the_flight_recorder(tmp_path: Path) -> None:
    from ddpkit.distributed.rendezvous import free_port

    job = ROOT / "tests" / "helpers" / "hang_jobs.py"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DDPKIT_HANG_BACKEND": "nccl"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(job), "desync", str(r), "2", str(port), "2.0", str(tmp_path)],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    try:
        procs[0].wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    report = tmp_path / REPORT_FILE
    assert report.is_file(), sorted(p.name for p in tmp_path.iterdir())
    text = report.read_text()
    first = text.split("FIRST DISAGREEMENT: process group 0, collective #", 1)[1]
    seq = first.split(":", 1)[0]
    assert f"rank 1: broadcast #{seq}" in first
    assert f"rank 0: all_reduce #{seq}" in first
    assert "hang_jobs.py" in first


def test_the_examples_demo_reaches_its_accuracy_on_the_gpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit.examples.seresnext_lmdb", "--demo", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if "final val acc1" in x)
    acc1 = float(line.split("final val acc1", 1)[1].split("%", 1)[0])
    assert acc1 >= 90.0, line  # 95 % on 2 CPU processes (docs/quickstart.md)


def test_pinned_batches_reach_the_gpu_without_blocking(tmp_path: Path) -> None:
    _spawn(loader_on_gpu, 1, str(tmp_path))
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["pin_memory"] is True
    assert record["pinned"] is True
    assert record["equal"] is True


def test_decoding_on_the_gpu_takes_the_cpu_paths_crops(tmp_path: Path) -> None:
    from lmdb_fixtures import varied_images, write_db

    images = varied_images() * 3
    db = write_db(tmp_path / "v.lmdb", images, [i % 2 for i in range(len(images))], ["a", "b"])
    transform = ddpkit.train_transform(24)
    batches = {}
    for decode in ("tensor", "cuda"):
        data = ddpkit.LazyLMDBDataset(db, transform, decode=decode)  # type: ignore[arg-type]
        loader = ddpkit.build_loader(data, batch_size=7, train=True, workers=0, seed=3)
        batches[decode] = next(iter(loader))
    cpu_images, _ = batches["tensor"]
    encoded, _ = batches["cuda"]
    on_gpu = encoded.decode(torch.device("cuda"))
    assert on_gpu.device.type == "cuda"
    assert on_gpu.shape == cpu_images.shape
    # nvJPEG rounds its IDCT and colour conversion apart from libjpeg-turbo: close, not equal.
    difference = (on_gpu.cpu().float() - cpu_images.float()).abs().mean()
    assert difference < 3.0, difference
    assert encoded.cpu_decoded == 4  # PNG x 2, WebP, BMP
