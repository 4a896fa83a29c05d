"""Shared test configuration."""

from __future__ import annotations

import os

# Keep each rank to one intra-op thread: the CI machine has two cores and the
# tests run several ranks at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
