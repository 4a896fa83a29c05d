"""Host copies that share nothing with training, one background write at a time."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch
from torch import nn

from ddpkit.checkpoint.background import BackgroundWriter, snapshot


def test_a_snapshot_shares_nothing_with_the_original() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": (1, torch.get_rng_state()), "n": 3, "name": "x"}  # fmt: skip
    copy = snapshot(state)
    before = {k: v.clone() for k, v in copy["model"].items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    optimizer.step()
    for key, value in copy["model"].items():
        assert torch.equal(value, before[key])
        assert value.data_ptr() != state["model"][key].data_ptr()
    assert isinstance(copy["model"], OrderedDict)
    assert copy["model"]._metadata == state["model"]._metadata  # BatchNorm's version survives
    assert isinstance(copy["rng"], tuple)
    assert copy["n"] == 3
    assert copy["name"] == "x"
    fresh = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    fresh.load_state_dict(copy["model"])


def test_one_write_in_flight_and_the_next_waits_for_it() -> None:
    writer = BackgroundWriter()
    release, order = threading.Event(), []

    def first() -> None:
        release.wait(30)
        order.append("first")

    writer.submit(first)
    assert writer.busy
    second = threading.Thread(target=writer.submit, args=(lambda: order.append("second"),))
    second.start()
    second.join(0.3)
    assert second.is_alive()
    assert order == []
    release.set()
    second.join(30)
    writer.wait()
    assert order == ["first", "second"]
    assert not writer.busy


def test_a_failed_write_is_kept_and_raised_once() -> None:
    writer = BackgroundWriter()

    def failing() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(failing)
    writer.join()
    assert isinstance(writer.error, OSError)
    ran = []
    with pytest.raises(OSError, match="No space"):
        writer.submit(lambda: ran.append(1))  # the error comes first; nothing new starts
    assert ran == []
    assert writer.error is None
    writer.submit(lambda: ran.append(2))
    writer.wait()
    assert ran == [2]


def test_a_snapshot_into_an_earlier_one_reuses_its_memory_and_equals_a_fresh_one() -> None:
    model = nn.Sequential(nn.Linear(30, 20), nn.BatchNorm1d(20))
    state = {"model": model.state_dict(), "ids": [torch.arange(5), torch.zeros(2, 3).t()]}
    first = snapshot(state)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state["ids"][0] = torch.arange(7)  # another shape: a new tensor
    second = snapshot(state, reuse=first)
    fresh = snapshot(state)
    for key, value in fresh["model"].items():
        assert torch.equal(second["model"][key], value)
        assert second["model"][key].data_ptr() == first["model"][key].data_ptr()  # reused
        assert second["model"][key].data_ptr() != state["model"][key].data_ptr()
    assert torch.equal(second["ids"][0], torch.arange(7))
    assert second["ids"][0].data_ptr() != first["ids"][0].data_ptr()
    assert torch.equal(second["ids"][1], fresh["ids"][1])


def test_a_tensor_that_an_earlier_snapshot_holds_twice_takes_one_copy() -> None:
    shared = torch.zeros(4)
    earlier = {"a": shared, "b": shared}  # tied entries: one buffer
    second = snapshot({"a": torch.ones(4), "b": torch.full((4,), 2.0)}, reuse=earlier)
    assert torch.equal(second["a"], torch.ones(4))
    assert torch.equal(second["b"], torch.full((4,), 2.0))
    assert second["a"].data_ptr() != second["b"].data_ptr()


def test_views_and_expanded_tensors_are_never_written_into() -> None:
    base = torch.zeros(8)
    earlier = {"view": base[2:6], "expanded": torch.zeros(1).expand(4)}
    second = snapshot({"view": torch.ones(4), "expanded": torch.ones(4)}, reuse=earlier)
    assert torch.equal(base, torch.zeros(8))  # the view's storage is larger: not reused
    assert torch.equal(second["view"], torch.ones(4))
    assert torch.equal(second["expanded"], torch.ones(4))
    assert second["expanded"].data_ptr() != earlier["expanded"].data_ptr()
