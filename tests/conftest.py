"""Shared test configuration: one thread per rank, the helpers importable, the serial tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

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


# Tests that start several processes of their own (ranks, launchers, the example, DataLoader
# workers). `make test` runs the whole suite on three workers (`-n 3 --dist loadgroup`): the tests
# of one such file go to one worker as one group (pytest_xdist_make_scheduler below), so a
# module's shared job runs once and the blocks of one markdown page share its one child; every
# other test goes wherever a worker is free. Their deadlines allow for a busy machine. A file name
# covers its tests; "file::test" one test. A new test that starts several processes goes here.
_SERIAL = (
    "adversarial/test_bad_jobs.py",
    "adversarial/test_bad_trackers.py",
    "checkpoint/test_manager.py",
    "checkpoint/test_store.py::test_a_kill_at_20_points_of_the_uploads_leaves_a_complete_checkpoint",
    "checkpoint/test_store.py::test_a_kill_at_every_point_of_the_uploads_leaves_a_complete_checkpoint",
    "checkpoint/test_store.py::test_a_slow_upload_times_out_no_collective",
    "checkpoint/test_store.py::test_fit_killed_mid_epoch_resumes_bit_exactly_on_machines_that_never_held_the_run",
    "checkpoint/test_store.py::test_wrong_credentials_are_refused_before_training",
    "checkpoint/test_restore.py::test_a_hook_changed_between_save_and_resume_is_said_once",
    "checkpoint/test_sync.py",
    "checkpoint/test_transfer.py",
    "data/test_lmdb_dataset.py",
    "data/test_loaders.py",
    "distributed/test_comm.py",
    "distributed/test_compression.py",
    "distributed/test_devices.py",
    "distributed/test_doctor.py",
    "distributed/test_hang_report.py",
    "distributed/test_job.py",
    "distributed/test_launchers.py",
    "distributed/test_membership.py::test_a_global_batch_that_a_world_the_job_can_have_does_not_divide_is_refused",
    "distributed/test_membership.py::test_a_server_that_alone_differs_is_refused_on_every_rank_and_its_agent_stopped",
    "distributed/test_membership.py::test_outside_an_elastic_job_the_ranks_agree_on_a_problem_and_refuse_no_server",
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
    "examples/test_own_loop.py",
    "examples/test_seresnext_lmdb.py",
    "examples/test_seresnext_lmdb_faults.py",
    "examples/test_seresnext_setup.py",
    "training/test_trackers.py",
    "test_comm_benchmark.py",
    "test_launch.py",
    "test_testing.py",
    "test_warm.py",
    "test_wheel.py",
    "training/test_ema.py",
    "training/test_epoch.py",
    "training/test_evaluation.py",
    "training/test_fault_tolerance.py",
    "training/test_guard.py",
    "training/test_loop.py::test_evaluate_is_exact_across_ranks",
    "training/test_loop.py::test_resume_is_bit_exact",
    "training/test_metrics.py",
    "training/test_plain_loader_resume.py",
    "training/test_streaming.py",
    "training/test_stragglers.py::test_a_real_rank_reading_3x_slower_is_named_and_a_balanced_run_names_nobody",
)

# Long multi-process tests that are each a group of their own: a worker runs each alone, so
# they can run side by side (mostly waiting: for a rendezvous, a lost server, a paced epoch).
_ALONE = (
    "distributed/test_membership.py::test_a_server_leaves_and_joins_across_two_hosts_each_sample_once",
    "distributed/test_membership.py::test_a_join_with_other_settings_is_refused_and_the_others_go_on",
    "distributed/test_membership.py::test_a_server_leaves_and_joins_on_the_loopback_each_sample_once",
    "examples/test_seresnext_comm.py::test_bf16_and_powersgd_learn_digits_as_well",
)

# The longest groups, longest first (their seconds on the 2-core machine, docs/testing.md):
# they start first, and the short tests fill in after them, so the workers end
# together instead of one finishing a long group alone. Then the other groups, then
# every single test, each in the order collected.
_LONGEST_FIRST = (
    *_ALONE,
    "examples/test_seresnext_lmdb_faults.py",
    "training/test_fault_tolerance.py",
    "docs/quickstart.md",
    "examples/test_own_loop.py",
    "distributed/test_watchdog.py",
    "adversarial/test_bad_jobs.py",
    "examples/test_seresnext_lmdb.py",
    "distributed/test_spawning.py",
    "distributed/test_spawning_restarts.py",
    "checkpoint/test_store.py",
    "training/test_loop.py",
    "test_testing.py",
    "distributed/test_process_group.py",
    "test_launch.py",
    "docs/data.md",
)


@pytest.fixture(autouse=True, scope="module")
def _forkserver_started(request: pytest.FixtureRequest) -> None:
    """Start run_distributed's forkserver before a multi-process module's first job.

    Module-scoped and autouse, so it comes before the module's shared jobs
    (module fixtures) as well as its tests: the first run in a pytest process
    would otherwise count the server's imports (seconds, more on a busy
    machine) in the time a test measures, and the ranks of a job started
    before it could not start their DataLoader workers from it
    (``warm.share_server``).
    """
    here = request.node.path
    serial = any(
        item.path == here and item.get_closest_marker("serial") is not None
        for item in request.session.items
    )
    if serial and os.environ.get("DDPKIT_TEST_START_METHOD") == "forkserver":
        from warm import start_server  # type: ignore[import-not-found]

        start_server()  # run_distributed's modules, and the example's for tests/helpers/warm.py


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", help="also run the tests marked slow (make test-all)"
    )


def pytest_configure(config: pytest.Config) -> None:
    # A long loop whose guarantee a faster test of the default run already covers once
    # (docs/testing.md lists them): left out unless --slow is given.
    config.addinivalue_line("markers", "slow: a longer variant; run only with --slow")
    # The GPU battery (tests/gpu): skipped without CUDA; `make gpu-check` runs it on a GPU.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; run by make gpu-check")


def _group(nodeid: str) -> str | None:
    """The group a multi-process test runs in (its file, or its markdown page), else None.

    From the test's id alone: xdist's controller, which hands out the groups,
    sees ids, not items.
    """
    name, _, test = nodeid.split("@")[0].partition("::")
    name = name.removeprefix("tests/")
    if f"{name}::{test}" in _ALONE:
        return f"{name}::{test}"
    if name not in _SERIAL and f"{name}::{test.split('[')[0]}" not in _SERIAL:
        return None
    if name == "docs/test_doc_code.py" and test.startswith("test_doc_block_runs["):
        return test[len("test_doc_block_runs[") : -1].rsplit(":", 1)[0]  # the block's page
    return name


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: each group to one worker, every other test on its own.

    xdist's own ``xdist_group`` marks do not reach its scheduler under pytest 9.2
    (they rename ``item._nodeid``, which ``nodeid`` no longer reads), so the
    groups come from :func:`_group`.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _Groups(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid) or nodeid

    return _Groups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {item.nodeid: _group(item.nodeid) for item in items}
    for item in items:
        if groups[item.nodeid] is not None:
            item.add_marker(pytest.mark.serial)
    if not config.getoption("--slow"):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    # The scheduler (--no-loadscope-reorder) hands out the groups in the order of their
    # first test: the longest first, then the other groups, then every single test.
    rank = {group: i for i, group in enumerate(_LONGEST_FIRST)}
    order = {item.nodeid: i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int, int]:
        group = groups[item.nodeid]
        if group is None:
            return (2, 0, order[item.nodeid])
        return (0 if group in rank else 1, rank.get(group, 0), order[item.nodeid])

    items.sort(key=key)
