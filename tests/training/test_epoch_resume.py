"""ddpkit.data.resume: the rest of an interrupted epoch, on the same or another number of ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddpkit import DistInfo, Position, build_loader
from ddpkit.data.resume import epoch_batches, epoch_order, remainder_batches
from ddpkit.data.samplers import EpochRandomSampler


class Recorded(Dataset[tuple[torch.Tensor, int]]):
    """Samples that are their own index, and a list of every index read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.read.append(index)
        return torch.tensor([float(index)]), index


def _info(world: int, rank: int) -> DistInfo:
    return DistInfo(rank, rank, world, world, 0, torch.device("cpu"), "gloo", world > 1)


def _loader(n: int, world: int, rank: int, batch: int, **kw: Any) -> DataLoader[Any]:
    return build_loader(Recorded(n), batch_size=batch, train=True, workers=0, seed=3,
                        info=_info(world, rank), **kw)  # fmt: skip


def _indices(batches: Any) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


@pytest.mark.parametrize("rest_len", [0, 1, 2, 3, 5, 7, 11, 12, 13, 24, 25, 26, 37])
@pytest.mark.parametrize(("world", "batch"), [(1, 4), (2, 4), (3, 4), (3, 1), (4, 3)])
def test_the_remainder_covers_each_sample_once_with_equal_batch_counts(
    rest_len: int, world: int, batch: int
) -> None:
    rest = list(range(100, 100 + rest_len))
    shares = [remainder_batches(rest, world, r, batch) for r in range(world)]
    counts = {len(b) for b, _, _ in shares}
    assert len(counts) == 1  # every rank takes part in every step: no collective waits
    dropped = shares[0][2]
    dealt = [i for b, _, _ in shares for step in b for i in step]
    assert len(dealt) == len(set(dealt)) == rest_len - dropped
    assert set(dealt) | set(rest[len(rest) - dropped :]) == set(rest)
    assert dropped == (rest_len if rest_len < world else 0)
    sizes = shares[0][1]
    assert sum(sizes) == len(dealt)
    for step, size in enumerate(sizes):
        assert sum(len(b[step]) for b, _, _ in shares) == size
        assert all(len(b[step]) >= 1 for b, _, _ in shares)


def test_distributed_and_single_process_orders_are_one_permutation() -> None:
    data = list(range(50))
    for epoch in range(3):
        single = EpochRandomSampler(data, 3)
        single.set_epoch(epoch)
        whole = list(single)
        for world in (2, 3):
            for rank in range(world):
                d = DistributedSampler(data, num_replicas=world, rank=rank, seed=3)
                d.set_epoch(epoch)
                assert list(d) == (whole + whole)[rank : len(d) * world : world]
        assert epoch_order(_loader(50, 1, 0, 4), epoch) is not None
        keys, order = epoch_order(_loader(50, 2, 1, 4), epoch)  # type: ignore[misc]
        assert order == whole
        assert keys(5) == (epoch, 5)


@pytest.mark.parametrize("done", [0, 1, 3, 6])
def test_same_ranks_continue_batch_for_batch_without_reading_the_skipped(done: int) -> None:
    for rank in range(2):
        whole = _loader(50, 2, rank, 4)
        full = _indices(epoch_batches(whole, 2, None, world_size=2, rank=rank).batches)
        resumed = _loader(50, 2, rank, 4)
        start = Position(epoch=2, batches=done, samples=done * 4 * 2, step=17, world_size=2)
        part = epoch_batches(resumed, 2, start, world_size=2, rank=rank)
        assert part.done == done
        assert part.total == len(full) == 6
        assert _indices(part.batches) == full[done:]
        assert sorted(resumed.dataset.dataset.read) == sorted(i for b in full[done:] for i in b)
        # The loader's next epoch is whole again.
        assert len(_indices(epoch_batches(resumed, 3, None, world_size=2, rank=rank).batches)) == 6


