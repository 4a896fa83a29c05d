"""DistributedEvalSampler, set_epoch, per-sample seeds: each sample once, epochs that repeat."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from loader_fixtures import Indices, info
from torch.utils.data import (
    Dataset,
)

from ddpkit.data import DistributedEvalSampler, build_loader, set_epoch, train_transform
from ddpkit.distributed import comm


@pytest.mark.parametrize("n", [0, 1, 7, 10, 13, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_eval_sampler_sees_every_index_once(n: int, world: int) -> None:
    samplers = [DistributedEvalSampler(n, num_replicas=world, rank=r) for r in range(world)]
    parts = [list(s) for s in samplers]
    assert sorted(i for part in parts for i in part) == list(range(n))
    assert [len(s) for s in samplers] == [len(p) for p in parts]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts[0] == list(range(0, n, world))


def test_eval_sampler_defaults_and_errors() -> None:
    sampler = DistributedEvalSampler(Indices(5))
    assert (sampler.num_replicas, sampler.rank) == (comm.get_world_size(), comm.get_rank())
    sampler.set_epoch(3)
    assert list(sampler) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"rank 2 is outside 0\.\.1"):
        DistributedEvalSampler(5, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas must be at least 1, got 0"):
        DistributedEvalSampler(5, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="-1"):
        DistributedEvalSampler(-1, num_replicas=1, rank=0)


@pytest.mark.parametrize("world", [1, 3])
def test_set_epoch_changes_the_order_reproducibly(world: int) -> None:
    def order(epoch: int) -> list[int]:
        loader = build_loader(
            Indices(30), batch_size=5, train=True, workers=0, seed=3, info=info(0, world, world)
        )
        set_epoch(loader, epoch)
        return [i for batch in loader for i in batch.tolist()]

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(1) == order(1)
    loader = build_loader(
        Indices(30), batch_size=5, train=True, workers=0, seed=3, info=info(0, world, world)
    )
    set_epoch(loader, 1)
    list(loader)
    set_epoch(loader, 0)
    assert [i for batch in loader for i in batch.tolist()] == order(0)


def test_set_epoch_leaves_samplers_without_it_alone() -> None:
    loader = build_loader(Indices(4), batch_size=2, train=False, workers=0, info=info(0, 1, 1))
    set_epoch(loader, 5)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


class _RandomCrops(Dataset[tuple[int, float]]):
    """Stands in for random augmentation: each item draws from all three RNGs."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, float]:
        return index, float(torch.rand(1)) + random.random() + float(np.random.rand())


def _augmentations(
    workers: int, persistent: bool, epochs: list[int]
) -> dict[tuple[int, int], float]:
    loader = build_loader(
        _RandomCrops(),
        batch_size=4,
        train=True,
        workers=workers,
        seed=7,
        info=info(0, 1, 1),
        persistent_workers=persistent,
    )
    seen = {}
    for epoch in epochs:
        set_epoch(loader, epoch)
        for indices, values in loader:
            seen.update({(epoch, int(i)): float(v) for i, v in zip(indices, values, strict=True)})
    return seen


def test_augmentation_depends_only_on_seed_epoch_and_sample() -> None:
    straight = _augmentations(0, False, [0, 1, 2])
    assert len(straight) == 36  # every sample in every epoch
    assert straight[(0, 3)] != straight[(1, 3)]  # a new draw each epoch
    # Any worker count, persistent or not, and a "resumed" loader started at epoch 2:
    assert _augmentations(2, True, [0, 1, 2]) == straight
    assert _augmentations(1, False, [0, 1, 2]) == straight
    resumed = _augmentations(2, True, [2])
    assert resumed == {k: v for k, v in straight.items() if k[0] == 2}


def test_in_process_loading_leaves_the_training_rngs_alone() -> None:
    loader = build_loader(_RandomCrops(), batch_size=4, train=True, workers=0, info=info(0, 1, 1))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    list(loader)
    assert torch.equal(torch.rand(3), expected)


def test_epochs_advance_without_set_epoch() -> None:
    loader = build_loader(_RandomCrops(), batch_size=12, train=True, workers=0, info=info(0, 1, 1))
    first, second = (next(iter(loader))[0].tolist() for _ in range(2))
    set_epoch(loader, 0)
    again = next(iter(loader))[0].tolist()
    assert first == again  # epoch 0 again
    assert first != second  # the second pass was epoch 1, not a repeat of epoch 0


class _Photos(Dataset[tuple[torch.Tensor, int]]):
    """Random crops of small images through the real train_transform, and each index."""

    def __init__(self) -> None:
        self.classes = ["cat", "dog"]
        shape, rng = (6, 3, 40, 56), torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, shape, generator=rng, dtype=torch.uint8)
        self.transform = train_transform(16)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[index]), index


@pytest.mark.timeout(120)
def test_training_loader_dataset_reads_like_the_dataset_it_wraps() -> None:
    photos = _Photos()
    loader = build_loader(
        photos,
        batch_size=3,
        train=True,
        workers=2,
        seed=4,
        info=info(0, 1, 1),
        persistent_workers=False,  # no worker outlives the epoch, even if an assert fails
    )
    dataset = loader.dataset
    assert dataset.dataset is photos  # type: ignore[attr-defined]
    assert len(dataset) == 6  # type: ignore[arg-type]
    assert dataset.classes == ["cat", "dog"]  # type: ignore[attr-defined]

    set_epoch(loader, 0)
    epoch0 = {
        int(i): image
        for images, indices in loader
        for image, i in zip(images, indices, strict=True)
    }
    torch.manual_seed(11)
    expected = torch.rand(2)
    torch.manual_seed(11)
    # An int index gives the sample as epoch 0 augmented it, in whichever worker.
    for i in range(6):
        image, index = dataset[i]
        assert index == i
        assert torch.equal(image, epoch0[i])
    assert torch.equal(dataset[-1][0], epoch0[5])
    assert dataset[np.int64(2)][1] == 2
    assert torch.equal(torch.rand(2), expected)  # the caller's RNGs are left alone
    with pytest.raises(TypeError, match="takes an int index"):
        dataset[1:3]


def test_eval_sampler_takes_numpy_counts_and_refuses_bools_and_floats() -> None:
    sampler = DistributedEvalSampler(np.int64(5), num_replicas=np.int64(2), rank=np.int64(1))  # type: ignore[arg-type]
    assert list(sampler) == [1, 3]
    assert isinstance(sampler.rank, int)
    for given in ({"dataset_or_len": True}, {"dataset_or_len": 5.0}, {"num_replicas": 2.0},
                  {"rank": True}):  # fmt: skip
        arguments = {"dataset_or_len": 5, "num_replicas": 2, "rank": 0, **given}
        with pytest.raises(ValueError, match=r"must be a whole number, got (True|5\.0|2\.0)"):
            DistributedEvalSampler(**arguments)
