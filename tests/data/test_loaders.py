"""build_loader: per-process batches, samplers, workers and their seeds, on real ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loader_fixtures import Indices, Noisy, info, left_running
from torch.utils.data import (
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from warm import warm_popen, warm_run  # type: ignore[import-not-found]

from ddpkit.data import DistributedEvalSampler, build_loader, set_epoch
from ddpkit.distributed import comm
from ddpkit.testing import run_distributed


def _loaders_on_each_rank(rank: int, world_size: int) -> dict[str, Any]:
    dataset = Indices(10)
    evaluation = build_loader(dataset, batch_size=4, train=False, workers=0)
    seen = [int(i) for batch in evaluation for i in batch]
    training = build_loader(dataset, batch_size=2, train=True, workers=0, seed=5)
    set_epoch(training, 1)
    trained = [int(i) for batch in training for i in batch]
    return {
        "eval_sampler": type(evaluation.sampler).__name__,
        "eval": comm.all_gather_object(seen),
        "train": comm.all_gather_object(trained),
    }


def test_loaders_split_the_data_across_real_ranks() -> None:
    results = run_distributed(_loaders_on_each_rank, 3, timeout=120)
    first = results[0]
    assert all(r == first for r in results)
    assert first["eval_sampler"] == "DistributedEvalSampler"
    assert sorted(i for part in first["eval"] for i in part) == list(range(10))
    # Training drops the tail that does not divide over 3 ranks: 3 each, all distinct.
    train = [i for part in first["train"] for i in part]
    assert [len(part) for part in first["train"]] == [2, 2, 2]  # one batch of 2 each
    assert len(set(train)) == len(train)


def test_global_batch_is_divided_over_the_ranks() -> None:
    loader = build_loader(Indices(100), global_batch_size=64, train=True, workers=0, info=info())
    assert loader.batch_size == 16
    # Training samplers hand out (epoch, index) pairs around torch's sampler.
    inner = loader.sampler.inner  # type: ignore[attr-defined]
    assert isinstance(inner, DistributedSampler)
    assert (inner.num_replicas, inner.rank) == (4, 1)
    assert inner.shuffle
    assert inner.drop_last
    assert loader.drop_last


def test_global_batch_that_does_not_divide_suggests_neighbours() -> None:
    with pytest.raises(ValueError, match="global_batch_size=100") as err:
        build_loader(Indices(10), global_batch_size=100, train=True, info=info(1, 8, 8))
    assert "96" in str(err.value)
    assert "104" in str(err.value)
    assert "batch_size=12" in str(err.value)
    with pytest.raises(ValueError, match="use 8, or pass batch_size=1"):
        build_loader(Indices(10), global_batch_size=3, train=True, info=info(1, 8, 8))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 4, "global_batch_size": 16}, "exactly one"),
        ({}, "exactly one"),
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"global_batch_size": -4}, "global_batch_size must be at least 1, got -4"),
        ({"batch_size": 4, "workers": -1}, r"workers must be 0\.\.1024, got -1"),
    ],
)
def test_bad_batch_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_loader(Indices(10), train=False, info=info(), **kwargs)


def test_iterable_dataset_is_refused() -> None:
    class Stream(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    with pytest.raises(TypeError, match="map-style"):
        build_loader(Stream(), batch_size=1, train=False)


def test_single_process_samplers_and_defaults() -> None:
    one = info(0, 1, 1)
    train = build_loader(Indices(10), batch_size=3, train=True, workers=0, info=one)
    evaluation = build_loader(Indices(10), batch_size=3, train=False, workers=0, info=one)
    assert isinstance(train.sampler.inner, RandomSampler)  # type: ignore[attr-defined]
    assert train.drop_last
    assert isinstance(evaluation.sampler, SequentialSampler)
    assert not evaluation.drop_last
    assert [len(b) for b in evaluation] == [3, 3, 3, 1]
    assert not train.pin_memory  # info says CPU


def test_batch_size_may_be_passed_by_position() -> None:
    loader = build_loader(Indices(10), 4, train=False, workers=0, info=info(0, 1, 1))
    assert loader.batch_size == 4


def test_eval_loader_on_several_ranks_is_exact_and_keeps_the_tail() -> None:
    loader = build_loader(Indices(10), batch_size=4, train=False, workers=0, info=info(1, 4))
    assert isinstance(loader.sampler, DistributedEvalSampler)
    assert not loader.drop_last
    assert [i for batch in loader for i in batch.tolist()] == [1, 5, 9]


def test_workers_zero_drops_worker_options() -> None:
    loader = build_loader(
        Indices(10),
        batch_size=2,
        train=True,
        workers=0,
        info=info(),
        prefetch_factor=4,
        persistent_workers=True,
        multiprocessing_context="spawn",
    )
    assert loader.num_workers == 0
    assert not loader.persistent_workers
    assert len(list(loader)) == 1  # 10 samples over 4 ranks: 2 each, one batch


def test_worker_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    loader = build_loader(Indices(10), batch_size=2, train=False, info=info(1, 4, 4))
    assert loader.num_workers == 3  # 12 usable CPUs over 4 local processes
    assert loader.persistent_workers
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert build_loader(Indices(10), batch_size=2, train=False).num_workers == 6
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert build_loader(Indices(10), batch_size=2, train=False).num_workers == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert build_loader(Indices(10), batch_size=2, train=False).num_workers == 1


def _first_batches(seed: int, rank: int = 0, world: int = 1) -> list[list[float]]:
    """The first two batches (one from each worker), as [indices, torch, random, numpy]."""
    loader = build_loader(
        Noisy(), batch_size=4, train=True, workers=2, seed=seed, info=info(rank, world, world)
    )
    batches = iter(loader)
    first, second = next(batches), next(batches)
    return [a.tolist() + b.tolist() for a, b in zip(first, second, strict=True)]


def test_worker_randomness_is_reproducible_per_seed_and_rank() -> None:
    first = _first_batches(seed=1)
    assert _first_batches(seed=1) == first
    other = _first_batches(seed=2)
    for a, b in zip(first, other, strict=True):
        assert a != b
    # Same seed on two ranks: different samples and different augmentations.
    rank0, rank1 = _first_batches(seed=1, rank=0, world=2), _first_batches(seed=1, rank=1, world=2)
    assert set(rank0[0]).isdisjoint(rank1[0])
    for a, b in zip(rank0[1:], rank1[1:], strict=True):
        assert a != b
    # The two workers' Python and numpy RNGs are seeded apart, not forked copies.
    for values in first[1:]:
        assert len(set(values)) == len(values)


_GROUP_SIGNAL_JOB = """
import os, signal, sys, time
from loader_fixtures import Pids
from ddpkit.data import build_loader

