"""Checkpoints on an object store, against a real S3 server (moto's, on 127.0.0.1) through s3fs.

No client is mocked: the manager talks to the server as a user's job does, by
``AWS_ENDPOINT_URL``; the proxy of ``s3_fixtures`` slows, refuses (503) and
cuts its connections; kills are real SIGKILLs of a child process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fault_jobs import assert_same_weights, faulty_run, resumed_then_fresh
from s3_fixtures import Proxy, S3Server, environment
from torch import nn

import ddpkit.checkpoint.store as store_module
from ddpkit import RankFailedError
from ddpkit.checkpoint import CheckpointError, CheckpointManager, TrainingState
from ddpkit.checkpoint.store import MANIFESTS, PENDING, check_location, is_url
from ddpkit.testing import run_distributed


@pytest.fixture(scope="module")
def s3() -> Any:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def url(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(store_module, "PAUSES", (0.05, 0.1))
    return f"s3://{s3.bucket()}/run"


def _state(seed: int = 0, width: int = 6) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Linear(width, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return TrainingState(model, optimizer)


def _train(state: TrainingState, value: float) -> None:
    """One optimizer step, then weights that say which save this is."""
    model = state.model
    model(torch.ones(2, model.in_features)).sum().backward()
    state.optimizer.step()
    with torch.no_grad():
        model.weight.fill_(value)


def _weight(state: TrainingState) -> float:
    return float(state.model.weight[0, 0].detach())


def _trained(url: str, local: Path, epochs: int) -> tuple[CheckpointManager, TrainingState]:
    """A fresh run on the store, ``epochs`` epochs saved (``_run``)."""
    state = _state()
    manager = CheckpointManager(url, state=state, local_dir=local)
    manager.claim()
    _run(manager, state, epochs)
    return manager, state


def _objects(s3: S3Server, url: str) -> list[str]:
    root = url.removeprefix("s3://")
    return sorted(key[len(root) + 1 :] for key in s3.fs().find(root))


def _run(
    manager: CheckpointManager, state: TrainingState, epochs: int, step_every: int = 0
) -> None:
    """``epochs`` epochs of 2 steps, a step checkpoint after the first step with ``step_every``."""
    for epoch in range(epochs):
        for batch in range(2):
            _train(state, 10.0 * epoch + batch + 1)
            position = state.position
            state.advance(
                type(position)(epoch, batch + 1, 2 * (batch + 1), position.step + 1, 1),
                loop={"batch": batch},
            )
            if step_every and batch == 0:
                manager.checkpoint("step")
        state.end_epoch(epoch, 1)
        manager.checkpoint("epoch", metrics={"acc1": 50.0 + (epoch % 2) * 10 + epoch})


def test_urls_and_local_paths_are_told_apart() -> None:
    assert all(map(is_url, ["s3://bucket/run", "gs://b/p", "memory://x"]))
    assert not any(map(is_url, ["runs/s3:/x", "/abs/path", "file:///tmp/x"]))
    assert not is_url(Path("s3://bucket/run"))  # pathlib collapsed it already: a local path


def test_a_store_run_has_a_local_directorys_layout_and_a_copy_of_it_resumes(
    url: str, s3: S3Server, tmp_path: Path
) -> None:
    names: dict[str, list[str]] = {}
    for where in (str(tmp_path / "local"), url):
        state = _state()
        options = {"local_dir": tmp_path / "cache"} if is_url(where) else {}
        manager = CheckpointManager(where, prefix="net", keep_last=2, state=state, **options)
        manager.claim()
        manager.directory.mkdir(parents=True, exist_ok=True)  # fit's reporter writes there
        (manager.directory / "metrics.jsonl").write_text('{"run": {"id": "r"}}\n')
        _run(manager, state, 4, step_every=1)
        manager.flush()
        found = _objects(s3, url) if is_url(where) else sorted(os.listdir(where))
        names[where] = [n for n in found if not n.startswith(f"{MANIFESTS}/")]
        if is_url(where):
            assert manager.best() == f"{url}/best.pth"
            assert manager.location == url
    local = sorted(names[str(tmp_path / "local")])
    assert names[url] == local, "the same files under the prefix as in a local directory"
    assert not any(n.startswith(PENDING) for n in _objects(s3, url))
    manifests = [n for n in _objects(s3, url) if n.startswith(f"{MANIFESTS}/")]
    # Those of the checkpoints still held: latest, previous and the two step files.
    assert 1 <= len(manifests) <= 4, manifests
    newest = json.loads(s3.fs().cat_file(f"{url.removeprefix('s3://')}/{sorted(manifests)[-1]}"))
    for name, entry in newest["files"].items():
        assert s3.fs().info(f"{url.removeprefix('s3://')}/{name}")["size"] == entry["size"]
    # A copy of the prefix is a checkpoint directory: resume, torch.load, the records.
    copy = tmp_path / "copy"
    s3.fs().get(url.removeprefix("s3://") + "/", str(copy), recursive=True)
    for name in local:
        if name.endswith(".pth"):
            assert isinstance(torch.load(copy / name, weights_only=True), dict)
    assert (copy / "metrics.jsonl").read_text() == '{"run": {"id": "r"}}\n'
    state = _state(seed=5)
    assert CheckpointManager(copy, state=state).resume() == 4
    assert _weight(state) == 32.0


def test_a_fresh_machine_resumes_bit_exactly_from_the_store(url: str, tmp_path: Path) -> None:
    state = _state()
    manager = CheckpointManager(
        url, state=state, local_dir=tmp_path / "a", every_steps=1, extra={"arch": "net"}
    )
    manager.claim()
    _run(manager, state, 2)
    _train(state, 7.0)
    state.advance(type(state.position)(2, 1, 2, state.position.step + 1, 1), loop={"batch": 0})
    manager.checkpoint("step", block=False)  # mid-epoch, in the writer thread
    manager.flush()
    expected = {k: v.clone() for k, v in state.model.state_dict().items()}
    momentum = [s["momentum_buffer"].clone() for s in state.optimizer.state.values()]
    (tmp_path / "a").rename(tmp_path / "gone")  # the machine is gone with its disk
    fresh = _state(seed=3)
    resumed = CheckpointManager(url, state=fresh, local_dir=tmp_path / "b")
    assert resumed.resume() == 2
    assert (fresh.position.batches, fresh.position.step) == (1, 5)
    for key, value in expected.items():
        assert torch.equal(fresh.model.state_dict()[key], value), key
    for got, want in zip(fresh.optimizer.state.values(), momentum, strict=True):
        assert torch.equal(got["momentum_buffer"], want)
    assert resumed.resumed_checkpoint == f"{url}/step-000000005.pth"
    # What the example compares before a resume, read from the newest manifest.
    assert resumed.newest_extra() == ("step-000000005.pth", {"arch": "net"})


def test_a_file_that_does_not_match_its_manifest_gives_way_to_the_previous_checkpoint(
    url: str, s3: S3Server, tmp_path: Path
) -> None:
    _trained(url, tmp_path / "a", 3)
    root = url.removeprefix("s3://")
    latest = s3.fs().cat_file(f"{root}/latest.pth")
    damaged = latest[:-40] + bytes(40)  # the same size, other bytes: only the checksum tells
    s3.fs().pipe_file(f"{root}/latest.pth", damaged)
    fresh = _state(seed=1)
    with pytest.warns(RuntimeWarning) as caught:
        start = CheckpointManager(url, state=fresh, local_dir=tmp_path / "b").resume()
    said = " ".join(str(w.message) for w in caught)
    assert f"{url}/latest.pth" in said, said
    assert f"{url}/previous.pth" in said, said
    assert (start, _weight(fresh)) == (2, 12.0)
    # The run goes on from there: its next save replaces the damaged file, never rotates it.
    again = CheckpointManager(url, state=fresh, local_dir=tmp_path / "b")
    again.resume()
    _train(fresh, 99.0)
    fresh.end_epoch(2, 1)
    again.checkpoint("epoch", metrics={"acc1": 1.0})
    check = _state(seed=2)
    assert CheckpointManager(url, state=check, local_dir=tmp_path / "c").resume() == 3
    assert _weight(check) == 99.0


def test_a_flaky_store_is_retried_and_a_save_that_finally_fails_touches_no_commit(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = Proxy(s3.port)
    for key, value in s3.env(proxy.endpoint).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(store_module, "PAUSES", (0.05,) * 3)
    url = f"s3://{s3.bucket()}/run"
    state = _state()
    # botocore's own retries left out: each failed request is one of ddpkit's attempts.
    once = {"config_kwargs": {"retries": {"max_attempts": 1}}}
    manager = CheckpointManager(
        url, state=state, local_dir=tmp_path / "a", keep_last=1, storage_options=once
    )
    manager.claim()
    _run(manager, state, 1)
    proxy.fail_next, proxy.cut_next = 1, 2  # a 503, then dropped connections
    _train(state, 5.0)
    state.end_epoch(1, 1)
    manager.checkpoint("epoch", metrics={"acc1": 1.0})
    assert (proxy.fail_next, proxy.cut_next) == (0, 0)
    before = {n: s3.fs().cat_file(f"{url[5:]}/{n}") for n in _objects(s3, url)}
    proxy.fail_next = 10**6  # the store is down for good
    _train(state, 6.0)
    state.end_epoch(2, 1)
    with pytest.raises(OSError, match="failed 4 times"):
        manager.checkpoint("epoch", metrics={"acc1": 2.0})
    proxy.fail_next = 0
    after = {n: s3.fs().cat_file(f"{url[5:]}/{n}") for n in _objects(s3, url)}
    assert {n: after.get(n) for n in before} == before, "nothing committed changed"
    fresh = _state(seed=1)
    assert CheckpointManager(url, state=fresh, local_dir=tmp_path / "b").resume() == 2
    assert _weight(fresh) == 5.0
    proxy.close()


def _kill_at(rank: int, world_size: int, url: str, local: str, kill: Any) -> list[str]:
    """Three saves (epoch, step, epoch); SIGKILL at ``kill``: (request, when)."""
    calls: list[str] = []
    retried, count = store_module.ObjectStore._retried, [0]

    def counted(self: Any, what: str, op: Any) -> Any:
        calls.append(what)
        count[0] += 1
        if kill == (count[0], "before"):
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            return retried(self, what, op)
        finally:  # the request is done, whatever the store answered
            if kill == (count[0], "after"):
                os.kill(os.getpid(), signal.SIGKILL)

    store_module.ObjectStore._retried = counted  # type: ignore[method-assign]
    state = _state()
    manager = CheckpointManager(url, state=state, local_dir=local, keep_last=1, keep_steps=1)
    manager.claim()
    calls.append("claimed")
    for save, kind in enumerate(("epoch", "step", "epoch")):
        _train(state, float(save + 1))
        if kind == "epoch":
            state.end_epoch(save, 1)
            manager.checkpoint("epoch", metrics={"acc1": float(save)})
        else:
            p = state.position
            state.advance(type(p)(p.epoch, 1, 2, p.step + 1, 1), loop={"batch": 0})
            manager.checkpoint(kind)
        calls.append(f"saved {save + 1}")
    return calls


def test_a_kill_at_20_points_of_the_uploads_leaves_a_complete_checkpoint(
    s3: S3Server, tmp_path: Path
) -> None:
    _kill_sweep(s3, tmp_path, 20)


@pytest.mark.slow
def test_a_kill_at_every_point_of_the_uploads_leaves_a_complete_checkpoint(
    s3: S3Server, tmp_path: Path
) -> None:
    _kill_sweep(s3, tmp_path, None)


def _killed_runs(rank: int, world_size: int, runs: list[tuple[str, str, Any]]) -> list[int]:
    """Each ``_kill_at(url, local, kill)`` of ``runs`` in a process forked from this one, whose
    imports are done once; returns how each ended (``-9``: killed, as planned)."""
    import s3fs  # noqa: F401 - imported once, here, not in each run

    ended = []
    for url, local, kill in runs:
        pid = os.fork()
        if pid == 0:  # the run; it returns only if the kill did not come
            try:
                _kill_at(0, 1, url, local, kill)
            finally:
                os._exit(0)
        ended.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    return ended


def _kill_sweep(s3: S3Server, tmp_path: Path, count: int | None) -> None:
    """Kill a run of three saves before or after its k-th request to the store, then resume.

    ``count`` points spread evenly over every request and both sides (None: all of them).
    """
    env = s3.env()
    plan = run_distributed(
        _kill_at, 1, args=(f"s3://{s3.bucket()}/run", str(tmp_path / "dry"), None), init=None,
        env=env, timeout=120,
    )[0]  # fmt: skip
    store_requests = [w for w in plan if w != "claimed" and not w.startswith("saved")]
    assert len(store_requests) >= 10, store_requests
    every = [(k, when) for k in range(1, len(store_requests) + 1) for when in ("before", "after")]
    # Spread evenly, and both sides of every commit.
    commits = [(k, w) for k, w in every if store_requests[k - 1].startswith("committing")]
    rest = [p for p in every if p not in commits]
    spread = rest if count is None else rest[:: max(1, len(rest) // (count - len(commits)))]
    points = sorted(set(commits + spread[: None if count is None else count - len(commits)]))
    urls = [f"s3://{s3.bucket()}/run" for _ in points]
    runs = [(u, str(tmp_path / f"k{k}{w}"), (k, w)) for u, (k, w) in zip(urls, points, strict=True)]
    ended = run_distributed(_killed_runs, 1, args=(runs,), init=None, env=env, timeout=300)[0]
    assert ended == [-signal.SIGKILL] * len(points), list(zip(points, ended, strict=True))
    killed = 0
    for url, (k, when) in zip(urls, points, strict=True):
        what = store_requests[k - 1]
        killed += 1
        # How many manifests had gone up: save n sets the weights to n.
        commits = sum(w.startswith("committing") for w in store_requests[: k - 1])
        commits += what.startswith("committing") and when == "after"
        with environment(s3.env()):
            state = _state(seed=9)
            manager = CheckpointManager(url, state=state, local_dir=tmp_path / f"r{k}{when}")
            manager.resume()
            if commits == 0:
                assert manager.resumed is None, (k, when, what)
            else:
                assert _weight(state) == float(commits), (k, when, what, commits)
            if commits and killed % 4 == 0:
                # The run goes on: one more save, and the layout is whole again.
                _train(state, 50.0)
                state.end_epoch(state.position.epoch, 1)
                manager.checkpoint("epoch", metrics={"acc1": 99.0})
                objects = _objects(s3, url)
                assert not [o for o in objects if o.startswith(PENDING)], objects
                assert manager.store is not None
                for name in manager.store.files:
                    assert name in objects, (k, when, name)
    assert killed == len(points) >= min(20, len(every))


def test_bad_stores_fail_within_seconds_and_name_the_fix(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    started = time.monotonic()
    missing = CheckpointManager("s3://no-such-bucket-here/run", state=_state(), local_dir=tmp_path)
    with pytest.raises(CheckpointError, match="bucket 'no-such-bucket-here' does not exist"):
        missing.claim()
    with pytest.raises(CheckpointError, match="does not exist"):
        missing.resume()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    unreachable = CheckpointManager(f"s3://{s3.bucket()}/run", state=_state(), local_dir=tmp_path)
    with pytest.raises(CheckpointError, match=f"127.0.0.1:{port}.*AWS_ENDPOINT_URL"):
        unreachable.claim()
    assert time.monotonic() - started < 30
    # An endpoint that takes connections and never answers: the check's own deadline.
    silent = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
    black_hole = CheckpointManager(f"s3://{s3.bucket()}/run", local_dir=tmp_path)
    assert black_hole.store is not None
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="did not answer within 1 s"):
        black_hole.store.check(seconds=1)
    assert time.monotonic() - started < 5
    silent.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    status, detail, _ = check_location("s3://no-such-bucket-here/run")
    assert status == "FAIL"
    assert "does not exist" in detail


def test_wrong_credentials_are_refused_before_training(tmp_path: Path) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        port = None
        deadline = time.monotonic() + 30
        assert server.stdout is not None
        while port is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            if "Running on http://127.0.0.1:" in line:
                port = int(line.rsplit(":", 1)[1].strip().split()[0])
        assert port is not None, "moto's server did not start"
        threading.Thread(target=server.stdout.read, daemon=True).start()
        env = {
            "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0",
            "AWS_SECRET_ACCESS_KEY": "wrong",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }
        with environment(env):
            manager = CheckpointManager("s3://bucket/run", state=_state(), local_dir=tmp_path)
            with pytest.raises(CheckpointError, match="refused these credentials"):
                manager.claim()
    finally:
        server.kill()
        server.wait()


def test_a_prefix_holding_another_run_is_refused_and_overwrite_clears_it(
    url: str, s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A torchrun job's workers started again after a server joined (its --rdzv-id in the
    # checkpoints) continue the run even with --overwrite; another job is refused.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    _trained(url, tmp_path / "a", 1)
    again = CheckpointManager(url, state=_state(), local_dir=tmp_path / "a2", overwrite=True)
    assert again.claim() is True
    assert "latest.pth" in _objects(s3, url)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    second = CheckpointManager(url, state=_state(), local_dir=tmp_path / "b")
    with pytest.raises(CheckpointError, match=r"holds another run's checkpoints: latest\.pth"):
        second.claim()
    (s3.fs()).pipe_file(f"{url[5:]}/notes.txt", b"mine")
    third = CheckpointManager(url, state=_state(), local_dir=tmp_path / "c", overwrite=True)
    third.claim()
    assert _objects(s3, url) == ["notes.txt"], "only the run's objects go"
    with pytest.raises(ValueError, match="on_each_node is for local directories"):
        CheckpointManager(url, on_each_node=True)


def _slow_upload(rank: int, world_size: int, url: str, rendezvous: str, local: str) -> float:
    """A save whose upload outlasts the process group's 1-s timeout, training between."""
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=1),
    )  # fmt: skip
    try:
        state = _state(width=16384)
        manager = CheckpointManager(url, state=state, local_dir=f"{local}{rank}")
        manager.claim()
        started = time.monotonic()
        state.end_epoch(0, world_size)
        manager.checkpoint("epoch", block=False)
        for _ in range(10):  # training goes on: collectives while rank 0 uploads
            dist.all_reduce(torch.ones(1))
            time.sleep(0.1)
        state.end_epoch(1, world_size)
        manager.checkpoint("epoch", block=False)  # waits for the first upload, patiently
        manager.flush()
        return time.monotonic() - started
    finally:
        dist.destroy_process_group()


