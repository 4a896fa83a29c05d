"""Mixup / CutMix batches, and FocalLoss on the probability targets they make."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddpkit import FocalLoss, mixup_cutmix


def _batch(n: int = 16, classes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(n, 3, 12, 12), torch.randint(0, classes, (n,))


def test_targets_become_probabilities_that_mix_two_labels() -> None:
    images, targets = _batch()
    mix = mixup_cutmix(5)
    for _ in range(10):  # both branches of the random choice
        mixed, soft = mix(images, targets)
        assert mixed.shape == images.shape
        assert soft.shape == (16, 5)
        torch.testing.assert_close(soft.sum(1), torch.ones(16))
        # Each row holds at most two labels: its own and its neighbour's in the batch.
        assert ((soft > 0).sum(1) <= 2).all()
        assert (soft[torch.arange(16), targets] > 0).all()


def test_mixup_alone_blends_the_images_with_their_neighbours() -> None:
    images, _ = _batch()
    # The first and last labels differ, so the first row's weight on its own label is lam.
    targets = torch.tensor([0, 1, 2, 3, 4] * 3 + [4])
    mixed, soft = mixup_cutmix(5, cutmix_alpha=0)(images, targets)
    lam = soft[0, 0].item()
    assert 0.0 < lam < 1.0
    assert soft[0, 4].item() == pytest.approx(1 - lam)
    # v2.MixUp pairs sample i with sample i - 1 (a rolled batch).
    torch.testing.assert_close(mixed[0], lam * images[0] + (1 - lam) * images[-1])


def test_cutmix_alone_pastes_a_box() -> None:
    images, targets = _batch()
    mixed, _ = mixup_cutmix(5, mixup_alpha=0)(images, targets)
    same = (mixed == images).all(dim=1)  # per pixel
    assert same.any()
    assert not same.all()


def test_the_draws_follow_torchs_generator() -> None:
    images, targets = _batch()
    mix = mixup_cutmix(5)
    torch.manual_seed(7)
    a = mix(images, targets)
    torch.manual_seed(7)
    b = mix(images, targets)
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])


def test_bad_arguments_and_a_second_mix_are_refused() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        mixup_cutmix(1)
    with pytest.raises(ValueError, match="both 0"):
        mixup_cutmix(5, mixup_alpha=0, cutmix_alpha=0)
    with pytest.raises(ValueError, match="mixup_alpha"):
        mixup_cutmix(5, mixup_alpha=-1)
    images, targets = _batch()
    mix = mixup_cutmix(5)
    _, soft = mix(images, targets)
    with pytest.raises(ValueError, match="mixed twice"):
        mix(images, soft)
    assert "MixUp" in repr(mix)
    assert "CutMix" in repr(mix)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smooth", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
def test_focal_loss_with_gamma_0_is_cross_entropy_on_probabilities(
    reduction: str, smooth: float, weighted: bool
) -> None:
    torch.manual_seed(3)
    logits = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    soft = torch.softmax(torch.randn(12, 5, dtype=torch.float64), dim=1)
    weights = [0.5, 1.0, 2.0, 1.5, 0.25] if weighted else None
    focal = FocalLoss(alpha=weights, gamma=0, smooth=smooth, reduction=reduction)  # type: ignore[arg-type]
    ce = F.cross_entropy(
        logits,
        soft,
        weight=torch.tensor(weights, dtype=torch.float64) if weighted else None,
        label_smoothing=smooth,
        reduction=reduction,
    )
    ours = focal(logits, soft)
    torch.testing.assert_close(ours, ce)
    (g1,) = torch.autograd.grad(ours.sum(), logits)
    (g2,) = torch.autograd.grad(ce.sum(), logits)
    torch.testing.assert_close(g1, g2)


def test_one_hot_probabilities_give_the_loss_of_the_indices() -> None:
    torch.manual_seed(4)
    logits, targets = torch.randn(10, 6), torch.randint(0, 6, (10,))
    focal = FocalLoss(alpha=0.25, gamma=2.0, smooth=0.1)
    torch.testing.assert_close(focal(logits, F.one_hot(targets, 6).float()), focal(logits, targets))


def test_focal_term_down_weights_confident_classes_with_soft_targets() -> None:
    logits = torch.tensor([[4.0, 0.0, 0.0]])
    soft = torch.tensor([[0.7, 0.3, 0.0]])
    p = logits.softmax(1)
    focal = [(1 - p[0, c]) ** 2 * p[0, c].log() for c in (0, 1)]
    expected = -(0.7 * focal[0] + 0.3 * focal[1])
    torch.testing.assert_close(FocalLoss(gamma=2)(logits, soft), expected)


def test_soft_targets_that_are_not_probabilities_are_refused() -> None:
    logits = torch.randn(4, 3)
    with pytest.raises(ValueError, match="probabilities"):
        FocalLoss()(logits, torch.full((4, 3), 0.5))  # rows sum to 1.5
    with pytest.raises(ValueError, match="probabilities"):
        FocalLoss()(logits, torch.tensor([[1.5, -0.5, 0.0]] * 4))  # a negative entry
    with pytest.raises(ValueError, match="shape"):
        FocalLoss()(logits, torch.full((4, 2), 0.5))  # the wrong number of classes


def test_probabilities_stored_in_bfloat16_are_accepted() -> None:
    torch.manual_seed(5)
    logits = torch.randn(64, 1000)
    soft = mixup_cutmix(1000, cutmix_alpha=0)(
        torch.randn(64, 3, 4, 4), torch.randint(0, 1000, (64,))
    )[1]
    loss = FocalLoss(smooth=0.1)(logits, soft.to(torch.bfloat16))
    torch.testing.assert_close(loss, FocalLoss(smooth=0.1)(logits, soft), atol=1e-2, rtol=1e-2)
