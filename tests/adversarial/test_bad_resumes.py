"""Resumes that cannot be right: other data, an impossible position, malformed RNG states,
another model, a file that is not a checkpoint. Each is a ``CheckpointError`` naming the file,
the field and what to do, on every rank; nothing trains on silently.

Kinds: the training set (bigger, smaller, same size other labels); every field of a step
checkpoint's position (missing, wrong type, negative, out of range, at odds with another, with
the loader); the kind; the ``rng`` entry (every malformed shape); the model (keys missing,
unexpected, shapes); the resume path (weights, a directory, an image, metrics.jsonl, random
bytes, nothing).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit import (
    CheckpointError,
    CheckpointManager,
    DistInfo,
    FaultConfig,
    ReportConfig,
    TrainConfig,
    build_loader,
    fit,
    load_checkpoint,
    save_checkpoint,
    wrap_ddp,
)
from ddpkit.checkpoint import TrainingState
from ddpkit.testing import run_distributed


class _Blobs(Dataset[tuple[torch.Tensor, int]]):
    """``n`` learnable samples of 3 classes; ``seed`` draws other labels."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (n,), generator=g)
        self.base = torch.randn(n, 8, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.base[index], int(self.labels[index])


def _net(width: int = 8, classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, classes))


def _fit(
    rank: int,
    world: int,
    directory: str,
    data: Dataset[Any],
    epochs: int,
    resume: bool | str = False,
    model: nn.Module | None = None,
    on_data_change: str = "error",
) -> list[dict[str, Any]]:
    info = DistInfo(rank, rank, world, world, 0, torch.device("cpu"), "gloo", world > 1)
    net = wrap_ddp(model if model is not None else _net())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = build_loader(data, batch_size=4, train=True, workers=0, seed=5, info=info)
    history = fit(
        net,
        loader,
        optimizer,
        criterion=nn.CrossEntropyLoss(),
        epochs=epochs,
        checkpoints=CheckpointManager(directory, every_steps=2, keep_steps=100),
        resume=resume,
        config=TrainConfig(normalize=None),
        report=ReportConfig(progress=False),
        faults=FaultConfig(stop_signals=(), on_data_change=on_data_change),
    )
    return history.records


def _step_file(directory: Path) -> Path:
    """A mid-epoch checkpoint of the first epoch (its second step checkpoint)."""
    return sorted(directory.glob("step-*.pth"))[1]


# -- the training set changed ------------------------------------------------------------------


def _changed_data_job(
    rank: int, world: int, directory: str, n: int, seed: int, option: str
) -> tuple[str | None, list[tuple[int, int]]]:
    """Train one epoch on 96 samples, then resume a mid-epoch checkpoint on other data."""
    _fit(rank, world, directory, _Blobs(96), epochs=1)
    step = str(_step_file(Path(directory)))
    try:
        records = _fit(rank, world, directory, _Blobs(n, seed), 2, step, on_data_change=option)
    except CheckpointError as exc:
        return str(exc), []
    return None, [(r["epoch"], r["train_samples"]) for r in records]


@pytest.mark.parametrize(
    ("n", "seed", "said"),
    [
        (120, 0, "had 96 samples then and has 120 now"),
        (30, 0, "had 96 samples then and has 30 now"),
        (96, 1, "has the same 96 samples but a different index"),
    ],
    ids=["bigger", "smaller", "relabelled"],
)
def test_a_mid_epoch_resume_on_other_data_is_refused(
    tmp_path: Path, n: int, seed: int, said: str
) -> None:
    error, records = _changed_data_job(0, 1, str(tmp_path), n, seed, "error")
    assert error is not None, records
    assert said in error
    assert "step-" in error
    assert str(tmp_path) in error
    assert "Resume with the data it was saved with" in error
    assert "on_data_change='next_epoch'" in error
    assert "--on-data-change next-epoch" in error


def test_the_same_data_resumes_mid_epoch(tmp_path: Path) -> None:
    error, records = _changed_data_job(0, 1, str(tmp_path), 96, 0, "error")
    assert error is None
    assert records[0][0] == 1
    assert records[-1] == (2, 96)


@pytest.mark.parametrize("n", [120, 30])
def test_the_explicit_option_resumes_at_the_next_epoch_boundary(tmp_path: Path, n: int) -> None:
    with pytest.warns(RuntimeWarning, match="the rest of epoch 1 is skipped"):
        error, records = _changed_data_job(0, 1, str(tmp_path), n, 0, "next_epoch")
    assert error is None
    assert records == [(2, n - n % 4)]  # all of epoch 2 on the new data (whole batches of 4)


