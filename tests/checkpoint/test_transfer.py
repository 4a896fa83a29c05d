"""A checkpoint's state sent from one rank to real Gloo ranks, in chunks."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.checkpoint.transfer import broadcast_state
from ddpkit.testing import run_distributed

WORLD = 3
TIMEOUT = 120.0
DEFAULT_CHUNK = 64 * 2**20
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def _checkpoint_state() -> dict[str, Any]:
    """What a resumed job loads: model, optimizer after a step, RNG states, metrics, odd tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    grid = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tied = torch.tensor([1.0, 2.0, 3.0])
    dtypes: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        values = torch.arange(-5, 6)
        if dtype == torch.bool:
            dtypes[str(dtype)] = values % 2 == 0
        elif dtype.is_complex:
            dtypes[str(dtype)] = torch.complex(values * 0.5, -values * 1.5).to(dtype)
        elif dtype.is_floating_point:
            extremes = torch.tensor([-0.0, math.inf, -math.inf, 1e-3])
            dtypes[str(dtype)] = torch.cat([values * 0.25, extremes]).to(dtype)
        else:
            dtypes[str(dtype)] = values.to(dtype)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": ("cpu", torch.get_rng_state()), "python": random.Random(0).getstate()},
        "epoch": 3,
        "best": 0.8125,
        "finished": False,
        "note": None,
        "arch": "resnet18",
        "blob": b"\x00\xffraw bytes",
        "metrics": {
            "history": [{"loss": 1.5, "acc": torch.tensor(0.25)}, (1, 2.5, "x", torch.ones(2))],
            "empty_dict": {},
            "empty_list": [],
            "ordered": OrderedDict([("z", torch.tensor([9])), ("a", 1)]),
        },
        "dtypes": dtypes,
        "shapes": {
            "scalar": torch.tensor(7.5),
            "bool_scalar": torch.tensor(True),
            "empty": torch.empty(0, 5),
            "empty_int": torch.zeros(3, 0, dtype=torch.int64),
            "transposed": grid.t(),
            "every_other_column": grid[:, ::2],
            "offset_rows": grid[1:3],
            "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
            "conjugate": torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64).conj(),
        },
        "tied": (tied, tied),
        "big": torch.randn(3000),  # 12,000 bytes: spans many small chunks
    }


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)


def _distinct(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _distinct(_tensors(tree)))


def _assert_same(got: Any, want: Any, path: str = "state") -> None:
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.device.type == "cpu", path
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert torch.equal(got, want), path
        if want.is_floating_point():  # torch.equal takes -0.0 for 0.0
            assert torch.equal(torch.signbit(got), torch.signbit(want)), path
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys or their order differ"
        assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), path
        for key in want:
            _assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{path}.{i}")
    else:
        assert got == want, path


def _independent(tree: Any) -> bool:
    """Each tensor owns its storage, and flipping one's bytes changes no other."""
    tensors = [t for t in _distinct(_tensors(tree)) if t.numel()]
    if any(t.untyped_storage().nbytes() != t.numel() * t.element_size() for t in tensors):
        return False
    raw = [t.view(-1).view(torch.uint8) for t in tensors]
    before = [r.clone() for r in raw]
    for i, r in enumerate(raw):
        r.bitwise_not_()
        changed = [not torch.equal(s, b) for s, b in zip(raw, before, strict=True)]
        r.copy_(before[i])
        if changed != [j == i for j in range(len(raw))]:
            return False
    return True


def _send(rank: int, world_size: int, src: int, chunk_bytes: int) -> dict[str, Any]:
    """Job: src sends the checkpoint state; record every chunk broadcast broadcast_state makes."""
    sizes: list[tuple[int, str]] = []
    storages: set[int] = set()
    real_broadcast = dist.broadcast

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # broadcast_object_list calls c10d's own broadcast, so only the chunks land here.
        sizes.append((tensor.numel(), str(tensor.dtype)))
        storages.add(tensor.untyped_storage().data_ptr())
        return real_broadcast(tensor, *args, **kwargs)

    state = _checkpoint_state() if rank == src else None
    dist.broadcast = recording
    try:
        out = broadcast_state(state, src, chunk_bytes=chunk_bytes)
    finally:
        dist.broadcast = real_broadcast
    return {
        "state": out,
        "same_object": out is state,
        "chunks": sizes,
        "buffers": len(storages),
        "independent": rank == src or _independent(out),
        "tied_kept": out["tied"][0] is out["tied"][1],
    }


@pytest.mark.parametrize(
    ("src", "chunk_bytes"),
    [(0, 1000), (WORLD - 1, 1000), (WORLD - 1, 7), (0, DEFAULT_CHUNK)],
    ids=["src0-1000B", "last-1000B", "last-7B", "src0-default"],
)
def test_state_reaches_every_rank_in_chunks(src: int, chunk_bytes: int) -> None:
    reports = run_distributed(_send, WORLD, args=(src, chunk_bytes), timeout=TIMEOUT)
    sent = reports[src]["state"]
    total = _nbytes(sent)
    assert "momentum_buffer" in sent["optimizer"]["state"][0]
    assert total > 10_000
    expected_chunks = math.ceil(total / chunk_bytes)
    for rank, report in enumerate(reports):
        _assert_same(report["state"], sent, f"rank {rank}")
        assert report["same_object"] is (rank == src)
        assert report["independent"], f"rank {rank} got tensors that share memory"
        assert report["tied_kept"], f"rank {rank} split one tensor object in two"
        chunks = report["chunks"]
        assert len(chunks) == expected_chunks
        assert all(dtype == "torch.uint8" and 1 <= n <= chunk_bytes for n, dtype in chunks)
        assert sum(n for n, _ in chunks) == total
        assert report["buffers"] == 1, "every chunk must reuse one buffer"
        assert chunks == reports[src]["chunks"]
    if chunk_bytes < 1000:  # odd sizes: pieces start mid-element
        assert total % chunk_bytes != 0


