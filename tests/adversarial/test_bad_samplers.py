"""Labels, weights and sizes the balanced sampler cannot draw from: refused when it is built.

Each is a ``ValueError`` naming the argument, the value seen and what to do, raised by
``class_weights`` or ``WeightedDistributedSampler`` (and so by ``build_loader``) before the
first batch, never torch's words at the first batch ("number of categories cannot exceed
2^24", "invalid multinomial distribution") nor a silent truncation of a label or
flattening of a table. And what is right but large or extreme is drawn: more than 2**24
samples, weights of 1e308, labels of any value.

Kinds: labels (not whole, not finite, negative, too large, strings, bools, objects, 2-D,
a single value, none, ragged); weights (2-D, bools, strings, complex, a single float, none,
negative, not finite, all zero, overflowing sums); counts (``num_samples``, ``repeats``,
``num_replicas``, ``rank``, ``seed``, ``epoch``: zero, negative, bools, floats, strings,
more draws than an epoch holds); the other samplers' counts.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
import torch
from loader_fixtures import Indices, info
from torch.utils.data import Dataset

from ddpkit.data import DistributedEvalSampler, build_loader
from ddpkit.data.balanced import MAX_DRAWS, WeightedDistributedSampler, class_weights
from ddpkit.data.samplers import EpochRandomSampler

BAD_LABELS: list[tuple[Any, str]] = [
    ([0.5, 1.7, 1.2], r"whole class indices, and sample 0 has 0\.5"),
    ([0, 1.7, 1.0], r"whole class indices, and sample 1 has 1\.7"),
    (np.array([2.0, 0.25]), r"sample 1 has 0\.25"),
    (torch.tensor([1.0, 2.5]), r"sample 1 has 2\.5"),
    ([0.0, float("nan")], r"sample 1 has nan"),
    ([float("inf"), 0.0], r"sample 0 has inf"),
    ([0, -1, 2], r"0 or more\), and sample 1 has -1"),
    (torch.tensor([3, -2]), r"sample 1 has -2"),
    ([-3.0], r"sample 0 has -3\.0"),
    ([0.0, 2.0**63], r"below 2\*\*63, and sample 1 has 9\.2"),
    (np.array([1, 2**63], dtype=np.uint64), r"below 2\*\*63, and sample 1 has 9223372036854775808"),
    (["cat", "dog", "cat"], r"must be numbers.*'cat'.*np\.unique"),
    (np.array(["1", "0"]), r"must be numbers.*'1'"),
    ([None, 1], r"must be numbers.*object"),
    ([True, False, True], r"got bools"),
    (torch.tensor([True, False]), r"got bools"),
    ([[0, 1], [1, 0]], r"must be 1-D.*shape \(2, 2\).*argmax"),
    (np.zeros((3, 1), dtype=np.int64), r"must be 1-D.*shape \(3, 1\)"),
    (torch.zeros(2, 3), r"must be 1-D.*shape \(2, 3\)"),
    (3, r"must be 1-D.*single value 3"),
    (torch.tensor(1), r"must be 1-D.*single value"),
    ("abc", r"must be 1-D.*single value 'abc'"),
    ([], r"got none"),
    ([[0], [1, 2]], r"NumPy cannot make an array"),
]


@pytest.mark.parametrize(("labels", "said"), BAD_LABELS)
def test_labels_that_are_not_whole_class_indices_are_refused_naming_them(
    labels: Any, said: str
) -> None:
    with pytest.raises(ValueError, match=r"^targets must") as caught:
        class_weights(labels)
    assert caught.match(said)
    assert "troubleshooting.md#weighted-balanced-and-repeated-sampling" in str(caught.value)


class Labelled(Dataset[int]):
    def __init__(self, targets: Any) -> None:
        self.targets = targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> int:
        return index


def test_build_loader_balance_refuses_non_integer_targets_before_anything_is_built() -> None:
    with pytest.raises(
        ValueError, match=r"targets must be whole class indices, and sample 0 has 0\.5"
    ):
        build_loader(Labelled([0.5, 1.7, 1.2]), batch_size=1, train=True, workers=0,
                     info=info(0, 1), balance=1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"targets must be 1-D.*shape \(4, 2\)"):
        build_loader(Labelled(np.eye(4, 2)), batch_size=1, train=True, workers=0,
                     info=info(0, 1), balance=1.0)  # fmt: skip


def test_whole_labels_of_any_kind_and_value_give_the_same_weights() -> None:
    expected = class_weights([0, 1, 1])
    assert torch.allclose(expected, torch.tensor([0.5, 0.25, 0.25]))
    for same in (
        [0.0, 1.0, 1.0],
        np.array([0, 1, 1], dtype=np.uint8),
        torch.tensor([0, 1, 1]),
        torch.tensor([0.0, 1.0, 1.0], dtype=torch.float16),
        [7, 3, 3],  # any indices: only which samples share a class counts
        [0, 10**12, 10**12],  # a large index allocates nothing of its size
        [0, 2**63 - 1, 2**63 - 1],
    ):
        assert torch.equal(class_weights(same), expected), same


WEIGHTS = "weights must"
BAD_WEIGHTS: list[tuple[Any, str]] = [
    ([[1.0, 2.0], [3.0, 4.0]], r"must be 1-D.*shape \(2, 2\)"),
    (torch.ones(4, 1), r"must be 1-D.*shape \(4, 1\)"),
    ([True, False], r"got bools"),
    (torch.tensor([True, True]), r"got bools"),
    (["1", "2"], r"must be numbers.*'1'"),
    ([1 + 1j, 2], r"must be numbers.*complex"),
    (5.0, r"must be 1-D.*single value 5\.0"),
    (torch.tensor(2.0), r"must be 1-D.*single value"),
    ("ab", r"must be 1-D.*single value 'ab'"),
    ([], r"got none"),
    ([[1.0], [1.0, 2.0]], r"NumPy cannot make an array"),
    ([1.0, -1.0], r"sample 1 has -1\.0"),
    ([1.0, float("nan")], r"sample 1 has nan"),
    ([float("inf"), 1.0], r"sample 0 has inf"),
    (np.array([1.0, -np.inf]), r"sample 1 has -inf"),
    ([0.0, 0.0, 0.0], r"positive sum, got 3 weight\(s\) summing to 0"),
    ([None, 1.0], r"must be numbers.*object"),
]


@pytest.mark.parametrize(("weights", "said"), BAD_WEIGHTS)
def test_weights_that_are_not_one_number_per_sample_are_refused_when_built(
    weights: Any, said: str
) -> None:
    with pytest.raises(ValueError, match=WEIGHTS) as caught:
        WeightedDistributedSampler(weights, num_replicas=1, rank=0)
    assert caught.match(said)


def test_build_loader_refuses_a_table_of_weights_instead_of_flattening_it() -> None:
    table = torch.ones(6, 2)  # one row per sample: len() matches the dataset
    with pytest.raises(ValueError, match=r"weights must be 1-D.*shape \(6, 2\)"):
        build_loader(Indices(6), batch_size=2, train=True, workers=0, info=info(0, 1),
                     weights=table)  # fmt: skip


@pytest.mark.parametrize(
    "weights",
    [[1e308, 1e308], np.array([1e308, 1e308, 0.0]), [1.7e308] * 4, torch.full((3,), 3e38)],
)
def test_weights_whose_sum_overflows_are_drawn_by_their_ratios(weights: Any) -> None:
    sampler = WeightedDistributedSampler(weights, 4000, num_replicas=1, rank=0, seed=2)
    positive = [i for i, w in enumerate(np.asarray(weights, dtype=np.float64)) if w > 0]
    equal = [1 / len(positive) if i in positive else 0.0 for i in range(len(weights))]
    assert sampler.weights is not None
    assert torch.allclose(sampler.weights, torch.tensor(equal))
    counts = torch.bincount(torch.tensor(list(sampler)), minlength=len(weights))
    p = 1 / len(positive)
    for i in range(len(weights)):
        if i in positive:
            assert abs(counts[i] - 4000 * p) < 5 * math.sqrt(4000 * p * (1 - p)), counts
        else:
            assert counts[i] == 0


def test_a_weight_tensor_that_requires_grad_is_taken() -> None:
    weights = torch.tensor([1.0, 3.0], requires_grad=True)
    sampler = WeightedDistributedSampler(weights, 10, num_replicas=1, rank=0)
    assert torch.allclose(sampler.weights, torch.tensor([0.25, 0.75]))  # type: ignore[arg-type]


COUNTS: list[tuple[dict[str, Any], str]] = [
    ({"num_samples": 0}, r"num_samples must be a whole number, 1 or more, got 0"),
    ({"num_samples": -1}, r"num_samples must be .*got -1"),
    ({"num_samples": True}, r"num_samples must be .*got True \(bool\)"),
    ({"num_samples": 8.0}, r"num_samples must be .*got 8\.0 \(float\)"),
    ({"num_samples": 2.5}, r"num_samples must be .*got 2\.5"),
    ({"num_samples": "8"}, r"num_samples must be .*got '8' \(str\)"),
    ({"repeats": 0}, r"repeats must be .*got 0"),
    ({"repeats": False}, r"repeats must be .*got False"),
    ({"repeats": 2.0}, r"repeats must be .*got 2\.0"),
    ({"num_replicas": 0}, r"num_replicas must be a whole number, 1 or more, got 0"),
    ({"num_replicas": 2.0}, r"num_replicas must be .*got 2\.0"),
    ({"num_replicas": True}, r"num_replicas must be .*got True"),
    ({"rank": -1}, r"rank must be a whole number, 0 or more, got -1"),
    ({"rank": 1.0}, r"rank must be .*got 1\.0"),
    ({"rank": True, "num_replicas": 2}, r"rank must be .*got True"),
    ({"rank": 2, "num_replicas": 2}, r"rank 2 is outside 0\.\.1"),
    ({"seed": -1}, r"seed must be a whole number, 0\.\.9223372036854775807, got -1"),
    ({"seed": 2**63}, r"seed must be .*got 9223372036854775808"),
    ({"seed": 1.5}, r"seed must be .*got 1\.5"),
    ({"drop_last": "yes"}, r"drop_last must be True or False, got 'yes'"),
]


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize(("given", "said"), COUNTS)
def test_counts_that_are_not_whole_numbers_in_range_are_refused(
    given: dict[str, Any], said: str, weighted: bool
) -> None:
    arguments = {"num_replicas": 1, "rank": 0, **given}
    with pytest.raises(ValueError, match=said):
        WeightedDistributedSampler([1.0, 2.0, 3.0] if weighted else 3, **arguments)


@pytest.mark.parametrize(
    ("num_samples", "repeats"),
    [(10**12, 1), (MAX_DRAWS + 1, 1), (2**30, 3), (2**16, 2**16), (1, 10**15)],
)
def test_an_epoch_past_the_draws_it_can_hold_is_refused_at_once_with_the_bound(
    num_samples: int, repeats: int
) -> None:
    start = time.perf_counter()
    for weights in ([1.0, 2.0], 2):
        with pytest.raises(ValueError, match=r"draws an epoch, more than the 2\*\*31") as caught:
            WeightedDistributedSampler(
                weights, num_samples, repeats=repeats, num_replicas=1, rank=0
            )
        assert f"= {num_samples * repeats} draws" in str(caught.value)
        assert "draw fewer an epoch (num_samples)" in str(caught.value)
    assert time.perf_counter() - start < 1.0  # nothing of that size was allocated


def test_the_largest_epoch_is_accepted_without_drawing_it() -> None:
    sampler = WeightedDistributedSampler([1.0, 1.0], MAX_DRAWS // 2, repeats=2, num_replicas=4,
                                         rank=3)  # fmt: skip
    assert sampler.total == MAX_DRAWS
    assert len(sampler) == MAX_DRAWS // 4


def test_a_shuffle_of_more_samples_than_a_permutation_holds_is_refused() -> None:
    with pytest.raises(ValueError, match=r"a shuffle of 1099511627776 samples .*pass weights"):
        WeightedDistributedSampler(2**40, 100, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"at least one sample, got 0"):
        WeightedDistributedSampler(0, num_replicas=1, rank=0)


@pytest.mark.parametrize("epoch", [-1, 1.0, True, "2", 2**63])
def test_an_epoch_that_is_not_a_whole_number_is_refused(epoch: Any) -> None:
    sampler = WeightedDistributedSampler([1.0, 2.0], num_replicas=1, rank=0, seed=5)
    with pytest.raises(ValueError, match="epoch must be a whole number"):
        sampler.set_epoch(epoch)
    with pytest.raises(ValueError, match="epoch must be a whole number"):
        sampler.order(epoch)


def test_more_than_2_24_samples_are_drawn_by_their_weights() -> None:
    # torch.multinomial takes at most 2**24 categories; the sampler draws past it.
    n, draws = 2**24 + 10, 4000
    weights = torch.ones(n)
    weights[-10:] = n / 10  # the last 10 samples: half the total weight, 5 % each
    weights[:1000] = 0.0  # never drawn
    start = time.perf_counter()
    sampler = WeightedDistributedSampler(weights, draws, num_replicas=2, rank=1, seed=7)
    order = sampler.order(0)
    seconds = time.perf_counter() - start
    assert order.dtype == torch.int64
    assert len(order) == draws
    assert int(order.min()) >= 1000
    assert int(order.max()) < n
    tail = order >= n - 10
    p = n / (n + n - 1010)  # the tail's share of the total weight: about a half
    assert abs(int(tail.sum()) - draws * p) < 5 * math.sqrt(draws * p * (1 - p))
    assert len(set(order[tail].tolist())) == 10  # every one of the 10 is drawn
    assert int(order.max()) > 2**24  # indices past 2**24 come out
    body = order[~tail].double()  # uniform over 1000 .. n - 10
    assert abs(float(body.mean()) / n - 0.5) < 0.05
    mine = list(sampler.draws())  # rank 1 of 2: positions 1, 3, ...; the same order again
    assert mine == [(int(order[p]), p) for p in range(1, draws, 2)]
    assert seconds < 3.0, seconds


class Tail(Dataset[int]):
    """2**24 + 6 samples whose labels only ``targets`` holds."""

    def __init__(self) -> None:
        self.targets = torch.zeros(2**24 + 6, dtype=torch.int64)
        self.targets[-6:] = 1  # a class of 6 among 16.7 million

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> int:
        return index


def test_build_loader_balances_a_dataset_of_more_than_2_24_samples() -> None:
    loader = build_loader(Tail(), batch_size=500, train=True, workers=0, info=info(0, 1),
                          balance=1.0, num_samples=2000)  # fmt: skip
    data = loader.dataset.dataset  # type: ignore[attr-defined]
    labels = data.targets[torch.tensor([i for batch in loader for i in batch.tolist()])]
    assert len(labels) == 2000
    assert abs(int(labels.sum()) - 1000) < 5 * math.sqrt(2000 * 0.25)  # balanced: half each


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda: DistributedEvalSampler(True, num_replicas=1, rank=0), "dataset length"),
        (lambda: DistributedEvalSampler(5.0, num_replicas=1, rank=0), "dataset length"),  # type: ignore[arg-type]
        (lambda: DistributedEvalSampler(5, num_replicas=2.0, rank=0), "num_replicas"),  # type: ignore[arg-type]
        (lambda: DistributedEvalSampler(5, num_replicas=2, rank=True), "rank"),
        (lambda: DistributedEvalSampler(5, num_replicas=2, rank=0.0), "rank"),  # type: ignore[arg-type]
        (lambda: EpochRandomSampler(Indices(4), -1), "seed"),
        (lambda: EpochRandomSampler(Indices(4), 1.5), "seed"),  # type: ignore[arg-type]
        (lambda: EpochRandomSampler(Indices(4), 2**64), "seed"),
        (lambda: EpochRandomSampler(Indices(4), 0).set_epoch(-1), "epoch"),
        (lambda: EpochRandomSampler(Indices(4), 0).set_epoch(1.0), "epoch"),  # type: ignore[arg-type]
    ],
)
def test_the_other_samplers_refuse_counts_that_are_not_whole_numbers(make: Any, said: str) -> None:
    with pytest.raises(ValueError, match=f"{said} must be"):
        make()
