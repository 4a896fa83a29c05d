"""WeightedDistributedSampler and class_weights: the draws' statistics, equal shares, resume."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from loader_fixtures import info
from torch.utils.data import Dataset

from ddpkit.data import build_loader
from ddpkit.data.balanced import WeightedDistributedSampler, class_weights
from ddpkit.data.resume import epoch_batches
from ddpkit.data.samplers import SeededSamples
from ddpkit.position import Position

# A long tail: 400, 100, 25, 8 samples (1:50).
COUNTS = (400, 100, 25, 8)
TARGETS = torch.cat([torch.full((c,), k) for k, c in enumerate(COUNTS)])


class Labelled(Dataset[tuple[int, int]]):
    """Each item is its own index and label; ``targets`` as torchvision's datasets have it."""

    def __init__(self, targets: torch.Tensor) -> None:
        self.targets = targets.tolist()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, self.targets[index]


def _class_draws(power: float, epochs: int) -> torch.Tensor:
    sampler = WeightedDistributedSampler(class_weights(TARGETS, power), num_replicas=1, rank=0)
    drawn = torch.cat([sampler.order(e) for e in range(epochs)])
    return torch.bincount(TARGETS[drawn], minlength=len(COUNTS)).double()


@pytest.mark.parametrize("power", [1.0, 0.5, 0.0])
def test_classes_are_drawn_by_the_power_of_their_size_within_binomial_tolerance(
    power: float,
) -> None:
    epochs = 200
    seen = _class_draws(power, epochs)
    total = epochs * len(TARGETS)
    sizes = torch.tensor(COUNTS, dtype=torch.float64)
    expected_p = sizes ** (1 - power) / (sizes ** (1 - power)).sum()
    for k, p in enumerate(expected_p.tolist()):
        spread = math.sqrt(total * p * (1 - p))  # the binomial's standard deviation
        assert abs(seen[k] - total * p) < 5 * spread, (k, float(seen[k]), total * p)
    if power == 1.0:  # balanced: the rarest class as often as the largest
        assert (seen / seen.mean() - 1).abs().max() < 0.02
    if power == 0.0:  # as the plain shuffle draws them: the dataset's own frequencies
        plain = sizes * epochs
        assert ((seen - plain).abs() / plain).max() < 0.06


def test_orders_depend_on_seed_and_epoch_only() -> None:
    weights = class_weights(TARGETS)
    a = WeightedDistributedSampler(weights, num_replicas=3, rank=1, seed=4)
    b = WeightedDistributedSampler(weights, num_replicas=5, rank=2, seed=4)
    assert torch.equal(a.order(2), b.order(2))
    assert not torch.equal(a.order(2), a.order(3))
    c = WeightedDistributedSampler(weights, num_replicas=3, rank=1, seed=5)
    assert not torch.equal(a.order(2), c.order(2))


@pytest.mark.parametrize("world", range(1, 8))
@pytest.mark.parametrize(
    ("n", "repeats", "weighted"), [(37, 1, True), (53, 3, True), (41, 2, False)]
)
def test_every_rank_gets_the_same_number_of_batches(
    world: int, n: int, repeats: int, weighted: bool
) -> None:
    targets = TARGETS[torch.randperm(len(TARGETS), generator=torch.Generator().manual_seed(n))][:n]
    for drop_last in (True, False):
        shares = []
        for rank in range(world):
            data = Labelled(targets)
            loader = build_loader(
                data, batch_size=2, train=True, workers=0, info=info(rank, world),
                balance=1.0 if weighted else None, repeats=repeats, drop_last=drop_last,
            )  # fmt: skip
            loader.sampler.set_epoch(1)  # type: ignore[attr-defined]
            shares.append([len(images) for images, _ in loader])
        assert len({len(s) for s in shares}) == 1, (world, n, repeats, drop_last, shares)
        assert len(shares[0]) == len(loader)
        drawn, total = sum(map(sum, shares)), n * repeats
        per = total // world if drop_last else -(-total // world)  # each rank's share
        assert drawn == world * (per - per % 2 if drop_last else per)  # whole batches of 2


def test_repeated_augmentation_puts_each_copy_on_another_rank_with_its_own_seed() -> None:
    world, repeats, n = 4, 3, 40
    samplers = [
        WeightedDistributedSampler(n, repeats=repeats, num_replicas=world, rank=r, seed=1)
        for r in range(world)
    ]
    owners: dict[int, list[tuple[int, int]]] = {}
    for rank, sampler in enumerate(samplers):
        sampler.set_epoch(2)
        for index, position in sampler.draws():
            owners.setdefault(index, []).append((rank, position))
    assert sorted(owners) == list(range(n))  # every image, no pass of weights: each once
    for copies in owners.values():
        assert len(copies) == repeats
        assert len({rank for rank, _ in copies}) == repeats  # each copy on a different rank
        assert len({position for _, position in copies}) == repeats  # each its own draw


