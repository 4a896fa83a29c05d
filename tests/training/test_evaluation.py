"""ddpkit.training.evaluation: evaluate exact over uneven ranks, per-sample losses, model mode."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit.testing import run_distributed
from ddpkit.training.evaluation import evaluate, per_sample

N, CLASSES = 17, 6


class Lookup(nn.Module):
    """Fixed logits per sample index: the metrics are known in advance."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.table = nn.Parameter(torch.randn(N, CLASSES, generator=g))

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.table[index]


def _targets() -> torch.Tensor:
    return torch.randint(0, CLASSES, (N,), generator=torch.Generator().manual_seed(8))


def _batches(indices: list[int], size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    targets = _targets()
    return [(torch.tensor(indices[i : i + size]), targets[indices[i : i + size]])
            for i in range(0, len(indices), size)]  # fmt: skip


# Uneven shares: the last rank of three gets nothing at all.
_SHARES = {
    2: [list(range(12)), list(range(12, N))],
    3: [[5, 0, 9, 3], [*range(10, N), 1, 2, 4, 6, 7, 8], []],
}


def _evaluate_share(rank: int, world_size: int) -> dict[str, Any]:
    batches = _batches(_SHARES[world_size][rank], size=rank + 2)  # batch sizes differ too
    return evaluate(Lookup(), batches, criterion=nn.CrossEntropyLoss(), normalize=None)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_shares_over_ranks_give_the_single_process_figures(world_size: int) -> None:
    assert sorted(i for share in _SHARES[world_size] for i in share) == list(range(N))
    single = evaluate(Lookup(), _batches(list(range(N)), 5), criterion=nn.CrossEntropyLoss(),
                      normalize=None)  # fmt: skip
    logits, targets = Lookup().table.detach(), _targets()
    assert single["samples"] == N
    assert single["acc1"] == pytest.approx(100.0 * float((logits.argmax(1) == targets).sum()) / N)
    assert single["loss"] == pytest.approx(
        float(nn.functional.cross_entropy(logits.double(), targets)), rel=1e-12
    )
    for out in run_distributed(_evaluate_share, world_size, timeout=200):
        for key in ("samples", "acc1", "acc5", "recall", "precision", "confusion",
                    "worst_class", "worst_recall"):  # fmt: skip
            assert out[key] == single[key], key
        assert out["loss"] == pytest.approx(single["loss"], rel=1e-12)


def test_without_a_criterion_the_loss_is_nan_and_the_rest_is_counted() -> None:
    out = evaluate(Lookup(), _batches(list(range(N)), 4), normalize=None)
    assert math.isnan(out["loss"])
    assert out["samples"] == N
    assert 0.0 <= out["acc1"] <= out["acc5"] <= 100.0


def test_a_criterion_without_per_sample_losses_counts_its_mean_per_sample() -> None:
    def mean_only(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, targets)  # no reduction attribute

    batches = _batches(list(range(N)), 5)  # batches of 5, 5, 5 and 2
    out = evaluate(Lookup(), batches, criterion=mean_only, normalize=None)
    exact = evaluate(Lookup(), batches, criterion=nn.CrossEntropyLoss(), normalize=None)
    assert out["loss"] == pytest.approx(exact["loss"], rel=1e-6)


def test_per_sample_copies_the_criterion_and_leaves_the_callers_alone() -> None:
    weight = torch.ones(3)
    criterion = nn.CrossEntropyLoss(weight=weight, reduction="sum")
    losses = per_sample(criterion)
    assert losses is not criterion
    assert criterion.reduction == "sum"
    assert losses.reduction == "none"  # type: ignore[attr-defined]
    assert losses.weight is criterion.weight  # type: ignore[attr-defined]
    already = nn.CrossEntropyLoss(reduction="none")
    assert per_sample(already) is already

    def plain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.sum()

    assert per_sample(plain) is plain


@pytest.mark.parametrize("training", [True, False])
def test_the_models_mode_is_put_back(training: bool) -> None:
    model = Lookup().train(training)
    evaluate(model, _batches([0, 1], 2), normalize=None)
    assert model.training is training


def test_an_empty_loader_counts_no_samples() -> None:
    out = evaluate(Lookup(), [], criterion=nn.CrossEntropyLoss(), normalize=None)
    assert out["samples"] == 0
