"""Stragglers: the rank that makes the others wait, named once per epoch, data or compute.

Each rank knows how long it waited for its batches (``data``) and how long the
rest of its epoch took (``compute``, which in synchronous DDP includes waiting
for slower ranks in the gradient all-reduce). :func:`gather_timings` collects
them with one ``all_gather_object`` per epoch, no collective per step;
:func:`find_straggler` (a pure function) names the rank that is more than
``threshold`` slower than the median rank, and why.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Sequence
from typing import Any

from ddpkit.distributed import comm

__all__ = ["THRESHOLD", "find_straggler", "gather_timings", "straggler_text"]

THRESHOLD = 0.10
"""A rank this much slower than the median (a share of the median rank's epoch) is named."""


def gather_timings(
    data_s: float, seconds: float, peak_mb: float = 0.0, dropped: int = 0
) -> list[dict[str, Any]]:
    """Every rank's ``{"host", "data_s", "compute_s", "peak_mb", "dropped"}``, in rank order.

    ``dropped``: the batches the rank's loader held beyond the epoch's agreed end.

    All ranks must call this, or it deadlocks.
    """
    mine = {
        "host": socket.gethostname(),
        "data_s": data_s,
        "compute_s": max(seconds - data_s, 0.0),
        "peak_mb": peak_mb,
        "dropped": dropped,
    }
    return comm.all_gather_object(mine)


def find_straggler(
    timings: Sequence[dict[str, Any]], threshold: float = THRESHOLD
) -> dict[str, Any] | None:
    """The rank more than ``threshold`` slower than the median, or None.

    A rank is slower by the larger of two excesses over the median rank: its
    data wait, and its whole epoch (data + compute). When the ranks step
    together (DDP), the epochs take as long on every rank and the one that
    made the others wait shows in its data wait; where they do not, in its
    epoch. ``"cause"`` is ``"data"`` when the data wait is most of the
    excess, else ``"compute"``.

    Returns:
        None, or ``{"rank", "host", "slower", "cause", "data_share",
        "median_data_share"}``; ``slower`` is the excess as a share of the
        median rank's epoch (0.45: 45 % slower).
    """
    if len(timings) < 2:
        return None
    data = [float(t["data_s"]) for t in timings]
    total = [float(t["data_s"]) + float(t["compute_s"]) for t in timings]
    median_total, median_data = statistics.median(total), statistics.median(data)
    if median_total <= 0:
        return None
    excess = [max(total[r] - median_total, data[r] - median_data) for r in range(len(timings))]
    rank = max(range(len(timings)), key=lambda r: excess[r])
    if excess[rank] <= threshold * median_total:
        return None
    median_share = statistics.median(d / t for d, t in zip(data, total, strict=True) if t > 0)
    return {
        "rank": rank,
        "host": timings[rank].get("host", "?"),
        "slower": excess[rank] / median_total,
        "cause": "data" if data[rank] - median_data >= excess[rank] / 2 else "compute",
        "data_share": data[rank] / total[rank] if total[rank] > 0 else 0.0,
        "median_data_share": median_share,
    }


def straggler_text(found: dict[str, Any]) -> str:
    """``"straggler: rank 5 on host gpu2, 40% slower than the median rank, ..."`` for the line."""
    head = (
        f"straggler: rank {found['rank']} on host {found['host']}, "
        f"{found['slower']:.0%} slower than the median rank"
    )
    if found["cause"] == "data":
        return (
            f"{head}, waiting for data {found['data_share']:.0%} of its time (median rank "
            f"{found['median_data_share']:.0%}): its loader, disk or CPU is slower"
        )
    return f"{head} in compute: its device, CPU share or model path is slower"
