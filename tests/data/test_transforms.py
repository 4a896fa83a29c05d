"""ddpkit.data.transforms: the uint8 tensor path, the PIL path and normalize_batch."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_sample_images  # type: ignore[import-untyped]
from timm.data.auto_augment import rand_augment_transform
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as tvf

from ddpkit.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    normalize_batch,
    train_transform,
    val_transform,
)
from ddpkit.rng import sample_seed, seeded

_Factory = Callable[..., Callable[[Any], torch.Tensor]]
_PHOTOS = [np.ascontiguousarray(a) for a in load_sample_images().images]  # 427 x 640 RGB


def _photo(layout: str = "chw", index: int = 0) -> torch.Tensor:
    # pil_to_tensor and decode_jpeg return a channels-last strided CHW view ("hwc").
    t = torch.from_numpy(_PHOTOS[index].copy()).permute(2, 0, 1)
    return t.contiguous() if layout == "chw" else t


def _gray_as_rgb() -> torch.Tensor:
    pil = Image.fromarray(_PHOTOS[1]).convert("L").convert("RGB")
    tensor: torch.Tensor = tvf.pil_to_tensor(pil)
    return tensor


def _inputs() -> list[torch.Tensor]:
    tall = _photo()[:, :, :300]  # portrait, 427 x 300
    return [_photo("chw"), _photo("hwc"), tall, _gray_as_rgb()]


@pytest.mark.parametrize("make", [train_transform, val_transform])
@pytest.mark.parametrize("size", [224, 160])
def test_tensor_transforms_give_contiguous_uint8_squares(make: _Factory, size: int) -> None:
    transform = make(size)
    for img in _inputs() * 4:  # several draws: flipped and unflipped crops
        out = transform(img)
        assert out.dtype == torch.uint8
        assert out.shape == (3, size, size)
        assert out.is_contiguous()


@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_val_tensor_matches_independent_resize_and_center_crop(layout: str) -> None:
    img = _photo(layout)
    out = val_transform(224, 256)(img)
    assert torch.equal(out, val_transform(224, 256)(img))
    height, width = img.shape[-2:]  # 427 x 640: the shorter side is the height
    resized = tvf.resize(img, [256, int(256 * width / height)], antialias=True)
    top = round((resized.shape[-2] - 224) / 2)
    left = round((resized.shape[-1] - 224) / 2)
    assert torch.equal(out, resized[:, top : top + 224, left : left + 224])


@pytest.mark.parametrize("decode", ["tensor", "pil"])
def test_val_resize_defaults_to_the_imagenet_proportion_of_size(decode: str) -> None:
    # 256 for 224: the centre crop keeps 7/8 of the shorter side at any size.
    img: Any = _photo() if decode == "tensor" else Image.fromarray(_PHOTOS[0])
    for size, resize in [(224, 256), (32, 37), (160, 183)]:
        out = val_transform(size, decode=decode)(img)  # type: ignore[arg-type]
        assert torch.equal(out, val_transform(size, resize, decode=decode)(img))  # type: ignore[arg-type]
    small = val_transform(32, decode=decode)(img)  # type: ignore[arg-type]
    assert not torch.equal(small, val_transform(32, 256, decode=decode)(img))  # type: ignore[arg-type]
    explicit = val_transform(32, 64, decode=decode)(img)  # type: ignore[arg-type]
    assert not torch.equal(explicit, small)  # an explicit resize still wins
    if decode == "tensor":
        assert repr(val_transform(32)) == "val_transform(32, 37)"
        height, width = img.shape[-2:]
        resized = tvf.resize(img, [64, int(64 * width / height)], antialias=True)
        left = round((resized.shape[-1] - 32) / 2)
        assert torch.equal(explicit, resized[:, 16:48, left : left + 32])


def test_train_without_hflip_keeps_the_crop_and_never_mirrors() -> None:
    img = _photo()
    flipping, plain = train_transform(64), train_transform(64, hflip=False)
    mirrored = 0
    for seed in range(16):
        torch.manual_seed(seed)
        a = flipping(img)
        torch.manual_seed(seed)
        b = plain(img)
        # The same seed draws the same box, with the flip or without it.
        assert torch.equal(a, b) or torch.equal(a, b.flip(-1))
        mirrored += not torch.equal(a, b)
    assert mirrored > 0
    aspect = img.shape[-1] / img.shape[-2]
    whole = train_transform(96, scale=(1.0, 1.0), ratio=(aspect, aspect), hflip=False)
    expected = tvf.resize(img, [96, 96], antialias=True)
    assert all(torch.equal(whole(img), expected) for _ in range(20))
    assert "hflip=False" in repr(pickle.loads(pickle.dumps(whole)))


def test_pil_train_without_hflip_never_mirrors() -> None:
    pil = Image.fromarray(_PHOTOS[0])
    aspect = pil.width / pil.height
    options: dict[str, Any] = {"scale": (1.0, 1.0), "ratio": (aspect, aspect), "decode": "pil"}
    torch.manual_seed(0)
    plain = [train_transform(48, hflip=False, **options)(pil) for _ in range(12)]
    assert all(torch.equal(out, plain[0]) for out in plain)
    torch.manual_seed(0)
    flipping = [train_transform(48, **options)(pil) for _ in range(12)]
    assert any(torch.equal(out, plain[0].flip(-1)) for out in flipping)


def test_train_tensor_is_random_but_reproducible() -> None:
    transform = train_transform(224)
    img = _photo("hwc")
    torch.manual_seed(123)
    first = [transform(img) for _ in range(4)]
    torch.manual_seed(123)
    again = [transform(img) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1])


def test_train_tensor_same_result_for_both_memory_layouts() -> None:
    transform = train_transform(224)
    torch.manual_seed(7)
    a = [transform(_photo("chw")) for _ in range(5)]
    torch.manual_seed(7)
    b = [transform(_photo("hwc")) for _ in range(5)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_train_tensor_full_image_crop_is_a_plain_resize_or_its_mirror() -> None:
    img = _photo()
    aspect = img.shape[-1] / img.shape[-2]
    transform = train_transform(96, scale=(1.0, 1.0), ratio=(aspect, aspect))
    expected = tvf.resize(img, [96, 96], antialias=True)
    seen_flip = seen_plain = False
    for _ in range(20):
        out = transform(img)
        seen_plain |= torch.equal(out, expected)
        seen_flip |= torch.equal(out, expected.flip(-1))
    assert seen_plain
    assert seen_flip


def test_train_tensor_falls_back_to_a_central_crop() -> None:
    # No 3:1 crop of the whole area fits a 427 x 640 image, so after its tries
    # RandomResizedCrop takes the widest 3:1 box in the centre.
    img = _photo()
    out = train_transform(64, scale=(1.0, 1.0), ratio=(3.0, 3.0))(img)
    h = round(640 / 3)
    expected = tvf.resized_crop(img, (427 - h) // 2, 0, h, 640, [64, 64], antialias=True)
    assert torch.equal(out, expected) or torch.equal(out, expected.flip(-1))


def test_train_tensor_crop_boxes_follow_torchvision_distribution() -> None:
    # The crop box is drawn with its own code; its distribution must be
    # RandomResizedCrop's. Fixed seeds make the comparison deterministic.
    height, width, n = 427, 640, 4000
    ours = train_transform(224)
    theirs = v2.RandomResizedCrop(224)
    image = torch.zeros(3, height, width, dtype=torch.uint8)
    box = ours._box  # type: ignore[attr-defined]
    torch.manual_seed(0)
    a = torch.tensor([box(height, width, torch.rand(41).tolist()) for _ in range(n)]).double()
    b = torch.tensor([list(theirs.make_params([image]).values()) for _ in range(n)]).double()
    for column in range(4):  # top, left, height, width
        x, y = a[:, column], b[:, column]
        standard_error = ((x.var() + y.var()) / n).sqrt()
        assert abs(x.mean() - y.mean()) < 4.5 * standard_error
        assert abs(x.std() - y.std()) < 0.08 * y.std()


def test_tensor_transforms_survive_pickling() -> None:
    transform = pickle.loads(pickle.dumps(train_transform(128)))
    torch.manual_seed(0)
    a = transform(_photo())
    torch.manual_seed(0)
    assert torch.equal(a, train_transform(128)(_photo()))
    assert repr(transform).startswith("train_transform(128")


def test_tensor_transform_refuses_pil_images_and_batches() -> None:
    with pytest.raises(TypeError, match="decode='pil'"):
        train_transform()(Image.fromarray(_PHOTOS[0]))
    with pytest.raises(ValueError, match=r"\(2, 3, 427, 640\)"):
        val_transform()(torch.stack([_photo(), _photo()]))


@pytest.mark.parametrize("make", [train_transform, val_transform])
def test_pil_transforms_give_normalised_float(make: _Factory) -> None:
    out = make(224, decode="pil")(Image.fromarray(_PHOTOS[0]))
    assert out.dtype == torch.float32
    assert out.shape == (3, 224, 224)
    # Normalised, so well outside [0, 1].
    assert out.min() < -1.0
    assert out.max() > 1.0


def test_tensor_and_pil_val_paths_agree_after_normalisation() -> None:
    pil = Image.fromarray(_PHOTOS[0])
    by_pil = val_transform(decode="pil")(pil)
    by_tensor = normalize_batch(val_transform()(tvf.pil_to_tensor(pil))[None])[0]
    # Measured: about 3e-5 on average, at most one uint8 step (0.0175) per pixel.
    assert (by_pil - by_tensor).abs().mean() < 0.01


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'tensor' or 'pil'.*'numpy'"):
        train_transform(decode="numpy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'tensor' or 'pil'"):
        val_transform(decode="PIL")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size"):
        train_transform(0)
    with pytest.raises(ValueError, match="scale"):
        train_transform(scale=(1.0, 0.5))
    with pytest.raises(ValueError, match="resize"):
        val_transform(224, 0)


def _reference(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (x.double() / 255 - mean.double()) / std.double()


def test_normalize_batch_matches_the_textbook_formula() -> None:
    x = torch.randint(0, 256, (4, 3, 17, 23), dtype=torch.uint8)
    out = normalize_batch(x)
    assert out.dtype == torch.float32
    assert out.shape == x.shape
    torch.testing.assert_close(out.double(), _reference(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(normalize_batch(x[0]).double(), _reference(x[0]), atol=1e-6, rtol=0)


def test_normalize_batch_float_input_is_taken_as_unit_range_and_kept() -> None:
    x = torch.rand(2, 3, 5, 5)
    before = x.clone()
    out = normalize_batch(x)
    torch.testing.assert_close(out.double(), _reference(x * 255), atol=1e-6, rtol=0)
    assert torch.equal(x, before)


def test_normalize_batch_keeps_channels_last() -> None:
    x = torch.randint(0, 256, (2, 3, 8, 9), dtype=torch.uint8)
    out = normalize_batch(x.contiguous(memory_format=torch.channels_last))
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.double(), _reference(x), atol=1e-6, rtol=0)


def test_normalize_batch_bfloat16() -> None:
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    out = normalize_batch(x, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(x), atol=3e-2, rtol=1e-2)


def test_normalize_batch_custom_stats_and_wrong_channel_count() -> None:
    x = torch.full((1, 1, 2, 2), 255, dtype=torch.uint8)
    assert torch.allclose(normalize_batch(x, (0.5,), (0.25,)), torch.full((1, 1, 2, 2), 2.0))
    with pytest.raises(ValueError, match=r"3 channels.*\(1, 1, 2, 2\)"):
        normalize_batch(x)
    with pytest.raises(ValueError, match="channels"):
        normalize_batch(torch.zeros(3, 4, dtype=torch.uint8))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensor_transforms_and_normalize_on_cuda() -> None:
    img = _photo().cuda()
    assert train_transform(64)(img).shape == (3, 64, 64)
    on_gpu = val_transform(64, 72)(img).cpu().int()
    # The GPU resizes in float and rounds; the CPU's uint8 kernel may differ by one.
    assert (on_gpu - val_transform(64, 72)(img.cpu()).int()).abs().max() <= 1
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    torch.testing.assert_close(normalize_batch(x.cuda()).cpu(), normalize_batch(x))


@pytest.mark.parametrize("preset", ["rand", "trivial", "augmix"])
def test_presets_are_uint8_in_and_out_and_drawn_from_the_sample_seed(preset: str) -> None:
    transform = train_transform(64, auto_augment=preset, magnitude=9, random_erase=0.5)  # type: ignore[arg-type]
    img = _photo()

    def draw(epoch: int, index: int) -> torch.Tensor:
        with seeded(sample_seed(7, epoch, index)):
            return transform(img)

    first = draw(0, 3)
    assert first.dtype == torch.uint8
    assert first.shape == (3, 64, 64)
    assert first.is_contiguous()
    assert torch.equal(first, draw(0, 3))  # same (seed, epoch, index): the same image
    others = [draw(0, i) for i in range(4, 10)] + [draw(1, 3)]
    assert all(not torch.equal(first, o) for o in others)  # another index or epoch: new draws
    plain = train_transform(64)
    with seeded(sample_seed(7, 0, 3)):
        crop = plain(img)
    assert not torch.equal(first, crop)  # the preset changed the crop


def test_random_erase_erases_with_its_probability() -> None:
    transform = train_transform(
        32, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=False, random_erase=0.5
    )
    img = torch.full((3, 40, 40), 200, dtype=torch.uint8)
    erased = 0
    for i in range(200):
        with seeded(i):
            erased += bool((transform(img) == 0).any())
    assert 70 < erased < 130  # p = 0.5 over 200 draws: 100 +- 3.5 standard deviations


@pytest.mark.parametrize("preset", ["rand", "trivial", "augmix", None])
def test_pil_presets_repeat_under_a_seed_and_give_normalised_float(preset: str | None) -> None:
    transform = train_transform(48, decode="pil", auto_augment=preset, random_erase=0.3)  # type: ignore[arg-type]
    pil = Image.fromarray(_PHOTOS[0])
    with seeded(5):
        a = transform(pil)
    with seeded(5):
        b = transform(pil)
    assert a.dtype == torch.float32
    assert a.shape == (3, 48, 48)
    assert torch.equal(a, b)


def test_presets_survive_pickling_and_bad_strengths_are_refused() -> None:
    transform = train_transform(32, auto_augment="rand", num_ops=3, magnitude=15)
    again = pickle.loads(pickle.dumps(transform))
    with seeded(1):
        a = transform(_photo())
    with seeded(1):
        assert torch.equal(a, again(_photo()))
    with pytest.raises(ValueError, match=r"auto_augment must be None or one of .*'autoaug'"):
        train_transform(auto_augment="autoaug")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"magnitude must be a whole number in 1\.\.10 .*got 11"):
        train_transform(auto_augment="augmix", magnitude=11)
    with pytest.raises(ValueError, match=r"magnitude must be a whole number in 0\.\.30 .*got 31"):
        train_transform(auto_augment="rand", magnitude=31)
    with pytest.raises(ValueError, match="num_ops must be a whole number, 1 or more, got 0"):
        train_transform(auto_augment="rand", num_ops=0)
    with pytest.raises(ValueError, match=r"random_erase is a probability in 0\.\.1, got 1.5"):
        train_transform(random_erase=1.5)


def _rotations(magnitude: int, angles: tuple[float, ...]) -> dict[float, int]:
    """How often RandAugment (one op) at ``magnitude`` rotated a test image by each angle."""
    image = torch.randint(0, 256, (3, 32, 32), generator=torch.Generator().manual_seed(0),
                          dtype=torch.uint8)  # fmt: skip
    # The whole image as the crop: only RandAugment changes it.
    transform = train_transform(32, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=False,
                                auto_augment="rand", magnitude=magnitude, num_ops=1)  # fmt: skip
    rotated = {a: tvf.rotate(image, a, interpolation=v2.InterpolationMode.NEAREST) for a in angles}
    seen = dict.fromkeys(angles, 0)
    for seed in range(300):
        with seeded(seed):
            out = transform(image)
        for angle, expected in rotated.items():
            seen[angle] += int(torch.equal(out, expected))
    return seen


def test_rand_magnitude_is_torchvisions_m_over_30_and_timms_m9_is_about_27() -> None:
    # What the docstring says: magnitude m is m/30 of each op's strongest (Rotate: m
    # degrees of 30); the default 9 rotates by 9 degrees, timm's rand-m9 by 27.
    seen = _rotations(9, (9.0, -9.0, 27.0, -27.0, 2.7, -2.7))
    assert seen[9.0] > 0
    assert seen[-9.0] > 0
    assert seen[27.0] == seen[-27.0] == seen[2.7] == seen[-2.7] == 0
    seen = _rotations(27, (27.0, -27.0, 9.0))
    assert seen[27.0] > 0
    assert seen[-27.0] > 0
    assert seen[9.0] == 0
    timm = rand_augment_transform("rand-m9-n2", {})
    rotate = next(op for op in timm.ops if op.name == "Rotate")
    assert abs(rotate.level_fn(rotate.magnitude, rotate.hparams)[0]) == 27.0
    assert "m / 30" in (train_transform.__doc__ or "")
    assert "about ``magnitude=27, num_ops=2``" in (train_transform.__doc__ or "")
    with pytest.raises(ValueError, match="timm's rand-m9 is about 27 here"):
        train_transform(auto_augment="rand", magnitude=31)
