"""Streams in one process: whose state is the place, the place after a batch, saved places."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from stream_jobs import BATCH, StatefulStream, Stream, make_loader
from torch.utils.data import DataLoader, IterableDataset, Sampler

import ddpkit
from ddpkit import Position, epoch_batches, set_epoch
from ddpkit.data.streams import ANY_WORLD_SIZE, loader_states_for, state_holder


class _StatefulSampler(Sampler[int]):
    def __init__(self) -> None:
        self.at = 0

    def __iter__(self) -> Any:
        return iter(range(8))

    def __len__(self) -> int:
        return 8

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


class _StatefulMap(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(2), index % 2

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class _LiveState(StatefulStream):
    """A stream whose state_dict() hands out the same dict, changed as it goes."""

    def __init__(self, n: int, salt: int) -> None:
        super().__init__(n, salt)
        self.live = {"next": 0}

    def state_dict(self) -> dict[str, Any]:
        self.live["next"] = self.next
        return self.live


def test_a_place_taken_before_the_read_ahead_is_a_copy() -> None:
    loader = DataLoader(_LiveState(3 * BATCH, 0), batch_size=BATCH)
    part = epoch_batches(loader, 0)
    places = [part.loader_state()["next"] for _ in part]
    assert places == [4, 8, 12]


def test_the_holder_is_the_loader_else_its_sampler_or_dataset_read_in_this_process() -> None:
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    stream = StatefulStream(8, 0)
    loader = StatefulDataLoader(stream, batch_size=2)
    assert state_holder(loader) is loader
    assert state_holder(DataLoader(stream, batch_size=2)) is stream
    sampler = _StatefulSampler()
    assert state_holder(DataLoader(range(8), sampler=sampler)) is sampler
    assert state_holder(DataLoader(Stream(8, 0), batch_size=2)) is None
    # A map-style dataset's state is no place in the epoch: its sampler says where.
    assert state_holder(DataLoader(_StatefulMap(), batch_size=2)) is None
    assert (
        state_holder(ddpkit.build_loader(_StatefulMap(), batch_size=2, train=True, workers=0))
        is None
    )
    assert state_holder([torch.zeros(2)]) is None
    with pytest.warns(RuntimeWarning, match="StatefulDataLoader"):
        assert state_holder(DataLoader(stream, batch_size=2, num_workers=1)) is None


def test_read_one_batch_ahead_the_place_is_the_one_after_the_batch_yielded() -> None:
    loader = make_loader("stateful-dataset", 5 * BATCH, 0, 0, {})
    part = epoch_batches(loader, 0)
    assert part.total is None
    assert part.holder is loader.dataset
    places = []
    for _ in part:  # without a length: the next batch is already read when this one comes
        places.append(part.loader_state()["next"])
        assert loader.dataset.next == min(places[-1] + BATCH, 5 * BATCH) or part.last
    assert places == [4, 8, 12, 16, 20]
    assert part.dropped == 0


def test_a_saved_place_continues_the_epoch_where_it_stood_and_keeps_the_generator() -> None:
    loader = make_loader("stateful-dataset", 5 * BATCH, 3, 0, {})
    whole = [targets.tolist() for _, targets in epoch_batches(loader, 0)]
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    start = Position(0, 2, 2 * BATCH, 2, 1)
    loader = make_loader("stateful-dataset", 5 * BATCH, 3, 0, {})  # a resumed run's
    part = epoch_batches(loader, 0, start, loader_state={"epoch": 0, "next": 2 * BATCH})
    assert torch.equal(torch.random.get_rng_state(), before)  # the iterator drew nothing
    assert [targets.tolist() for _, targets in part] == whole[2:]
    assert part.done == 5
    assert part.samples == 5 * BATCH


def test_a_plain_stream_is_read_up_to_its_place_without_drawing_random_numbers() -> None:
    loader = make_loader("plain", 5 * BATCH, 3, 0, {})
    whole = [targets.tolist() for _, targets in epoch_batches(loader, 0)]
    before = torch.random.get_rng_state()
    loader = make_loader("plain", 5 * BATCH, 3, 0, {})  # a resumed run's
    part = epoch_batches(loader, 0, Position(0, 3, 3 * BATCH, 3, 1))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert [targets.tolist() for _, targets in part] == whole[3:]


class _Hinted(IterableDataset[int]):
    """A stream whose ``__len__`` is a hint: ``n`` samples, ``said`` claimed."""

    def __init__(self, n: int, said: int) -> None:
        self.n, self.said = n, said

    def __iter__(self) -> Any:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.said


@pytest.mark.parametrize(("n", "said"), [(12, 8), (4, 12)], ids=["longer", "shorter"])
def test_a_streams_length_is_a_hint_read_ahead_to_its_real_end(n: int, said: int) -> None:
    # A shorter stream must still end its epoch with a step; a longer one is trained whole.
    part = epoch_batches(DataLoader(_Hinted(n, said), batch_size=4), 0)
    assert part.total == said // 4
    assert not part.exact
    lasts = [part.last for _ in part]
    assert lasts == [False] * (n // 4 - 1) + [True]
    assert part.dropped == 0


def test_a_sequences_length_is_exact_and_a_map_style_loaders_too() -> None:
    assert epoch_batches([1, 2, 3], 0).exact
    assert epoch_batches(DataLoader(range(8), batch_size=2), 0).exact


def test_saved_places_go_to_their_rank_and_another_world_needs_a_resplittable_state() -> None:
    saved = [{"next": 4}, {"next": 8}]
    assert loader_states_for(saved, 2, 1, True, "step-8.pth") == {"next": 8}
    assert loader_states_for([None, None], 2, 0, True, "x") is None
    assert loader_states_for(saved, 3, 0, False, "latest.pth") is None  # an epoch's start
    assert loader_states_for(saved, 2, 0, False, "x") is None  # moved on to the next epoch
    with pytest.raises(ValueError, match=r"step-8.pth holds .* 2 rank\(s\) .* has 3"):
        loader_states_for(saved, 3, 0, True, "step-8.pth")
    free = [{"n": 4, ANY_WORLD_SIZE: True}, {"n": 4, ANY_WORLD_SIZE: True}]
    assert loader_states_for(free, 3, 2, True, "x") == free[0]


def test_set_epoch_reaches_a_stream_with_a_set_epoch_of_its_own() -> None:
    class Epochs(Stream):
        epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    stream = Epochs(4, 0)
    set_epoch(DataLoader(stream, batch_size=2), 3)
    assert stream.epoch == 3


def _documented_numbers() -> type:
    """docs/data.md's stateful ``Numbers`` stream, as a reader would copy it."""
    from doc_blocks import ROOT, parse

    block = next(b for b in parse(ROOT / "docs/data.md") if "class Numbers(" in b.code)
    namespace: dict[str, Any] = {}
    exec(block.code.split("\nmodel = ")[0], namespace)  # the imports and the class
    return namespace["Numbers"]


