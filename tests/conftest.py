"""Shared test configuration."""

from __future__ import annotations

import os

import pytest

# Keep each rank to one intra-op thread: the CI machine has two cores and the
# tests run several ranks at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Tests that start several processes of their own (ranks, launchers, the example,
# DataLoader workers): `make test` runs them one at a time after the others, which
# run two at a time with pytest-xdist. Two ranks already fill the two cores of a
# small machine; two such tests side by side would only share them and reach
# their deadlines. A file name covers its tests; "file::test" one test. A new
# test that starts several processes goes here, or takes @pytest.mark.serial.
_SERIAL = (
    "adversarial/test_bad_jobs.py",
    "test_checkpoint.py",
    "test_comm.py",
    "test_control.py",
    "test_devices.py",
    "test_dist.py",
    "test_doc_code.py",
    "test_doctor.py",
    "test_example.py",
    "test_example_faults.py",
    "test_fault_tolerance.py",
    "test_job.py",
    "test_launch.py",
    "test_launchers.py",
    "test_lmdb_dataset.py",
    "test_loaders.py",
    "test_parallel.py",
    "test_per_class.py",
    "test_rank0.py",
    "test_spawn_restarts.py",
    "test_spawning.py",
    "test_testing.py",
    "test_train.py::test_resume_is_bit_exact",
    "test_train.py::test_evaluate_is_exact_across_ranks",
    "test_transfer.py",
    "test_watchdog.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        name = os.path.relpath(str(item.path), tests).replace(os.sep, "/")
        test = f"{name}::{item.name.split('[')[0]}"
        if name in _SERIAL or test in _SERIAL:
            item.add_marker(pytest.mark.serial)