@pytest.mark.parametrize("new_world", [1, 3])
@pytest.mark.parametrize("done", [1, 2, 5])
def test_other_ranks_finish_the_epoch_with_exactly_the_unseen_samples(
    new_world: int, done: int
) -> None:
    n, epoch = 50, 1
    seen = []
    for rank in range(2):
        before = _loader(n, 2, rank, 4)
        batches = _indices(epoch_batches(before, epoch, None, world_size=2, rank=rank).batches)
        seen += [i for b in batches[:done] for i in b]
    start = Position(epoch=epoch, batches=done, samples=done * 4 * 2, step=9, world_size=2)
    after, counts = [], set()
    for rank in range(new_world):
        loader = _loader(n, new_world, rank, 4)
        part = epoch_batches(loader, epoch, start, world_size=new_world, rank=rank)
        got = _indices(part.batches)
        counts.add(len(got))
        assert part.step_samples is not None
        assert len(part.step_samples) == len(got)
        after += [i for b in got for i in b]
        assert sorted(loader.dataset.dataset.read) == sorted(i for b in got for i in b)
    assert len(counts) == 1
    assert len(after) == len(set(after))  # none twice
    assert not set(after) & set(seen)  # none of those already seen
    assert set(after) | set(seen) == set(range(n))  # none skipped


def test_a_plain_distributed_sampler_resumes_too() -> None:
    data = Recorded(40)
    sampler = DistributedSampler(data, num_replicas=2, rank=1, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)
    full = _indices(epoch_batches(loader, 0, None, world_size=2, rank=1).batches)
    data.read.clear()
    start = Position(epoch=0, batches=2, samples=16, step=2, world_size=2)
    part = epoch_batches(loader, 0, start, world_size=2, rank=1)
    assert _indices(part.batches) == full[2:]
    assert sorted(data.read) == sorted(i for b in full[2:] for i in b)
    other = epoch_batches(loader, 0, start, world_size=1, rank=0)
    assert len({i for b in _indices(other.batches) for i in b}) == 40 - 16


def test_a_loader_without_a_known_order_cannot_change_ranks() -> None:
    batches = [(torch.zeros(2, 1), torch.tensor([i, i])) for i in range(5)]
    start = Position(epoch=0, batches=2, samples=8, step=2, world_size=2)
    part = epoch_batches(batches, 0, start, world_size=2, rank=0)
    assert [b[1][0].item() for b in part.batches] == [2, 3, 4]
    with pytest.raises(ValueError, match=r"on 3 rank\(s\) from a checkpoint of 2"):
        epoch_batches(batches, 0, start, world_size=3, rank=0)
    loader = DataLoader(Recorded(20), batch_size=2)  # a SequentialSampler: no epoch order known
    with pytest.raises(ValueError, match="build_loader"):
        epoch_batches(loader, 0, Position(0, 1, 4, 1, 2), world_size=3, rank=0)


def test_a_plain_loader_resumed_without_its_epochs_seeds_is_said_inexact() -> None:
    from ddpkit.data.resume import inexact_resume
    from ddpkit.data.streams import EPOCH_SEEDS

    data, mid = Recorded(16), Position(0, 2, 8, 2, 1)
    order = DistributedSampler(data, num_replicas=1, rank=0)
    workers = DataLoader(data, batch_size=4, sampler=order, num_workers=2)
    said = inexact_resume(workers, mid, None)
    assert said is not None
    assert "holds no seeds" in said
    assert "build_loader" in said
    part = epoch_batches(DataLoader(data, batch_size=4, sampler=order), 0, world_size=1, rank=0)
    list(part)
    assert part.loader_state() is not None
    assert inexact_resume(workers, mid, part.loader_state()) is None
    assert EPOCH_SEEDS in part.loader_state()
    in_rank = DataLoader(data, batch_size=4, sampler=order)  # cut from its known order
    assert inexact_resume(in_rank, mid, None) is None
    assert inexact_resume(_loader(16, 1, 0, 4), mid, None) is None  # build_loader's


