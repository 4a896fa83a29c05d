"""Exact distributed classification metrics: sums and counts, reduced once.

Every rank adds up the loss of each of its samples and its correct
predictions; one all-reduce at the end turns those sums into the metrics of
the whole dataset. Averages of per-rank averages are never taken (ranks hold
different numbers of samples), and no collective runs per batch, so ranks
with different batch counts cannot hang each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddpkit import comm

__all__ = ["ClassificationTotals", "topk_correct"]


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...]) -> torch.Tensor:
    """Count, for each ``k`` in ``ks``, the samples whose target is among the top-``k`` logits.

    ``k`` larger than the number of classes counts every sample. Returns an
    int64 tensor of ``len(ks)`` counts on the logits' device (no host sync).
    """
    top = min(max(ks), logits.shape[1])
    predicted = logits.topk(top, dim=1).indices
    hits = predicted.eq(targets.view(-1, 1))
    return torch.stack([hits[:, : min(k, top)].any(dim=1).sum() for k in ks])


@dataclass
class ClassificationTotals:
    """Running sums for top-1 / top-5 accuracy and the mean loss over samples.

    The sums stay on the device (no host sync per batch) in float64.
    """

    device: torch.device
    _sums: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        # loss sum, top-1 correct, top-5 correct, samples
        self._sums = torch.zeros(4, dtype=torch.float64, device=self.device)

    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Add one batch: its logits, targets, and the sum of its per-sample losses."""
        correct = topk_correct(logits.detach(), targets, (1, 5)).to(torch.float64)
        batch = torch.stack(
            [
                loss_sum.detach().to(torch.float64),
                correct[0],
                correct[1],
                torch.tensor(float(targets.numel()), dtype=torch.float64, device=self.device),
            ]
        )
        self._sums += batch

    def reduce(self) -> dict[str, float]:
        """Sum over all ranks and return ``acc1``, ``acc5`` (percent), ``loss``, ``samples``.

        All ranks must call this, or it deadlocks.
        """
        loss, c1, c5, n = comm.all_reduce_sum(self._sums).tolist()
        if n == 0:
            return {"acc1": float("nan"), "acc5": float("nan"), "loss": float("nan"), "samples": 0}
        return {"acc1": 100.0 * c1 / n, "acc5": 100.0 * c5 / n, "loss": loss / n, "samples": int(n)}