def test_copies_of_one_image_are_augmented_apart() -> None:
    class Noise(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.rand(4)  # the "augmentation": seeded by build_loader

    loader = build_loader(Noise(), batch_size=1, train=True, workers=0, info=info(0, 1), repeats=2)
    loader.sampler.set_epoch(0)  # type: ignore[attr-defined]
    items = [b[0] for b in loader]
    assert len(items) == 12
    assert len({tuple(x.tolist()) for x in items}) == 12  # no two copies alike
    again = [b[0] for b in loader]  # the next epoch: new draws
    assert not torch.equal(torch.stack(items), torch.stack(again))


def test_a_resumed_epoch_draws_the_unseen_rest_on_the_same_and_another_world() -> None:
    world, batch = 3, 8
    full = {r: _keys_of(world, r, None) for r in range(world)}  # each rank's whole epoch
    steps = len(full[0]) // batch
    done = steps // 2
    start = Position(
        epoch=1, batches=done, samples=done * batch * world, step=done, world_size=world
    )
    for r in range(world):  # same world: exactly the rest of each rank's share
        assert _keys_of(world, r, start) == full[r][done * batch :]
    seen = {k for r in range(world) for k in full[r][: done * batch]}
    everything = {k for r in range(world) for k in full[r]}
    rest = [k for r in range(2) for k in _keys_of(2, r, start)]
    assert len(rest) == len(set(rest))  # on 2 ranks: no draw twice
    assert not set(rest) & seen  # none of the seen draws
    assert everything - seen <= set(rest)  # every unseen one, and the tail 3 ranks dropped:
    assert sorted(p for _, _, p in rest) == list(range(start.samples, 2 * len(TARGETS)))


def _keys_of(world: int, rank: int, start: Position | None) -> list[tuple[int, int, int]]:
    """The (epoch, index, draw) keys ``rank`` asks its dataset for in epoch 1 from ``start``."""
    loader = build_loader(
        Labelled(TARGETS), batch_size=8, train=True, workers=0, info=info(rank, world),
        balance=0.5, repeats=2, seed=3,
    )  # fmt: skip
    # The keys the dataset is asked for: each item is its key (a spy, not the augmentation).
    with mock.patch.object(SeededSamples, "__getitem__", lambda self, key: key):
        got = epoch_batches(loader, 1, start, world_size=world, rank=rank)
        return [tuple(int(v) for v in key) for batch in got for key in zip(*batch, strict=True)]


def test_bad_arguments_are_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match=r"power must be a number in 0\.\.1.*got 2"):
        class_weights(TARGETS, 2)
    with pytest.raises(ValueError, match=r"sample 1 has -1\.0"):
        WeightedDistributedSampler([1.0, -1.0], num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="positive sum"):
        WeightedDistributedSampler([0.0, 0.0], num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="repeats must be a whole number, 1 or more, got 0"):
        WeightedDistributedSampler(5, repeats=0, num_replicas=1, rank=0)
    data = Labelled(TARGETS)
    with pytest.raises(ValueError, match="apply to training"):
        build_loader(data, batch_size=2, train=False, workers=0, info=info(0, 1), balance=1.0)
    with pytest.raises(ValueError, match="not both"):
        build_loader(data, batch_size=2, train=True, workers=0, info=info(0, 1), balance=1.0,
                     weights=[1.0] * len(data))  # fmt: skip
    with pytest.raises(ValueError, match=r"3 weights .* for a dataset of 533"):
        build_loader(data, batch_size=2, train=True, workers=0, info=info(0, 1), weights=[1.0] * 3)
    with pytest.raises(ValueError, match="has none; pass weights=class_weights"):
        build_loader(list(range(9)), batch_size=2, train=True, workers=0, info=info(0, 1),  # type: ignore[arg-type]
                     balance=1.0)  # fmt: skip


def test_num_samples_sets_the_epoch_length() -> None:
    loader = build_loader(Labelled(TARGETS), batch_size=10, train=True, workers=0,
                          info=info(0, 2), balance=1.0, num_samples=100, repeats=2)  # fmt: skip
    assert len(loader) == 100 * 2 // 2 // 10


@pytest.mark.parametrize("n", [1, 37, 5000])
def test_up_to_2_24_samples_an_epoch_is_torch_multinomial_of_seed_plus_epoch(n: int) -> None:
    # The draws of a dataset torch.multinomial takes are what they always were: a
    # resumed run, and one checked against an earlier one, stay bit-exact.
    weights = torch.rand(n, generator=torch.Generator().manual_seed(n)) + 0.01
    sampler = WeightedDistributedSampler(weights, 3 * n, repeats=2, num_replicas=2, rank=0, seed=6)
    normalised = (weights.double() / weights.double().sum()).float()
    for epoch in (0, 4):
        generator = torch.Generator().manual_seed(6 + epoch)
        expected = torch.multinomial(normalised, 3 * n, replacement=True, generator=generator)
        assert torch.equal(sampler.order(epoch), expected.repeat_interleave(2))


@pytest.mark.parametrize(
    ("world", "rank", "drop_last"), [(1, 0, True), (3, 2, False), (7, 4, True)]
)
def test_a_share_longer_than_one_chunk_is_the_ranks_strided_positions(
    world: int, rank: int, drop_last: bool
) -> None:
    sampler = WeightedDistributedSampler(
        150_001, 200_003, repeats=2, num_replicas=world, rank=rank, seed=9, drop_last=drop_last
    )
    order = sampler.order(0).tolist()
    got = list(sampler.draws())
    assert len(got) == len(sampler)
    assert list(sampler) == [index for index, _ in got]  # a torch sampler's indices
    positions = range(rank, len(sampler) * world, world)
    assert got == [(order[p % sampler.total], p) for p in positions]


def test_a_plain_dataloader_takes_it_as_it_takes_any_sampler() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(10.0)[:, None], torch.arange(10))
    sampler = WeightedDistributedSampler(
        class_weights([0] * 8 + [1] * 2), 12, num_replicas=2, rank=1, seed=4
    )
    sampler.set_epoch(1)
    batches = list(DataLoader(data, batch_size=3, sampler=sampler))
    labels = torch.cat([y for _, y in batches])
    assert labels.tolist() == list(sampler)  # the samples it names, in its order
    assert len(labels) == len(sampler) == 6
