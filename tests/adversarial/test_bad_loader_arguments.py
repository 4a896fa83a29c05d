"""``build_loader`` given every kind of wrong argument: a TypeError or ValueError naming it.

Checked before anything is built, so no half-made DataLoader is left behind to
print "Exception ignored in __del__" at exit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loader_fixtures import Indices

from ddpkit.data import build_loader

GOOD: dict[str, Any] = {"batch_size": 2, "train": True, "workers": 0}
# Per argument: values of the wrong type (TypeError) and of the wrong size (ValueError).
WRONG_TYPE: dict[str, list[Any]] = {
    "batch_size": [True, 2.0, "2", 1.5],
    "global_batch_size": [True, 4.0, "4"],
    "train": ["yes", 1, 0, None, np.bool_(True)],
    "workers": [True, 1.0, "2"],
    "seed": [True, 1.5, "1", None],
    "drop_last": ["no", 1, 0.0],
    "pin_memory": ["no", 1],
    "persistent_workers": ["yes", 0],
    "prefetch_factor": [True, 2.0, "2"],
    "collate_fn": ["stack", 3],
    "info": ["rank0", 0],
    "dataset": [object(), 5],
}
WRONG_SIZE: dict[str, list[Any]] = {
    "batch_size": [0, -1, -(2**70)],
    "global_batch_size": [0, -4],
    "workers": [-1, 1025, 2**70],
    "seed": [-1, 2**63, 2**70, -(2**70)],
    "prefetch_factor": [0, -1],
    "multiprocessing_context": ["thread", "", "Spawn"],
}


def _arguments(name: str, value: Any) -> dict[str, Any]:
    arguments = {**GOOD, name: value}
    if name == "global_batch_size":
        del arguments["batch_size"]
    if name in ("prefetch_factor", "persistent_workers", "multiprocessing_context"):
        arguments["workers"] = 1  # only with workers does DataLoader read them
    return arguments


def _call(arguments: dict[str, Any]) -> Any:
    dataset = arguments.pop("dataset", Indices(16))
    return build_loader(dataset, **arguments)


@pytest.mark.parametrize(
    ("name", "value"), [(n, v) for n, values in WRONG_TYPE.items() for v in values]
)
def test_a_wrongly_typed_argument_is_a_type_error_naming_it(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=f"build_loader: {name} must be") as info:
        _call(_arguments(name, value))
    assert repr(value)[:20] in str(info.value)


@pytest.mark.parametrize(
    ("name", "value"), [(n, v) for n, values in WRONG_SIZE.items() for v in values]
)
def test_an_argument_out_of_range_is_a_value_error_naming_it(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"{name} must be") as info:
        _call(_arguments(name, value))
    assert repr(value)[:20] in str(info.value)


def test_the_issues_examples_are_named(capfd: pytest.CaptureFixture[str]) -> None:
    for arguments, said in [
        ({"train": "yes"}, "train must be True or False, got 'yes'"),
        ({"seed": 2**70}, f"seed must be 0..{2**63 - 1}, got {2**70}"),
        ({"seed": 1.5}, "seed must be a whole number, got 1.5"),
        ({"prefetch_factor": 0, "workers": 1}, "prefetch_factor must be at least 1, got 0"),
    ]:
        with pytest.raises((TypeError, ValueError), match=said.replace("(", r"\(")):
            _call({**GOOD, **arguments})
    import gc

    gc.collect()  # a half-made DataLoader would complain now, in __del__
    assert "Exception ignored" not in capfd.readouterr().err


def test_numpy_integers_and_the_bounds_are_accepted() -> None:
    for arguments in [
        {"batch_size": np.int64(2), "seed": np.uint64(2**63 - 1), "workers": np.int32(0)},
        {"seed": 0, "workers": 0, "prefetch_factor": None},
        {"workers": 1, "prefetch_factor": 1, "multiprocessing_context": "spawn"},
    ]:
        loader = _call({**GOOD, **arguments})
        assert loader.batch_size == 2


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(["batch_size", "workers", "seed", "prefetch_factor", "train"]),
    value=st.one_of(st.booleans(), st.floats(), st.text(max_size=3), st.integers(-(2**80), 2**80)),
)
def test_any_value_either_builds_or_is_refused_with_its_name(name: str, value: Any) -> None:
    arguments = _arguments(name, value)
    if name == "workers" and isinstance(value, int) and 0 < value <= 1024:
        arguments[name] = 0  # valid counts would start real processes: covered elsewhere
    if name == "batch_size":
        arguments["drop_last"] = False  # a batch above 16 is then one short batch
    said = ""
    try:
        loader = _call(arguments)
    except (TypeError, ValueError) as exc:
        said = str(exc)
    if said:
        assert f"{name} must be" in said or "a batch takes" in said
    else:
        assert len(loader) > 0
