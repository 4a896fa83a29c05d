"""ddpkit.checkpoint.outcomes: a failed write is raised on every rank, never left behind."""

from __future__ import annotations

import pytest

from ddpkit.checkpoint.background import BackgroundWriter
from ddpkit.checkpoint.outcomes import describe_error, raise_earlier_failure, share_outcome
from ddpkit.checkpoint.serialization import CheckpointError


def test_errors_are_described_and_a_blocking_save_raises_its_own() -> None:
    assert describe_error(None) is None
    assert describe_error(ValueError("bad")) == "ValueError: bad"
    share_outcome(None, "epoch")  # one process, no failure: nothing to say
    with pytest.raises(OSError, match="disk full"):
        share_outcome(OSError("disk full"), "epoch")


def test_an_earlier_failure_on_another_rank_is_raised_here() -> None:
    writer = BackgroundWriter()
    raise_earlier_failure(None, [None, None], writer)  # nobody failed
    said = r"rank 1 could not write its last checkpoint \(OSError: full\)"
    with pytest.raises(CheckpointError, match=said):
        raise_earlier_failure(None, [None, "OSError: full"], writer)
