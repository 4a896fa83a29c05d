"""Shared test configuration: one thread per rank, the helpers importable, the serial tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Keep each rank to one intra-op thread: the CI machine has two cores and the
# tests run several ranks at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ranks of run_distributed fork from a server that imported torch once, not each
# importing it (seconds each); tests/test_testing.py covers both start methods.
os.environ.setdefault("DDPKIT_TEST_START_METHOD", "forkserver")

# tests/helpers holds the job functions and fixtures that test files, spawned
# ranks and child interpreters import by name: on sys.path here, on PYTHONPATH
# for every process a test starts.
HELPERS = str(Path(__file__).resolve().parent / "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
if HELPERS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (HELPERS, os.environ.get("PYTHONPATH")) if p
    )


# Tests that start several processes of their own (ranks, launchers, the example,
# DataLoader workers): `make test` runs them after the others, two files at a time
# (`-n 2 --dist loadfile`): a file's tests share one worker, so a module's shared
# job runs once and the blocks of one markdown page share its one child. Their
# deadlines allow for a busy machine. A file name covers its tests; "file::test"
# one test. A new test that starts several processes goes here, or takes
# @pytest.mark.serial.
_SERIAL = (
    "adversarial/test_bad_jobs.py",
    "checkpoint/test_manager.py",
    "checkpoint/test_sync.py",
    "checkpoint/test_transfer.py",
    "data/test_lmdb_dataset.py",
    "data/test_loaders.py",
    "distributed/test_comm.py",
    "distributed/test_devices.py",
    "distributed/test_doctor.py",
    "distributed/test_hang_report.py",
    "distributed/test_job.py",
    "distributed/test_launchers.py",
    "distributed/test_parallel.py",
    "distributed/test_process_group.py",
    "distributed/test_processes.py",
    "distributed/test_rank0.py",
    "distributed/test_rendezvous.py",
    "distributed/test_spawning.py",
    "distributed/test_spawning_restarts.py",
    "distributed/test_stops.py",
    "distributed/test_watchdog.py",
    "docs/test_doc_code.py",
    "examples/test_seresnext_lmdb.py",
    "examples/test_seresnext_lmdb_faults.py",
    "examples/test_seresnext_setup.py",
    "training/test_trackers.py",
    "test_launch.py",
    "test_testing.py",
    "test_wheel.py",
    "training/test_ema.py",
    "training/test_epoch.py",
    "training/test_evaluation.py",
    "training/test_fault_tolerance.py",
    "training/test_loop.py::test_evaluate_is_exact_across_ranks",
    "training/test_loop.py::test_resume_is_bit_exact",
    "training/test_metrics.py",
    "training/test_stragglers.py::test_a_real_rank_reading_3x_slower_is_named_and_a_balanced_run_names_nobody",
)


@pytest.fixture(autouse=True)
def _forkserver_started(request: pytest.FixtureRequest) -> None:
    """Start run_distributed's forkserver before a multi-process test's clock runs.

    The first run in a pytest process would otherwise count the server's imports
    (seconds, more on a busy machine) in the time a test measures.
    """
    serial = request.node.get_closest_marker("serial") is not None
    if serial and os.environ.get("DDPKIT_TEST_START_METHOD") == "forkserver":
        import multiprocessing

        from ddpkit.distributed.processes import start_forkserver

        start_forkserver(multiprocessing.get_context("forkserver"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", help="also run the tests marked slow (make test-all)"
    )


def pytest_configure(config: pytest.Config) -> None:
    # A long loop whose guarantee a faster test of the default run already covers once
    # (docs/testing.md lists them): left out unless --slow is given.
    config.addinivalue_line("markers", "slow: a longer variant; run only with --slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        name = os.path.relpath(str(item.path), tests).replace(os.sep, "/")
        test = f"{name}::{item.name.split('[')[0]}"
        if name in _SERIAL or test in _SERIAL:
            item.add_marker(pytest.mark.serial)
    if not config.getoption("--slow"):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