def test_a_slow_upload_times_out_no_collective(s3: S3Server, tmp_path: Path) -> None:
    proxy = Proxy(s3.port)
    proxy.upload_bytes_per_s = 300_000  # 0.6 MB a save: about 2 s each
    url = f"s3://{s3.bucket()}/run"
    env = {**s3.env(proxy.endpoint)}
    took = run_distributed(
        _slow_upload, 2, args=(url, str(tmp_path / "rdzv"), str(tmp_path / "local")),
        init=None, env=env, timeout=120,
    )  # fmt: skip
    assert min(took) > 2.5, took  # longer than the 1-s timeout, and nobody failed
    with environment(s3.env()):
        state = _state(width=16384)
        manager = CheckpointManager(url, state=state, local_dir=tmp_path / "r")
        assert manager.resume(strict_rng=False) == 2
    proxy.close()


def test_fit_killed_mid_epoch_resumes_bit_exactly_on_machines_that_never_held_the_run(
    s3: S3Server, tmp_path: Path
) -> None:
    """fit on 2 ranks, step checkpoints on the store; rank 1 killed in epoch 2; new local disks."""
    url = f"s3://{s3.bucket()}/run"
    plan: dict[str, Any] = {"dir": url, "every_steps": 2, "epochs": 2, "workers": 0,
                            "local_dirs": [str(tmp_path / "a0"), str(tmp_path / "a1")]}  # fmt: skip
    killing = {**plan, "kill_at": (1, 9), "saved_before_kill": 8}
    with pytest.raises(RankFailedError, match="exited with code -9"):
        run_distributed(faulty_run, 2, args=(killing,), env=s3.env(), timeout=120)
    fresh_disks = [str(tmp_path / "b0"), str(tmp_path / "b1")]
    resumed = {**plan, "local_dirs": fresh_disks, "fresh": str(tmp_path / "reference")}
    results = run_distributed(resumed_then_fresh, 2, args=(resumed,), env=s3.env(), timeout=120)
    for result in results:
        assert "error" not in result, result.get("error")
        assert result["steps"] == 12 - 8, "resumed after step 8, mid-epoch, not at an epoch's start"
    reference = [{"weights": r["reference"]} for r in results]
    assert_same_weights(results, reference)


