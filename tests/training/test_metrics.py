"""Per-class recall, precision and confusion matrix: exact over ranks, checked by torchmetrics."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import build_loader, evaluate
from ddpkit.testing import run_distributed
from ddpkit.training.metrics import per_class

CLASSES, SAMPLES = 5, 61  # 61: the two ranks hold 31 and 30 samples


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    y[y == 4] = 3  # class 4 has no samples: its recall is undefined
    return TensorDataset(x, y)


def _model() -> nn.Module:
    torch.manual_seed(1)
    model = nn.Linear(8, CLASSES)
    with torch.no_grad():
        model.bias[2] = -100.0  # class 2 is never predicted: its precision is undefined
    return model


def _evaluate_on(rank: int, world_size: int) -> dict[str, Any]:
    loader = build_loader(_data(), batch_size=7, train=False, workers=0)
    return evaluate(_model(), loader, criterion=nn.CrossEntropyLoss(), normalize=None)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_evaluate_on, 2, timeout=90)


def test_the_ranks_agree_and_count_every_sample_once(two_ranks: list[dict[str, Any]]) -> None:
    a, b = (dict(r, images_per_sec=None) for r in two_ranks)  # timed per rank
    assert a == b
    assert a["samples"] == SAMPLES
    assert sum(map(sum, a["confusion"])) == SAMPLES
    one = _evaluate_on(0, 1)  # one process, no process group
    assert one["confusion"] == a["confusion"]
    assert one["recall"] == a["recall"]
    assert one["precision"] == a["precision"]


def test_the_figures_are_torchmetrics_figures(two_ranks: list[dict[str, Any]]) -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    x, y = _data().tensors
    with torch.no_grad():
        predicted = _model()(x).argmax(1)
    kw = {"num_classes": CLASSES}
    confusion = torchmetrics.classification.MulticlassConfusionMatrix(**kw)(predicted, y)
    recall = torchmetrics.classification.MulticlassRecall(average=None, **kw)(predicted, y)
    precision = torchmetrics.classification.MulticlassPrecision(average=None, **kw)(predicted, y)
    ours = two_ranks[0]
    assert ours["confusion"] == confusion.tolist()
    support, hits = confusion.sum(1), confusion.sum(0)
    for c in range(CLASSES):
        # torchmetrics reports 0 where a class has no samples (or no predictions); we say None.
        if support[c] == 0:
            assert ours["recall"][c] is None
        else:
            assert ours["recall"][c] == pytest.approx(100 * recall[c].item())
        if hits[c] == 0:
            assert ours["precision"][c] is None
        else:
            assert ours["precision"][c] == pytest.approx(100 * precision[c].item())
    accuracy = torchmetrics.classification.MulticlassAccuracy(average="micro", **kw)(predicted, y)
    assert ours["acc1"] == pytest.approx(100 * accuracy.item())
    assert ours["recall"][4] is None
    assert ours["precision"][2] is None


def test_per_class_from_a_confusion_matrix() -> None:
    confusion = torch.tensor([[3, 1, 0], [0, 0, 0], [2, 0, 4]])
    figures = per_class(confusion)
    assert figures["recall"] == [75.0, None, pytest.approx(400 / 6)]
    assert figures["precision"] == [60.0, 0.0, 100.0]
    assert figures["worst"] == 2  # the lowest recall among classes with samples


def test_targets_outside_the_classes_count_in_no_class() -> None:
    from ddpkit.training.metrics import ClassificationTotals

    totals = ClassificationTotals(torch.device("cpu"))
    logits = torch.eye(3)[[0, 1, 2, 0, 1]] * 5.0  # predicts 0, 1, 2, 0, 1
    targets = torch.tensor([0, 1, -100, 3, 2])  # an ignore_index and a label past the head
    totals.update(logits, targets, torch.tensor(0.0))
    figures = totals.reduce()
    assert figures["confusion"] == [[1, 0, 0], [0, 1, 0], [0, 1, 0]]
    assert figures["recall"] == [100.0, 100.0, 0.0]