def test_two_gloo_ranks_refuse_other_data_and_take_the_option(tmp_path: Path) -> None:
    said = run_distributed(
        _changed_data_job, 2, args=(str(tmp_path / "a"), 120, 0, "error"), timeout=240
    )
    for error, _ in said:
        assert error is not None
        assert "had 96 samples then and has 120 now" in error
    went = run_distributed(
        _changed_data_job, 2, args=(str(tmp_path / "b"), 30, 0, "next_epoch"), timeout=240
    )
    assert [records for _, records in went] == [[(2, 24)], [(2, 24)]]  # 3 steps of 4 x 2


def _one_rank_changed_job(
    rank: int, world: int, directory: str, seed: int, option: str
) -> tuple[str | None, list[tuple[int, int]]]:
    """``_changed_data_job`` where only rank 1's data changed (120 samples, or relabelled)."""
    n = 120 if rank == 1 and seed == 0 else 96
    return _changed_data_job(rank, world, directory, n, seed if rank == 1 else 0, option)


@pytest.mark.parametrize("seed", [0, 1], ids=["bigger", "relabelled"])
def test_data_changed_on_one_rank_is_the_same_verdict_on_every_rank(
    tmp_path: Path, seed: int
) -> None:
    # Each rank judged its own data: rank 1 alone refused (or moved on) and the other hung.
    said = run_distributed(
        _one_rank_changed_job, 2, args=(str(tmp_path / "a"), seed, "error"), timeout=240
    )
    errors = [error for error, _ in said]
    assert errors[0] is not None
    assert errors[0] == errors[1]
    assert "on rank 1, the training set" in errors[0]
    went = run_distributed(
        _one_rank_changed_job, 2, args=(str(tmp_path / "b"), seed, "next_epoch"), timeout=240
    )
    assert went[0][1] == went[1][1]
    assert went[0][1][0][0] == 2


def test_a_checkpoint_without_the_data_fields_still_resumes(tmp_path: Path) -> None:
    _fit(0, 1, str(tmp_path), _Blobs(96), epochs=1)
    step = _step_file(tmp_path)
    state = load_checkpoint(step)
    for key in ("data_size", "data_digest"):
        del state["position"][key]
    save_checkpoint(state, step)
    records = _fit(0, 1, str(tmp_path), _Blobs(96), 2, str(step))
    assert records[0]["epoch"] == 1
    assert records[-1]["epoch"] == 2


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match="on_data_change must be 'error' or 'next_epoch'"):
        FaultConfig(on_data_change="skip")


# -- an impossible position --------------------------------------------------------------------

_POSITION_CASES: list[tuple[str, Any, str]] = [
    ("epoch", -1, "epoch is -1, below its least value 0"),
    ("epoch", "1", "epoch is '1' (str), not an int"),
    ("epoch", 1.0, "epoch is 1.0 (float), not an int"),
    ("epoch", None, "epoch is None (NoneType), not an int"),
    ("epoch", True, "epoch is True (bool), not an int"),
    ("batches", -3, "batches is -3, below its least value 0"),
    ("batches", [2], "batches is [2] (list), not an int"),
    ("samples", -5, "samples is -5, below its least value 0"),
    ("samples", 0, "batches=4 and samples=0 disagree"),
    ("samples", 2.5, "samples is 2.5 (float), not an int"),
    ("step", -7, "step is -7, below its least value 0"),
    ("step", "x", "step is 'x' (str), not an int"),
    ("world_size", 0, "world_size is 0, below its least value 1"),
    ("world_size", -2, "world_size is -2, below its least value 1"),
    ("world_size", 2, "its world_size is 1 but its position's world_size is 2"),
    ("data_size", -1, "data_size is -1, below its least value 0"),
    ("data_size", "96", "data_size is '96' (str), not an int"),
    ("data_digest", 5, "data_digest is 5, not a digest string"),
    ("data_digest", "", "data_digest is '', not a digest string"),
]