def test_doctor_checks_the_store_and_says_what_run_it_holds(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpkit.cli import main

    _trained(url, tmp_path / "a", 1)
    code = main(["doctor", "--master-addr", "127.0.0.1", "--timeout", "0.2", "--checkpoints", url])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "checkpoints:" in ln)
    assert line.startswith("[ OK ]"), line
    assert "readable and writable; latest.pth (epoch: end of epoch 1" in line, line
    del code  # the other checks (the master port) judge the exit status
    status, detail, fix = check_location("s3://no-such-bucket-z/run")
    assert (status, fix) == (
        "FAIL",
        "see docs/troubleshooting.md#the-object-store-cannot-be-reached",
    )
    assert "bucket 'no-such-bucket-z' does not exist" in detail
    status, detail, _ = check_location(str(tmp_path / "new"))
    assert status == "OK"
    assert detail.endswith("writable; no run yet")


def test_a_manifest_that_cannot_be_read_gives_way_to_the_one_before(
    url: str, s3: S3Server, tmp_path: Path
) -> None:
    _trained(url, tmp_path / "a", 2)
    root = url.removeprefix("s3://")
    newest = sorted(n for n in _objects(s3, url) if n.startswith(f"{MANIFESTS}/"))[-1]
    s3.fs().pipe_file(f"{root}/{newest}", b"{ not json")
    fresh = _state(seed=1)
    with pytest.warns(RuntimeWarning, match="previous complete checkpoint") as caught:
        start = CheckpointManager(url, state=fresh, local_dir=tmp_path / "b").resume()
    assert newest in str(caught[0].message)
    assert (start, _weight(fresh)) == (1, 2.0)  # the commit before: epoch 1's