class _Drawn(Dataset[tuple[torch.Tensor, int]]):
    """Each sample its index plus noise drawn from torch's, NumPy's or Python's global RNG."""

    def __init__(self, how: str, n: int = 24) -> None:
        self.how, self.n = how, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import random

        import numpy as np

        noise = {
            "torch": lambda: float(torch.rand(())),
            "numpy": lambda: float(np.random.rand()),
            "python": random.random,
        }[self.how]()
        return torch.tensor([index + noise]), index


class _ShuffledBatches:
    """A batch sampler of one's own: its order from torch's global generator."""

    def __len__(self) -> int:
        return 6

    def __iter__(self) -> Any:
        order = torch.randperm(24).tolist()
        return (order[i : i + 4] for i in range(0, 24, 4))


def _plain_loader(kind: str, how: str, workers: int) -> DataLoader[Any]:
    data, options = _Drawn(how), {"num_workers": workers}
    if kind == "shuffle":
        return DataLoader(data, batch_size=4, shuffle=True, **options)
    if kind == "shuffle+generator":
        generator = torch.Generator().manual_seed(7)  # as the script makes it, every run
        return DataLoader(data, batch_size=4, shuffle=True, generator=generator, **options)
    if kind == "sampler's generator":
        order = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(5))
        return DataLoader(data, batch_size=4, sampler=order, **options)
    return DataLoader(data, batch_sampler=_ShuffledBatches(), **options)


@pytest.mark.parametrize(
    ("kind", "how", "workers"),
    [
        ("shuffle", "numpy", 0),
        ("shuffle", "python", 0),
        ("shuffle+generator", "torch", 0),
        ("sampler's generator", "torch", 0),
        ("batch_sampler", "torch", 0),
        ("shuffle", "numpy", 2),
    ],
)
def test_a_plain_loader_resumed_from_its_seeds_draws_what_it_drew(
    kind: str, how: str, workers: int
) -> None:
    # The second epoch, cut after 2 of its 6 batches as a kill would, then resumed by a fresh
    # loader (a new process) from the checkpoint's RNG states and the epoch's seeds.
    from ddpkit.rng import capture_rng_state, restore_rng_state

    torch.manual_seed(0)
    loader = _plain_loader(kind, how, workers)
    list(epoch_batches(loader, 0, world_size=1, rank=0))  # the generators move on an epoch
    part = epoch_batches(loader, 1, world_size=1, rank=0)
    batches = iter(part)
    for _ in range(2):
        next(batches)
    saved, rng = part.loader_state(), capture_rng_state()
    rest = [x for x, _ in batches]
    after = capture_rng_state()
    restore_rng_state(rng)
    start = Position(1, 2, 8, 8, 1)
    fresh = _plain_loader(kind, how, workers)
    resumed = [
        x for x, _ in epoch_batches(fresh, 1, start, world_size=1, rank=0, loader_state=saved)
    ]
    assert [x.tolist() for x in resumed] == [x.tolist() for x in rest]
    now = capture_rng_state()
    assert torch.equal(now["torch"], after["torch"])
    assert now["python"] == after["python"]
    assert torch.equal(now["numpy"][1], after["numpy"][1])


def test_epoch_batches_starts_no_worker_and_draws_nothing_until_it_is_read() -> None:
    loader = DataLoader(_Drawn("torch"), batch_size=4, shuffle=True, num_workers=2)
    before = torch.random.get_rng_state()
    part = epoch_batches(loader, 0, world_size=1, rank=0)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert part.seeds is None  # taken as the iterator starts
    assert len(list(part)) == 6
    assert part.seeds is not None


def test_an_epoch_start_resume_with_a_generator_of_its_own_is_said_inexact() -> None:
    from ddpkit.data.resume import inexact_resume

    epoch_start = Position(1, 0, 0, 6, 1)
    said = inexact_resume(_plain_loader("sampler's generator", "torch", 0), epoch_start, None)
    assert said is not None
    assert "torch.Generator" in said
    assert inexact_resume(_plain_loader("shuffle", "torch", 0), epoch_start, None) is None