@pytest.fixture(scope="module")
def _trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One epoch of 48 samples (12 batches of 4) with step checkpoints, shared by the corpus."""
    directory = tmp_path_factory.mktemp("trained")
    _fit(0, 1, str(directory), _Blobs(48), epochs=1)
    return directory


@pytest.fixture
def tampered(_trained: Path, tmp_path: Path) -> Callable[[Callable[[Any], Any]], Path]:
    """A copy of a mid-epoch checkpoint with ``change(state)`` applied."""

    def make(change: Callable[[Any], Any]) -> Path:
        step = _step_file(_trained)
        state = load_checkpoint(step)
        change(state)
        bad = tmp_path / "bad" / step.name
        bad.parent.mkdir()
        save_checkpoint(state, bad)
        return bad

    return make


@pytest.mark.parametrize(
    ("field", "value", "said"), _POSITION_CASES, ids=[f"{f}={v!r}" for f, v, _ in _POSITION_CASES]
)
def test_every_field_of_the_position_is_checked(
    tmp_path: Path, tampered: Any, field: str, value: Any, said: str
) -> None:
    bad = tampered(lambda state: state["position"].__setitem__(field, value))
    assert load_checkpoint(bad)["position"][field] == value
    with pytest.raises(CheckpointError) as info:  # the file named
        CheckpointManager(tmp_path / "x", state=TrainingState(_net())).resume(path=bad)
    assert str(bad) in str(info.value), str(info.value)
    assert said in str(info.value), str(info.value)
    with pytest.raises(CheckpointError, match="position") as scanned:  # the directory scanned
        CheckpointManager(bad.parent, state=TrainingState(_net())).resume()
    assert bad.name in str(scanned.value)
    assert said in str(scanned.value)


@pytest.mark.parametrize("field", ["epoch", "batches", "samples", "step", "world_size"])
def test_a_missing_field_of_the_position_is_named(
    tmp_path: Path, tampered: Any, field: str
) -> None:
    bad = tampered(lambda state: state["position"].pop(field))
    with pytest.raises(CheckpointError, match=f"the position lacks its '{field}' field"):
        CheckpointManager(tmp_path / "x", state=TrainingState(_net())).resume(path=bad)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (None, "the position is a NoneType, not a dict of fields"),
        ([1, 2, 3], "the position is a list, not a dict of fields"),
        ("epoch=1", "the position is a str, not a dict of fields"),
    ],
)
def test_a_position_that_is_not_a_dict_is_named(
    tmp_path: Path, tampered: Any, value: Any, said: str
) -> None:
    bad = tampered(lambda state: state.__setitem__("position", value))
    with pytest.raises(CheckpointError, match=said):
        CheckpointManager(tmp_path / "x", state=TrainingState(_net())).resume(path=bad)


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("bogus", "its kind is 'bogus', not one of 'step', 'interrupted', 'epoch'"),
        (None, "its kind is None"),
        ("epoch", "it is an epoch end but its position is mid-epoch"),
    ],
)
def test_the_kind_is_checked(tmp_path: Path, tampered: Any, kind: Any, said: str) -> None:
    bad = tampered(lambda state: state.__setitem__("kind", kind))
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path / "x", state=TrainingState(_net())).resume(path=bad)
    assert said in str(info.value)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("batches", 1000, "batches is 1000, but an epoch of this training loader has 12"),
        (
            "samples",
            10_000,
            "samples is 10000, but an epoch of this training loader takes at most 48",
        ),
    ],
)
def test_a_position_beyond_the_loaders_epoch_is_refused(
    tmp_path: Path, tampered: Any, field: str, value: int, said: str
) -> None:
    bad = tampered(lambda state: state["position"].__setitem__(field, value))
    with pytest.raises(CheckpointError) as info:
        _fit(0, 1, str(tmp_path / "y"), _Blobs(48), 2, str(bad))
    assert said in str(info.value)
    assert str(bad) in str(info.value)


# -- malformed RNG states ----------------------------------------------------------------------


def _rng(value: Any) -> Callable[[Any], Any]:
    return lambda state: state.__setitem__("rng", value)


def _part(name: str, value: Any) -> Callable[[Any], Any]:
    """Set one part of rank 0's RNG state (``...``: remove it)."""

    def change(state: Any) -> None:
        entry = state["rng"][0]
        if value is ...:
            del entry[name]
        else:
            entry[name] = value(entry[name]) if callable(value) else value

    return change


_RNG_CASES: list[tuple[str, Any, str]] = [
    ("empty", _rng([]), "holds 0 RNG state(s), but 1 rank(s)"),
    ("none", _rng(None), "its 'rng' field is None, not a list"),
    ("a-dict", _rng({"0": 1}), "not a list of one RNG state"),
    ("two", lambda s: s.__setitem__("rng", s["rng"] * 2), "holds 2 RNG state(s), but 1 rank(s)"),
    ("entry-none", _rng([None]), "entry 0 (rank 0's): the RNG state is None"),
    ("entry-int", _rng([7]), "the RNG state is 7, not"),
    ("no-python", _part("python", ...), "lacks ['python']"),
    ("no-torch", _part("torch", ...), "lacks ['torch']"),
    ("python-short", _part("python", lambda v: v[:2]), "'python' part"),
    ("python-str", _part("python", "x"), "'python' part is 'x'"),
    ("python-floats", _part("python", (3, (1.5,), None)), "'python' part"),
    ("numpy-short", _part("numpy", lambda v: v[:3]), "'numpy' part"),
    ("numpy-float-key", _part("numpy", ("MT19937", torch.zeros(3), 0, 0, 0.0)), "'numpy' part"),
    ("numpy-none", _part("numpy", None), "'numpy' part is None"),
    ("torch-float", _part("torch", torch.zeros(4)), "'torch' part is a torch.float32 tensor"),
    ("torch-list", _part("torch", [1, 2]), "'torch' part is [1, 2]"),
    ("cuda-str", _part("cuda", "gpu"), "'cuda' part is 'gpu'"),
    ("cuda-floats", _part("cuda", [torch.zeros(2)]), "'cuda' part"),
]


