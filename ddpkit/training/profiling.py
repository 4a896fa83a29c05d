"""A profiler switch: ``torch.profiler`` traces of exactly the steps asked, on the ranks asked.

:class:`StepProfiler` is made by ``fit`` only when ``ReportConfig(profile_steps=)``
is set and this rank is one of ``profile_ranks``; otherwise nothing here runs.
Its :meth:`~StepProfiler.at` is told the step count after each optimizer
step: it starts ``torch.profiler`` when the count reaches the first step
asked, and stops and writes the trace when it reaches the end. The trace is
Chrome-trace JSON (``*.pt.trace.json``): Perfetto (ui.perfetto.dev) opens
it, and TensorBoard's profiler plugin reads the directory.
"""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepProfiler", "peak_memory_mb"]

logger = logging.getLogger("ddpkit")


def peak_memory_mb(device: torch.device) -> float:
    """The peak memory since the last reset: CUDA memory allocated on ``device``, else the RSS.

    On the CPU it is the process's peak resident set so far (the OS keeps no
    per-epoch peak).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


class StepProfiler:
    """Profile optimizer steps ``first`` to ``end - 1`` of this rank into ``directory``.

    Args:
        first, end: the steps, counted over the run as ``fit`` counts them
            (the step checkpoint's ``step``); ``end > first``.
        directory: where ``rank<r>.steps<first>-<end>.pt.trace.json`` goes.
        rank: this rank, in the file name.
        device: CUDA activity is recorded too on a CUDA device.
    """

    def __init__(
        self,
        first: int,
        end: int,
        directory: str | os.PathLike[str],
        rank: int,
        device: torch.device,
    ) -> None:
        self.first, self.end, self.rank = first, end, rank
        self.path = Path(directory) / f"rank{rank}.steps{first}-{end}.pt.trace.json"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._activities = activities
        self._profile: torch.profiler.profile | None = None
        self._span: Any = None  # the open record_function of the step being taken
        self.done = False

    def at(self, step: int) -> None:
        """The run is about to take ``step`` (or just finished ``step - 1``)."""
        if self._profile is None and not self.done and self.first <= step < self.end:
            self._profile = torch.profiler.profile(
                activities=self._activities, record_shapes=True, profile_memory=True
            )
            self._profile.start()
            self._label(step)
        elif self._profile is not None:
            self._unlabel()
            if step >= self.end:
                self.close()
            else:
                self._label(step)

    def _label(self, step: int) -> None:
        """Mark the step in the trace: ``ddpkit step <n>`` spans it, as Perfetto shows it."""
        self._span = torch.profiler.record_function(f"ddpkit step {step}")
        self._span.__enter__()

    def _unlabel(self) -> None:
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None

    def close(self) -> None:
        """Stop and write the trace, if profiling; safe to call again."""
        if self._profile is None:
            return
        self._unlabel()
        profile, self._profile, self.done = self._profile, None, True
        profile.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.path))
        logger.info(
            "rank %d: profile of steps %d-%d written to %s",
            self.rank,
            self.first,
            self.end - 1,
            self.path,
        )