class _FailsOnLastRank:
    """Unpickles on every rank but the last: a receiver that cannot rebuild the state."""

    def __reduce__(self) -> tuple[Callable[[], _FailsOnLastRank], tuple[()]]:
        return _rebuild_unless_last_rank, ()


def _rebuild_unless_last_rank() -> _FailsOnLastRank:
    if dist.get_rank() == dist.get_world_size() - 1:
        raise MemoryError("simulated: no room for the state")
    return _FailsOnLastRank()


def _outcome(call: Callable[[], Any]) -> str:
    try:
        out = call()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"ok {out!r}"


def _edge_cases(rank: int, world_size: int) -> dict[str, Any]:
    """Job: failures on one rank raise on all of them, and the group stays usable."""
    chunks: list[int] = []
    real_broadcast = dist.broadcast

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        chunks.append(tensor.numel())
        return real_broadcast(tensor, *args, **kwargs)

    def on_src(state: Any) -> Any:
        return state if rank == 1 else None

    dist.broadcast = counting
    try:
        no_data = broadcast_state(on_src({"e": torch.empty(0, 4), "n": [1, "a"]}), 1)
    finally:
        dist.broadcast = real_broadcast
    sparse = torch.eye(3).to_sparse()
    return {
        "no_data": no_data,
        "no_data_chunks": chunks,
        "src_too_big": _outcome(lambda: broadcast_state(None, world_size)),
        "src_negative": _outcome(lambda: broadcast_state(None, -1)),
        "chunk_zero": _outcome(lambda: broadcast_state(None, 0, chunk_bytes=0)),
        "sparse": _outcome(lambda: broadcast_state(on_src({"w": sparse}), 1)),
        "unpicklable": _outcome(lambda: broadcast_state(on_src({"f": lambda: 0}), 1)),
        "receiver": _outcome(lambda: broadcast_state(on_src([_FailsOnLastRank()]), 1)),
        "after": broadcast_state(on_src({"t": torch.arange(5)}), 1, chunk_bytes=3),
    }


@pytest.fixture(scope="module")
def edge_reports() -> list[dict[str, Any]]:
    return run_distributed(_edge_cases, WORLD, timeout=TIMEOUT)


def test_a_tree_without_tensor_bytes_needs_no_chunks(edge_reports: list[dict[str, Any]]) -> None:
    for report in edge_reports:
        assert report["no_data_chunks"] == []
        _assert_same(report["no_data"], {"e": torch.empty(0, 4), "n": [1, "a"]})


def test_bad_arguments_raise_on_every_rank_of_a_group(
    edge_reports: list[dict[str, Any]],
) -> None:
    for report in edge_reports:
        assert report["src_too_big"].startswith(f"ValueError: broadcast_state: src={WORLD} ")
        assert report["src_negative"].startswith("ValueError: broadcast_state: src=-1 ")
        assert report["chunk_zero"].startswith("ValueError: broadcast_state: chunk_bytes=0 ")


def test_a_failure_on_src_raises_on_every_rank(edge_reports: list[dict[str, Any]]) -> None:
    for report in edge_reports:
        assert report["sparse"].startswith("RuntimeError: broadcast_state: rank 1 could not send")
        assert "sparse_coo tensor" in report["sparse"]
        assert report["unpicklable"].startswith("RuntimeError: broadcast_state: rank 1 could not")
        assert "lambda" in report["unpicklable"]


def test_a_failure_on_a_receiver_raises_on_every_rank(
    edge_reports: list[dict[str, Any]],
) -> None:
    for rank, report in enumerate(edge_reports):
        message = report["receiver"]
        assert message.startswith(
            f"RuntimeError: broadcast_state: rank {WORLD - 1} could not rebuild the state "
            "that rank 1 sent"
        )
        assert ("MemoryError: simulated" in message) is (rank == WORLD - 1)


def test_the_group_stays_in_step_after_failures(edge_reports: list[dict[str, Any]]) -> None:
    for report in edge_reports:
        _assert_same(report["after"], {"t": torch.arange(5)})


def test_without_a_group_the_state_comes_back_as_is() -> None:
    assert not dist.is_initialized()
    state = _checkpoint_state()
    assert broadcast_state(state, 0) is state
    assert broadcast_state(state, 0, chunk_bytes=1, device="cpu") is state
    assert broadcast_state(None, 0) is None


def _alone(rank: int, world_size: int) -> tuple[bool, str]:
    state = {"w": torch.ones(3)}
    return broadcast_state(state, 0) is state, _outcome(lambda: broadcast_state(state, 1))


def test_a_group_of_one_returns_the_state_as_is() -> None:
    [(same, bad_src)] = run_distributed(_alone, 1, timeout=TIMEOUT)
    assert same
    assert bad_src.startswith("ValueError: broadcast_state: src=1 is not a rank of this job of 1")


@pytest.mark.parametrize("src", [-1, 1, "0", True, 0.0, None])
def test_bad_src_is_refused(src: Any) -> None:
    with pytest.raises(ValueError, match=rf"src={src!r} is not a rank of this job of 1"):
        broadcast_state({"a": 1}, src)


@pytest.mark.parametrize("chunk_bytes", [0, -1, 1.5, True, "64"])
def test_bad_chunk_bytes_is_refused(chunk_bytes: Any) -> None:
    with pytest.raises(ValueError, match=rf"chunk_bytes={chunk_bytes!r} must be a positive int"):
        broadcast_state({"a": 1}, 0, chunk_bytes=chunk_bytes)