@pytest.mark.parametrize(("case", "change", "said"), _RNG_CASES, ids=[c for c, _, _ in _RNG_CASES])
def test_every_malformed_rng_entry_is_named(
    tmp_path: Path, tampered: Any, case: str, change: Any, said: str
) -> None:
    bad = tampered(change)
    before = torch.get_rng_state()
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path / "x", state=TrainingState(_net())).resume(path=bad)
    message = str(info.value)
    assert str(bad) in message, message
    assert "rng" in message.lower(), message
    assert said in message, message
    assert torch.equal(torch.get_rng_state(), before)  # nothing restored halfway


def _rng_job(rank: int, world: int, path: str) -> str:
    try:
        CheckpointManager(Path(path).parent / "x", state=TrainingState(_net())).resume(path=path)
    except CheckpointError as exc:
        return str(exc)
    return "resumed"


def test_an_empty_rng_list_is_named_on_every_rank(tmp_path: Path, tampered: Any) -> None:
    bad = tampered(lambda state: state.__setitem__("rng", []))
    for message in run_distributed(_rng_job, 2, args=(str(bad),), timeout=120):
        assert "its 'rng' field holds 0 RNG state(s)" in message, message


# -- another model -----------------------------------------------------------------------------


def _other_model_job(rank: int, world: int, directory: str) -> str:
    _fit(rank, world, directory, _Blobs(48), epochs=1)
    try:
        _fit(rank, world, directory, _Blobs(48), 2, True, model=_net(classes=5))
    except CheckpointError as exc:
        return str(exc)
    return "resumed"


@pytest.mark.parametrize("world", [1, 2])
def test_another_model_names_the_file_keys_and_shapes(tmp_path: Path, world: int) -> None:
    said = run_distributed(_other_model_job, world, args=(str(tmp_path),), timeout=240)
    for message in said:
        assert str(tmp_path / "latest.pth") in message, message
        assert "saved from another model than this one (Sequential)" in message
        assert "2.weight (file [3, 16], model [5, 16])" in message
        assert "2.bias (file [3], model [5])" in message
        assert "Error(s) in loading state_dict" not in message
        assert "--arch" in message
        assert "load_pretrained" in message


def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    _fit(0, 1, str(tmp_path), _Blobs(48), epochs=1)
    other = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path, state=TrainingState(other)).resume()
    message = str(info.value)
    assert "missing from the file (2): 4.weight, 4.bias" in message, message
    assert "shapes differ: 2.weight (file [3, 16], model [16, 16])" in message


# -- a path that is not a checkpoint -----------------------------------------------------------


def _png(path: Path) -> None:
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))


@pytest.mark.parametrize(
    ("name", "make", "said"),
    [
        (
            "best.pth",
            lambda p: shutil.copy(p.parent / "model-epoch1.pth", p),
            "holds a model's weights alone",
        ),
        ("model-epoch1.pth", None, "the example's --pretrained PATH"),
        ("run", lambda p: p.mkdir(), "it is a directory; pass a file in it, such as"),
        ("curves.png", _png, "it is an image (the learning curves ddpkit plot draws)"),
        (
            "metrics.jsonl",
            lambda p: p.write_text('{"epoch": 1}\n'),
            "it is a text file (metrics.jsonl",
        ),
        ("noise.pth", lambda p: p.write_bytes(os.urandom(512)), "it is not a ddpkit checkpoint ("),
        # Random bytes that happen to start like JSON are not text.
        ("brace.pth", lambda p: p.write_bytes(b"{" + os.urandom(511)), "not a ddpkit checkpoint ("),
        ("nothing.pth", lambda p: None, "there is no such file"),
    ],
)
def test_a_resume_path_that_is_not_a_checkpoint_says_what_it_is(
    tmp_path: Path, name: str, make: Any, said: str
) -> None:
    _fit(0, 1, str(tmp_path), _Blobs(48), epochs=1)
    path = tmp_path / name
    if make is not None:
        make(path)
    assert name != "best.pth" or path.is_file()
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path / "other", state=TrainingState(_net())).resume(path=path)
    message = str(info.value)
    assert f"resume: {path} is not a checkpoint on any rank: on rank 0 " in message
    assert said in message, message
    assert "latest.pth, interrupted.pth or step-*.pth" in message
