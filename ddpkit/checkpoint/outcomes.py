"""How a save went on every rank: a failed write is raised on all of them, never left behind.

A blocking save gathers each rank's outcome (:func:`share_outcome`); a
background write that failed is reported at the next save or flush on every
rank (:func:`raise_earlier_failure`), so no rank trains on while another's
checkpoint is lost.
"""

from __future__ import annotations

from ddpkit._docs import see
from ddpkit.checkpoint.background import BackgroundWriter
from ddpkit.checkpoint.serialization import CheckpointError
from ddpkit.distributed.comm import all_gather_object, get_rank
from ddpkit.distributed.rank0 import Rank0Error

__all__ = ["describe_error", "raise_earlier_failure", "share_outcome"]


def describe_error(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def raise_earlier_failure(
    mine: BaseException | None, reports: list[str | None], writer: BackgroundWriter
) -> None:
    """Raise, on every rank, a background write that failed on any rank."""
    failed = [(r, text) for r, text in enumerate(reports) if text is not None]
    if not failed:
        return
    if mine is not None:
        writer.wait()  # raises it here, once
    rank, text = failed[0]
    raise CheckpointError(
        f"rank {rank} could not write its last checkpoint ({text}); the checkpoints before "
        "it are intact. " + see("checkpoints")
    )


def share_outcome(error: BaseException | None, kind: str, *, patient: bool = False) -> None:
    """A blocking save: every rank learns whether the writing ranks succeeded.

    ``patient``: the others wait for a slow store, not the process group's timeout.
    """
    report = None if error is None else (type(error).__qualname__, str(error), "")
    verdicts = all_gather_object(report, patient=patient)
    if error is not None:
        raise error
    for rank, verdict in enumerate(verdicts):
        if verdict is None:
            continue
        if rank == 0:
            raise Rank0Error(
                f"rank 0 raised {verdict[0]}: {verdict[1]} (saving the {kind} checkpoint); rank "
                f"{get_rank()} stops too rather than wait for it. Rank 0's traceback has the cause",
                *verdict,
            )
        raise CheckpointError(
            f"rank {rank} could not write its copy of the {kind} checkpoint: "
            f"{verdict[0]}: {verdict[1]}"
        )