@pytest.mark.parametrize("n", [20, 22])
def test_the_documented_stateful_stream_resumes_exactly_after_any_batch_even_an_ended_worker(
    n: int,
) -> None:
    # A worker whose share ended first is saved "ended"; torchdata asks it for a batch again
    # on resume. The documented dataset reset its place to 0 there: its whole share again.
    from torchdata.stateful_dataloader import StatefulDataLoader

    numbers = _documented_numbers()

    def loader() -> Any:
        return StatefulDataLoader(numbers(n), batch_size=4, num_workers=2)

    whole, places = [], []
    first = loader()
    for _, labels in first:
        whole.append(labels.tolist())
        places.append(first.state_dict())
    ended = 0
    for k, place in enumerate(places[:-1], 1):
        snapshots = place["_snapshot"]["_worker_snapshots"].values()
        ended += any(s["fetcher_state"]["fetcher_ended"] for s in snapshots)
        resumed = loader()
        resumed.load_state_dict(place)
        assert [labels.tolist() for _, labels in resumed] == whole[k:], f"after batch {k}"
    assert ended  # the case of the defect was met
    again = numbers(n)  # the next epoch starts at the beginning, told by set_epoch
    again.load_state_dict({"epoch": 0, "next": n})
    set_epoch(DataLoader(again, batch_size=4), 1)
    assert sum(1 for _ in again) == n


def test_a_loader_with_a_length_counts_what_it_drops_without_reading_it() -> None:
    from stream_jobs import sized_apart_run

    from ddpkit.testing import run_distributed

    results = run_distributed(sized_apart_run, 2, timeout=120)
    assert results == [
        {"taken": 2, "dropped": 0, "read": 8},
        {"taken": 2, "dropped": 3, "read": 8},  # 12 samples beyond the agreed end never read
    ]


def test_a_streams_length_hint_bounds_no_resume_but_a_map_style_length_does() -> None:
    from ddpkit.data.resume import resume_verdict

    past = Position(0, 9, 36, 9, 1)  # batch 9 of a stream whose hint says 8
    assert resume_verdict(DataLoader(_Hinted(48, 32), batch_size=4), past, 1, 0) == (None, None)
    _, misfit = resume_verdict(DataLoader(list(range(32)), batch_size=4), past, 1, 0)
    assert misfit is not None
    assert "has 8 batches per rank" in misfit


class _Pairs(IterableDataset[tuple[torch.Tensor, int]]):
    """8 samples whose ``__len__`` hint says 0."""

    def __iter__(self) -> Any:
        return ((torch.full((8,), float(i)), i % 3) for i in range(8))

    def __len__(self) -> int:
        return 0


def test_a_stream_whose_hint_is_zero_trains_and_an_empty_map_style_loader_is_refused() -> None:
    from ddpkit.data.streams import check_batches

    model = torch.nn.Linear(8, 3)
    history = ddpkit.fit(
        model,
        DataLoader(_Pairs(), batch_size=4),
        torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=torch.nn.CrossEntropyLoss(),
        epochs=1,
        config=ddpkit.TrainConfig(normalize=None),
        report=ddpkit.ReportConfig(progress=False),
    )
    assert history.records[0]["train_samples"] == 8
    with pytest.raises(ValueError, match="the training loader yields no batch"):
        check_batches(DataLoader(list(range(3)), batch_size=4, drop_last=True), 1)
