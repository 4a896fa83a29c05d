"""ddpkit.data.resume.epoch_batches: what is left of an epoch, on the same or another world size."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddpkit import DistInfo, Position, build_loader
from ddpkit.data.resume import epoch_batches


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n).float()[:, None], torch.arange(n))


def _loader(n: int, world: int, rank: int, batch: int) -> DataLoader[Any]:
    info = DistInfo(rank, rank, world, world, 0, torch.device("cpu"), "gloo", world > 1)
    return build_loader(_data(n), batch_size=batch, train=True, workers=0, seed=5, info=info)


def _ids(batches: Any) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def test_no_position_another_epoch_or_an_epoch_start_give_the_whole_epoch() -> None:
    loader = _loader(20, 2, 0, 3)
    whole = _ids(epoch_batches(loader, 1, None, world_size=2, rank=0).batches)
    for start in (Position(epoch=0, batches=2, samples=12, world_size=2),  # an earlier epoch
                  Position(epoch=1, batches=0, samples=0, step=7, world_size=3)):  # fmt: skip
        part = epoch_batches(loader, 1, start, world_size=2, rank=0)
        assert (part.done, part.total, part.step_samples) == (0, len(loader), None)
        assert _ids(part.batches) == whole


def test_an_iterable_without_a_length_has_no_total() -> None:
    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from ((torch.zeros(1, 1), torch.tensor([i])) for i in range(4))

    assert epoch_batches(batches(), 0, None, world_size=1, rank=0).total is None
    part = epoch_batches(batches(), 0, Position(0, 1, 1, 1, 1), world_size=1, rank=0)
    assert (part.done, part.total) == (1, None)
    assert [b[1].item() for b in part.batches] == [1, 2, 3]


def _seen(n: int, world: int, batch: int, done: int, epoch: int) -> list[int]:
    out = []
    for rank in range(world):
        full = _ids(epoch_batches(_loader(n, world, rank, batch), epoch, None,
                                  world_size=world, rank=rank).batches)  # fmt: skip
        out += [i for b in full[:done] for i in b]
    return out


@pytest.mark.parametrize(("world", "batch", "new_batch"), [(2, 3, 4), (2, 4, 2), (1, 5, 2)])
def test_the_same_ranks_with_another_batch_size_finish_the_epoch_exactly(
    world: int, batch: int, new_batch: int
) -> None:
    n, epoch, done = 41, 2, 2
    seen = _seen(n, world, batch, done, epoch)
    start = Position(epoch=epoch, batches=done, samples=len(seen), step=done, world_size=world)
    rest, counts = [], set()
    for rank in range(world):
        part = epoch_batches(_loader(n, world, rank, new_batch), epoch, start,
                             world_size=world, rank=rank)  # fmt: skip
        got = _ids(part.batches)
        assert part.done == done
        assert part.total == done + len(got)
        counts.add(len(got))
        rest += [i for b in got for i in b]
        assert part.step_samples is not None
        assert len(part.step_samples) == len(got)
    assert len(counts) == 1  # every rank steps as often: no collective waits
    assert sorted(rest + seen) == list(range(n))  # each sample once, none again


def test_three_ranks_continue_on_two_with_a_plain_distributed_sampler() -> None:
    data, n, done, batch = _data(31), 31, 2, 2
    seen = []
    for rank in range(3):
        sampler: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=3, rank=rank, shuffle=False
        )
        seen += list(sampler)[: done * batch]
    start = Position(epoch=0, batches=done, samples=done * batch * 3, step=2, world_size=3)
    rest, steps = [], []
    for rank in range(2):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
        loader = DataLoader(data, batch_size=batch, sampler=sampler)
        part = epoch_batches(loader, 0, start, world_size=2, rank=rank)
        rest += [i for b in _ids(part.batches) for i in b]
        steps.append(part.step_samples)
    assert steps[0] == steps[1]
    assert sum(steps[0] or []) == n - len(seen)
    assert sorted(rest + seen) == list(range(n))


def test_fewer_samples_left_than_ranks_are_left_out_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    start = Position(epoch=0, batches=12, samples=49, step=12, world_size=2)
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        parts = [epoch_batches(_loader(50, 3, r, 2), 0, start, world_size=3, rank=r)
                 for r in range(3)]  # fmt: skip
    for part in parts:
        assert _ids(part.batches) == []
        assert (part.done, part.total) == (12, 12)
    assert "the last 1 sample(s) of epoch 0 are left out" in caplog.text


def test_resuming_on_another_world_size_sets_the_samplers_epoch() -> None:
    loader = _loader(30, 2, 0, 2)
    epoch_batches(loader, 4, Position(4, 1, 4, 1, 1), world_size=2, rank=0)
    assert loader.sampler.epoch == 4  # type: ignore[attr-defined]


def test_the_batches_count_themselves_and_give_the_steps_position() -> None:
    import ddpkit

    loader = _loader(20, 2, 1, 3)  # 3 batches of 3 per rank (drop_last), 2 ranks
    loader.dataset.targets = [i % 4 for i in range(20)]  # type: ignore[attr-defined]
    part = ddpkit.epoch_batches(loader, 4, None, world_size=2, rank=1)
    assert isinstance(part, ddpkit.EpochBatches)
    seen = []
    for batch in part:
        seen.append((part.done, part.samples, part.last, len(batch[1])))
    assert seen == [(1, 6, False, 3), (2, 12, False, 3), (3, 18, True, 3)]
    size, digest = ddpkit.data_identity(loader.dataset)
    # batches per rank, samples over all ranks, and the data a resume checks
    seed = ddpkit.data.resume.loader_seed(loader)  # the order's, recorded beside them
    assert part.position(7) == Position(4, 3, 18, 7, 2, size, digest, seed)
    assert size == 20
    assert digest is not None


def test_a_position_starts_the_loader_that_many_batches_in_without_reading_them() -> None:
    import ddpkit

    loader = _loader(40, 1, 0, 4)
    whole = _ids(ddpkit.epoch_batches(loader, 2, world_size=1, rank=0))
    start = Position(epoch=2, batches=3, samples=12, step=3, world_size=1)
    part = ddpkit.epoch_batches(loader, 2, start, world_size=1, rank=0)
    assert (part.done, part.samples) == (3, 12)
    assert _ids(part) == whole[3:]
    assert (part.done, part.samples, part.last) == (10, 40, True)


def test_without_a_length_the_last_batch_is_known_by_reading_one_ahead() -> None:
    import ddpkit

    read: list[int] = []

    def stream() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(3):
            read.append(i)
            yield torch.zeros(2, 1), torch.tensor([i, i])

    part = ddpkit.epoch_batches(stream(), 0, world_size=2, rank=0)
    lasts = []
    for _ in part:
        lasts.append((part.last, len(read)))
    assert lasts == [(False, 2), (False, 3), (True, 3)]  # one batch ahead, never more
    assert (part.done, part.samples) == (3, 12)  # 2 a batch on each of 2 ranks


def test_a_dataloader_over_an_iterable_dataset_without_a_length_has_no_total() -> None:
    import ddpkit

    class Stream(torch.utils.data.IterableDataset[tuple[torch.Tensor, int]]):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
            return ((torch.zeros(1), i) for i in range(5))

    loader = DataLoader(Stream(), batch_size=2)
    part = ddpkit.epoch_batches(loader, 0, world_size=1, rank=0)
    assert part.total is None
    assert [len(b[1]) for b in part] == [2, 2, 1]
    assert part.last


def test_a_batch_whose_size_cannot_be_told_is_named() -> None:
    import ddpkit

    part = ddpkit.epoch_batches([object()], 0, world_size=1, rank=0)
    with pytest.raises(TypeError, match="cannot tell how many samples a object batch holds"):
        list(part)