names, start = sys.argv[1].split(","), sys.argv[2]
if start == "forkserver":  # the user's own preload is kept beside build_loader's
    import multiprocessing
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "loader_fixtures"])
def said(number, frame):
    print("parent got", signal.Signals(number).name, flush=True)
for name in names:
    signal.signal(getattr(signal, name), said)
loader = build_loader(Pids(), batch_size=4, train=True, workers=2, seed=0,
                      multiprocessing_context=start)
batches = iter(loader)
pids = {int(p) for _ in range(4) for p in next(batches)}
if start == "forkserver":
    from multiprocessing import forkserver
    server = forkserver._forkserver._forkserver_pid
    print("server apart", os.getpgid(server) != os.getpgid(0), flush=True)
    print("preload", *forkserver._forkserver._preload_modules, flush=True)
rest = set()
for name in names:  # one after another, a batch read after each
    os.killpg(0, getattr(signal, name))  # what torchrun, Kubernetes and a terminal do
    time.sleep(0.5)  # a worker (or server) that died of it would be reported from here on
    rest |= {int(p) for p in next(batches)}
rest |= {int(p) for batch in batches for p in batch}
print("workers", len(pids), "same", rest == pids, flush=True)
if start == "forkserver":  # the server still starts workers: the next epoch's
    again = build_loader(Pids(), batch_size=4, train=True, workers=1, seed=0,
                         multiprocessing_context=start, persistent_workers=False)
    print("next", len([b for b in again]), flush=True)
# The loader is still alive at exit: the interpreter must still end.
"""

_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("names", "start"), [(_SIGNALS, "fork"), (_SIGNALS, "forkserver"), (("SIGTERM",), "spawn")]
)
def test_workers_outlive_a_signal_to_the_whole_group_and_still_end_at_exit(
    names: tuple[str, ...], start: str
) -> None:
    # A forkserver is the training process's child: without a group of its own the
    # signal killed it, its workers exited and the next batch failed. One job gets each
    # signal in turn: the workers must outlive every one of them.
    done = warm_run(
        [sys.executable, "-c", _GROUP_SIGNAL_JOB, ",".join(names), start], capture_output=True,
        text=True, timeout=90, start_new_session=True,  # a process group of its own to signal
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = [line for line in done.stdout.splitlines() if line.startswith("parent got")]
    assert got == [f"parent got {name}" for name in names], done.stdout
    assert "workers 2 same True" in done.stdout, done.stderr[-3000:]
    if start == "forkserver":
        assert "server apart True" in done.stdout, done.stdout
        preload = "preload ddpkit.data._forkserver_group torch loader_fixtures"
        assert preload in done.stdout, done.stdout
        assert "next 16" in done.stdout, done.stderr[-3000:]


_KILLED_TRAINER_JOB = """
import multiprocessing, os, signal, sys
sys.path.insert(0, sys.argv[2])
from loader_fixtures import Indices
from ddpkit.data import build_loader

