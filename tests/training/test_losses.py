"""FocalLoss: cross_entropy at gamma=0, hand-computed values, numerics and validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ddpkit.training.losses import FocalLoss

C = 5
WEIGHTS = [0.5, 1.0, 2.0, 0.25, 1.5]


def _batch(
    extra: tuple[int, ...] = (), ignore: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, C, *extra, generator=g) * 3
    target = torch.randint(0, C, (6, *extra), generator=g)
    if ignore:
        target.view(-1)[::3] = -100
    return logits, target


@pytest.mark.parametrize("extra", [(), (3,)], ids=["NC", "NCd"])
@pytest.mark.parametrize("ignore", [False, True], ids=["all", "ignored"])
@pytest.mark.parametrize("smooth", [0.0, 0.1])
@pytest.mark.parametrize("alpha", [None, "weights", 0.25], ids=["plain", "weights", "float"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gamma_zero_is_cross_entropy(
    reduction: str, alpha: str | float | None, smooth: float, ignore: bool, extra: tuple[int, ...]
) -> None:
    logits, target = _batch(extra, ignore)
    weight = torch.tensor(WEIGHTS) if alpha == "weights" else None
    expected = F.cross_entropy(
        logits, target, weight=weight, label_smoothing=smooth, reduction=reduction
    )
    if isinstance(alpha, float):
        expected = expected * alpha
    crit = FocalLoss(
        alpha=WEIGHTS if alpha == "weights" else alpha,  # type: ignore[arg-type]
        gamma=0.0,
        smooth=smooth,
        reduction=reduction,  # type: ignore[arg-type]
    )
    got = crit(logits, target)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _hand_loss(
    logits: list[list[float]], target: list[int], gamma: float, smooth: float, w: list[float]
) -> list[float]:
    out = []
    for row, y in zip(logits, target, strict=True):
        z = sum(math.exp(v) for v in row)
        p = [math.exp(v) / z for v in row]
        q = [(1 - smooth) * (c == y) + smooth / len(row) for c in range(len(row))]
        out.append(-sum(w[c] * q[c] * (1 - p[c]) ** gamma * math.log(p[c]) for c in range(len(p))))
    return out


def test_gamma_two_matches_hand_computation() -> None:
    logits = [[1.0, 2.0, 0.5], [0.3, -1.0, 2.0]]
    target = [1, 0]
    x, y = torch.tensor(logits), torch.tensor(target)

    plain = _hand_loss(logits, target, 2.0, 0.0, [1.0, 1.0, 1.0])
    got = FocalLoss(gamma=2, reduction="none")(x, y)
    torch.testing.assert_close(got, torch.tensor(plain))
    torch.testing.assert_close(FocalLoss(gamma=2)(x, y), torch.tensor(sum(plain) / 2))

    w = [1.0, 2.0, 0.5]
    weighted = _hand_loss(logits, target, 2.0, 0.1, w)
    crit = FocalLoss(num_class=3, alpha=w, gamma=2, smooth=0.1)
    # "mean" with per-class weights divides by the targets' weights: w[1] + w[0].
    torch.testing.assert_close(crit(x, y), torch.tensor(sum(weighted) / (w[1] + w[0])))
    scaled = FocalLoss(alpha=0.25, gamma=2, smooth=0.1, reduction="sum")(x, y)
    torch.testing.assert_close(
        scaled, torch.tensor(0.25 * sum(_hand_loss(logits, target, 2, 0.1, [1.0] * 3)))
    )


@pytest.mark.parametrize("smooth", [0.0, 0.1])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_extreme_logits_give_finite_loss_and_gradients(
    dtype: torch.dtype, gamma: float, smooth: float
) -> None:
    # Row 0 is certain and right (p = 1), row 1 certain and wrong (p = 0).
    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 0.0]], dtype=dtype, requires_grad=True)
    target = torch.tensor([0, 0])
    loss = FocalLoss(gamma=gamma, smooth=smooth, alpha=[1.0, 2.0, 1.0])(logits, target)
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    loss.backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_give_float32_close_to_float32(dtype: torch.dtype) -> None:
    logits, target = _batch(seed=1)
    crit = FocalLoss(gamma=2, smooth=0.1, reduction="none")
    reference = crit(logits, target)
    got = crit(logits.to(dtype), target)
    assert got.dtype == torch.float32
    # The same computation on the rounded logits, and close to the unrounded one.
    torch.testing.assert_close(got, crit(logits.to(dtype).float(), target), rtol=0, atol=0)
    torch.testing.assert_close(got, reference, rtol=5e-2, atol=5e-2)


def test_float64_logits_stay_float64() -> None:
    logits, target = _batch(seed=2)
    got = FocalLoss(gamma=0, alpha=WEIGHTS)(logits.double(), target)
    assert got.dtype == torch.float64
    expected = F.cross_entropy(logits.double(), target, weight=torch.tensor(WEIGHTS).double())
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("alpha", [None, WEIGHTS])
def test_all_ignored_batch_matches_cross_entropy(alpha: list[float] | None) -> None:
    logits = torch.randn(4, C)
    target = torch.full((4,), -100)
    weight = None if alpha is None else torch.tensor(alpha)
    for reduction in ("mean", "sum", "none"):
        expected = F.cross_entropy(logits, target, weight=weight, reduction=reduction)
        got = FocalLoss(alpha=alpha, smooth=0.1, reduction=reduction)(logits, target)
        torch.testing.assert_close(got, expected, equal_nan=True)
    assert torch.isnan(FocalLoss()(logits, target))


def test_ignored_samples_count_zero_and_get_no_gradient() -> None:
    logits, target = _batch(ignore=True)
    logits.requires_grad_(True)
    per_sample = FocalLoss(gamma=2, smooth=0.1, reduction="none")(logits, target)
    assert (per_sample[target == -100] == 0).all()
    per_sample.sum().backward()
    assert logits.grad is not None
    assert (logits.grad[target == -100] == 0).all()


@pytest.mark.parametrize("bad", [C, -1, 99])
def test_targets_outside_the_classes_are_rejected(bad: int) -> None:
    logits, target = _batch()
    target[2] = bad
    with pytest.raises(ValueError, match=rf"target values \[{bad}\] are outside the 5 classes"):
        FocalLoss()(logits, target)


def test_ignore_index_may_be_any_value() -> None:
    logits, target = _batch()
    target[0] = 7
    got = FocalLoss(gamma=0, ignore_index=7)(logits, target)
    torch.testing.assert_close(got, F.cross_entropy(logits, target, ignore_index=7))


def test_shape_and_class_count_mismatches_are_rejected() -> None:
    logits, target = _batch()
    with pytest.raises(ValueError, match=r"logits have 5 classes .* num_class=4"):
        FocalLoss(num_class=4)(logits, target)
    with pytest.raises(ValueError, match="alpha has 3 weights but logits have 5"):
        FocalLoss(alpha=[1.0, 1.0, 1.0])(logits, target)
    with pytest.raises(ValueError, match=r"target must hold class indices of shape \(6,\)"):
        FocalLoss()(logits, target[:4])
    with pytest.raises(ValueError, match="target must hold class indices"):
        FocalLoss()(logits, target.float())  # float indices: neither indices nor probabilities
    with pytest.raises(ValueError, match=r"logits must be \(N, C\)"):
        FocalLoss()(logits[0], target[0])


def test_seed_recipe_call_scales_the_loss_by_alpha() -> None:
    logits, target = _batch(seed=3)
    seed_call = FocalLoss(alpha=0.25, gamma=2, num_class=5, smooth=0.1)
    unscaled = FocalLoss(gamma=2, num_class=5, smooth=0.1)
    torch.testing.assert_close(seed_call(logits, target), 0.25 * unscaled(logits, target))


def test_num_classes_alias() -> None:
    assert FocalLoss(num_classes=5).num_class == 5
    assert FocalLoss(5, num_classes=5).num_class == 5
    with pytest.raises(ValueError, match="num_class=4 and num_classes=5 disagree"):
        FocalLoss(4, num_classes=5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gamma": -1.0}, "gamma must be"),
        ({"gamma": float("nan")}, "gamma must be"),
        ({"smooth": 1.0}, "smooth must be in"),
        ({"smooth": -0.1}, "smooth must be in"),
        ({"reduction": "avg"}, "reduction must be"),
        ({"alpha": 0.0}, "must be > 0"),
        ({"alpha": [1.0, -1.0]}, "finite numbers >= 0"),
        ({"alpha": [[1.0, 2.0]]}, "finite numbers >= 0"),
        ({"alpha": [1.0, 2.0], "num_class": 3}, "alpha has 2 weights but num_class=3"),
        ({"num_class": 0}, "num_class must be at least 1"),
    ],
)
def test_invalid_parameters_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FocalLoss(**kwargs)  # type: ignore[arg-type]


def test_class_weights_are_a_non_persistent_buffer_that_follows_to() -> None:
    crit = FocalLoss(alpha=torch.tensor(WEIGHTS), gamma=0)
    assert crit.weight is not None
    assert "weight" not in crit.state_dict()
    crit.load_state_dict({})  # checkpoints carry no weights, so an empty one loads
    crit = crit.to(torch.float64)
    assert crit.weight is not None
    assert crit.weight.dtype == torch.float64
    logits, target = _batch(ignore=True)
    expected = F.cross_entropy(logits, target, weight=torch.tensor(WEIGHTS))
    torch.testing.assert_close(crit(logits, target), expected)


def test_extra_repr_names_the_settings() -> None:
    assert "alpha=0.25, gamma=2, smooth=0.1" in repr(FocalLoss(alpha=0.25, smooth=0.1))
    assert "alpha=[0.5, 1, 2, 0.25, 1.5]" in repr(FocalLoss(alpha=WEIGHTS))
    assert "num_class=5" in repr(FocalLoss(num_class=5))