def test_two_jobs_on_one_prefix_fail_at_the_second_commit(url: str, tmp_path: Path) -> None:
    _trained(url, tmp_path / "a", 1)
    jobs = []
    for side in ("b", "c"):  # two jobs resume the same run
        resumed = _state(seed=1)
        manager = CheckpointManager(url, state=resumed, local_dir=tmp_path / side)
        manager.resume()
        jobs.append((manager, resumed))
    for manager, resumed in jobs[:1]:
        _train(resumed, 5.0)
        resumed.end_epoch(1, 1)
        manager.checkpoint("epoch", metrics={"acc1": 1.0})
    manager, resumed = jobs[1]
    _train(resumed, 6.0)
    resumed.end_epoch(1, 1)
    with pytest.raises(CheckpointError, match="another job commits checkpoints to"):
        manager.checkpoint("epoch", metrics={"acc1": 1.0})
    check = _state(seed=2)
    CheckpointManager(url, state=check, local_dir=tmp_path / "d").resume()
    assert _weight(check) == 5.0, "the first job's commit stands"


def test_copies_in_parts_keep_the_checksum_and_a_failed_copy_is_finished_by_the_resume(
    url: str, s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs.core

    # Every copy in parts, as s3fs copies objects above 150 MiB (dropping their metadata).
    monkeypatch.setattr(s3fs.core, "MANAGED_COPY_THRESHOLD", 1000)
    manager, state = _trained(url, tmp_path / "a", 2)
    meta = s3.fs().metadata(f"{url[5:]}/previous.pth")
    assert manager.store is not None
    assert meta.get("sha256") == manager.store.files["previous.pth"]["sha256"]
    # The copies after the third commit fail: the save says so, and a resume finishes them.
    monkeypatch.setattr(manager.store, "_copy", _failing_copy)
    _train(state, 30.0)
    state.end_epoch(2, 1)
    with pytest.raises(
        OSError, match=r"is committed \(manifest 3\), but finishing the layout failed"
    ):
        manager.checkpoint("epoch", metrics={"acc1": 1.0})
    fresh = _state(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the layout is finished
        assert CheckpointManager(url, state=fresh, local_dir=tmp_path / "b").resume() == 3
    assert _weight(fresh) == 30.0
    objects = _objects(s3, url)
    assert "previous.pth" in objects
    assert s3.fs().cat_file(f"{url[5:]}/latest.pth") != s3.fs().cat_file(f"{url[5:]}/previous.pth")


def _failing_copy(*args: Any) -> None:
    raise OSError("copying failed (injected)")


def test_a_resume_names_a_file_of_the_store_a_local_file_or_is_refused(
    url: str, s3: S3Server, tmp_path: Path
) -> None:
    _trained(url, tmp_path / "a", 2)
    for path, weight in (("previous.pth", 2.0), (f"{url}/latest.pth", 12.0)):
        fresh = _state(seed=1)
        CheckpointManager(url, state=fresh, local_dir=tmp_path / "b").resume(path=path)
        assert _weight(fresh) == weight, path
    copy = tmp_path / "mine.pth"
    copy.write_bytes(s3.fs().cat_file(f"{url[5:]}/previous.pth"))
    fresh = _state(seed=1)
    local = CheckpointManager(url, state=fresh, local_dir=tmp_path / "c")
    local.resume(path=copy)
    assert _weight(fresh) == 2.0
    _train(fresh, 7.0)  # its saves go on after the store's commits
    fresh.end_epoch(1, 1)
    local.checkpoint("epoch", metrics={"acc1": 3.0})
    check = _state(seed=2)
    assert CheckpointManager(url, state=check, local_dir=tmp_path / "e").resume() == 2
    assert _weight(check) == 7.0
    other = f"s3://{s3.bucket()}/elsewhere/latest.pth"
    with pytest.raises(CheckpointError, match=re.escape(f"{other} is not under {url}")):
        CheckpointManager(url, state=_state(), local_dir=tmp_path / "d").resume(path=other)
