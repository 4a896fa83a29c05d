"""Exact distributed classification metrics: sums and counts, reduced once.

Every rank adds up the loss of each of its samples, its correct predictions
and its per-class counts; all-reduces at the end (the totals, then the
counts) turn those sums into the metrics of the whole dataset. Averages of
per-rank averages are never taken (ranks hold different numbers of samples),
and no collective runs per batch, so ranks with different batch counts cannot
hang each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ddpkit.distributed import comm

__all__ = ["CONFUSION_MAX_CLASSES", "ClassificationTotals", "per_class", "topk_correct"]


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...]) -> torch.Tensor:
    """Count, for each ``k`` in ``ks``, the samples whose target is among the top-``k`` logits.

    ``k`` larger than the number of classes counts every sample. Returns an
    int64 tensor of ``len(ks)`` counts on the logits' device (no host sync).
    """
    top = min(max(ks), logits.shape[1])
    predicted = logits.topk(top, dim=1).indices
    hits = predicted.eq(targets.view(-1, 1))
    return torch.stack([hits[:, : min(k, top)].any(dim=1).sum() for k in ks])


# Above this many classes the C x C confusion matrix (8 * C**2 bytes, all-reduced)
# is left out; per-class recall and precision need only 3 * C counts.
CONFUSION_MAX_CLASSES = 1000


@dataclass
class ClassificationTotals:
    """Running sums for top-1 / top-5 accuracy, the mean loss, and per-class counts.

    The sums stay on the device (no host sync per batch): the totals in
    float64, the per-class counts (hits, samples, predictions, and the
    confusion matrix up to :data:`CONFUSION_MAX_CLASSES` classes) in int64.
    """

    device: torch.device
    _sums: torch.Tensor = field(init=False)
    _counts: torch.Tensor | None = field(init=False, default=None)
    _classes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        # loss sum, top-1 correct, top-5 correct, samples
        self._sums = torch.zeros(4, dtype=torch.float64, device=self.device)

    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Add one batch: its logits, targets, and the sum of its per-sample losses."""
        logits = logits.detach()
        correct = topk_correct(logits, targets, (1, 5)).to(torch.float64)
        batch = torch.stack(
            [
                loss_sum.detach().to(torch.float64),
                correct[0],
                correct[1],
                torch.tensor(float(targets.numel()), dtype=torch.float64, device=self.device),
            ]
        )
        self._sums += batch
        classes = logits.shape[1]
        if self._counts is None:
            self._classes = classes
            self._counts = torch.zeros(_count_size(classes), dtype=torch.int64, device=self.device)
        truth, predicted = targets.reshape(-1).long(), logits.argmax(1).reshape(-1)
        c = self._classes
        # A target outside the classes (an ignore_index such as -100) counts in no class;
        # weights instead of a boolean selection: no host sync per batch.
        valid = (truth >= 0) & (truth < c)
        truth = truth.clamp(0, c - 1)
        weight = valid.long()
        self._counts[:c].index_add_(0, truth, weight * (predicted == truth))
        self._counts[c : 2 * c].index_add_(0, truth, weight)
        self._counts[2 * c : 3 * c].index_add_(0, predicted, weight)
        if c <= CONFUSION_MAX_CLASSES:
            self._counts[3 * c :].index_add_(0, truth * c + predicted, weight)

    def reduce(self) -> dict[str, Any]:
        """Sum over all ranks: ``acc1``, ``acc5`` (percent), ``loss``, ``samples``, per class.

        Per class (lists indexed by class, percent, None where undefined):
        ``recall`` (the class's accuracy) and ``precision``; ``confusion``
        (rows: true class, columns: predicted; up to
        :data:`CONFUSION_MAX_CLASSES` classes); ``worst_class`` and
        ``worst_recall`` (the lowest recall among classes with samples).
        Two all-reduces: the totals with the class count (a rank that saw no
        batch learns it), then the counts. All ranks must call this, or it
        deadlocks.
        """
        seen = torch.tensor(
            [float(self._classes), float(self._counts is not None)],
            dtype=torch.float64,
            device=self.device,
        )
        total = comm.all_reduce_sum(torch.cat([self._sums, seen])).tolist()
        loss, c1, c5, n, classes, ranks = total
        out: dict[str, Any]
        if n == 0:
            out = {"acc1": float("nan"), "acc5": float("nan"), "loss": float("nan"), "samples": 0}
        else:
            out = {
                "acc1": 100.0 * c1 / n,
                "acc5": 100.0 * c5 / n,
                "loss": loss / n,
                "samples": int(n),
            }
        if ranks == 0:
            return out
        c = round(classes / ranks)
        counts = self._counts
        if counts is None:  # this rank saw no batch: its counts are zeros
            counts = torch.zeros(_count_size(c), dtype=torch.int64, device=self.device)
        counts = comm.all_reduce_sum(counts).cpu()
        figures = _per_class_from_counts(counts[:c], counts[c : 2 * c], counts[2 * c : 3 * c])
        out.update(figures)
        if c <= CONFUSION_MAX_CLASSES:
            out["confusion"] = counts[3 * c :].view(c, c).tolist()
        return out


def _count_size(classes: int) -> int:
    return 3 * classes + (classes * classes if classes <= CONFUSION_MAX_CLASSES else 0)


def per_class(confusion: torch.Tensor) -> dict[str, Any]:
    """Recall and precision per class (percent, None where undefined) from a confusion matrix.

    ``confusion[t, p]`` counts samples of class ``t`` predicted as ``p``.
    ``worst`` is the class with the lowest recall among those with samples.
    """
    figures = _per_class_from_counts(confusion.diagonal(), confusion.sum(1), confusion.sum(0))
    return {
        "recall": figures["recall"],
        "precision": figures["precision"],
        "worst": figures["worst_class"],
    }


def _per_class_from_counts(
    hits: torch.Tensor, samples: torch.Tensor, predicted: torch.Tensor
) -> dict[str, Any]:
    recall = [
        100.0 * h / s if s else None for h, s in zip(hits.tolist(), samples.tolist(), strict=True)
    ]
    precision = [
        100.0 * h / p if p else None for h, p in zip(hits.tolist(), predicted.tolist(), strict=True)
    ]
    scored = [(r, k) for k, r in enumerate(recall) if r is not None]
    worst = min(scored)[1] if scored else None
    return {
        "recall": recall,
        "precision": precision,
        "worst_class": worst,
        "worst_recall": recall[worst] if worst is not None else None,
    }