start = sys.argv[1]
multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "loader_fixtures"])
loader = build_loader(Indices(64), batch_size=4, train=True, workers=2, seed=0,
                      multiprocessing_context=start)
batches = iter(loader)
next(batches)
pids = [w.pid for w in batches._workers]
if start == "forkserver":
    from multiprocessing import forkserver
    from torch.utils.data import DataLoader
    pids.append(forkserver._forkserver._forkserver_pid)
    # A plain DataLoader's worker from the same server watches only the server.
    plain = iter(DataLoader(Indices(8), num_workers=1, multiprocessing_context="forkserver"))
    next(plain)
    pids += [w.pid for w in plain._workers]
print(*pids, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind
"""


@pytest.mark.timeout(90)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_workers_end_when_the_training_process_is_killed(start: str, tmp_path: Path) -> None:
    # A forkserver's workers are the server's children and hold it open: without
    # build_loader's watch on the training process, and the server's own end with
    # it, they would run for ever. Output to a file: processes left running hold
    # its descriptor, and a pipe would keep this test from their pids.
    tests = os.path.dirname(os.path.abspath(__file__))
    with open(tmp_path / "out", "w+", encoding="utf-8") as out:
        job = warm_popen([sys.executable, "-c", _KILLED_TRAINER_JOB, start, tests],
                         stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        code = job.wait(60)
        out.seek(0)
        printed = out.read()
    assert code == -9, printed[-3000:]
    pids = [int(p) for p in printed.split()]
    assert len(pids) == (4 if start == "forkserver" else 2), printed[-3000:]
    left = left_running(pids, 20)  # torch's workers look at their parent every 5 s
    assert left == [], f"still running after the training process was killed: {left}"


_PRELOAD_JOB = """
import multiprocessing, os, sys
from multiprocessing import forkserver
from ddpkit.data._forkserver_group import keep_forkserver_apart

group = os.getpgid(0)
contexts = {"None": None, "default": multiprocessing.context._default_context}
for name in sys.argv[1:]:
    if name.startswith("ctx:"):
        keep_forkserver_apart(multiprocessing.get_context(name[4:]))
    else:
        keep_forkserver_apart(contexts.get(name, name))
print("preload", *forkserver._forkserver._preload_modules)  # Python's own: __main__
print("method", multiprocessing.get_start_method(allow_none=True))
print("same group", os.getpgid(0) == group)  # imported outside a forkserver: nothing moves
"""


# Python starts workers with a forkserver by default on Linux from 3.14.
_LINUX_314 = sys.version_info >= (3, 14) and sys.platform.startswith("linux")
_BY_DEFAULT = " ddpkit.data._forkserver_group" if _LINUX_314 else ""


@pytest.mark.parametrize(
    ("contexts", "preload"),
    [
        (["fork", "spawn", "ctx:fork", "ctx:spawn"], ""),
        (["forkserver"], " ddpkit.data._forkserver_group"),
        (["ctx:forkserver", "forkserver"], " ddpkit.data._forkserver_group"),  # named once
        (["None", "default"], _BY_DEFAULT),
    ],
)
def test_only_a_forkserver_loader_names_the_group_module(contexts: list[str], preload: str) -> None:
    # Python's default start method is read, never fixed: a later set_start_method still works.
    done = subprocess.run([sys.executable, "-c", _PRELOAD_JOB, *contexts],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [f"preload{preload} __main__", "method None", "same group True"]
    assert done.stdout.splitlines() == lines


_SERVER_CHILD_JOB = """
import multiprocessing
import loader_fixtures

ctx = multiprocessing.get_context("forkserver")
ctx.set_forkserver_preload(["loader_fixtures"])  # a server started without the module
child = ctx.Process(target=loader_fixtures.import_group_module)
child.start()
child.join()
print("child", child.exitcode)
"""


def test_a_process_a_forkserver_forked_keeps_its_group_on_import() -> None:
    # Its stack still holds the server's main(); only the server's own preload moves.
    done = warm_run([sys.executable, "-c", _SERVER_CHILD_JOB],
                    capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["child", "0"], done.stderr[-3000:]
