"""The recipe's own loader resumed: ``DataLoader(sampler=DistributedSampler)`` with augmentation.

A loop of one's own (``StepGuard``) keeps its plain ``DataLoader``; each
sample's augmentation comes from the torch RNG of the process that reads it,
the rank (no workers) or a worker seeded when the epoch's iterator starts. A
SIGKILL in the middle of epoch 2 and a resume end ``torch.equal`` to a run
nothing stopped, on 2 real Gloo ranks, with 0 and 2 workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fault_jobs import assert_same_weights, killed_and_resumed
from train_jobs import plain_loader_run

from ddpkit.testing import run_distributed

_TIMEOUT = 180


def _run(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return run_distributed(plain_loader_run, 2, args=(plan,), timeout=_TIMEOUT)


@pytest.mark.parametrize(
    ("sampler", "workers"), [("distributed", 0), ("distributed", 2), ("random", 0)]
)
def test_a_plain_dataloader_resumes_bit_exact(sampler: str, workers: int, tmp_path: Path) -> None:
    # The rest of the epoch drew other augmentation (and a RandomSampler another order): the
    # resumed iterator drew its seeds from the restored RNG, its workers from those.
    plan = {"workers": workers, "sampler": sampler}
    reference = _run({**plan, "dir": str(tmp_path / "reference")})
    results = killed_and_resumed(_run, plan, tmp_path / "killed", kill_at=(1, 8))
    assert results[0]["start"] == 7
    assert_same_weights(results, reference)
    assert results[0]["said"] == []  # exact: nothing to warn of


def test_workers_that_persist_between_epochs_are_said_not_to_resume_exactly(
    tmp_path: Path,
) -> None:
    plan = {"workers": 2, "persistent": True, "dir": str(tmp_path), "epochs": 1}
    _run(plan)
    results = _run({**plan, "resume": True})  # from the end: the resume alone is what is said
    (said,) = results[0]["said"]
    assert "does not resume bit-exactly" in said
    assert "persistent_workers=True" in said
    assert "latest.pth" in said
    assert results[1]["said"] == []  # once, on rank 0
