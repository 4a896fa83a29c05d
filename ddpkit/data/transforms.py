"""ImageNet-style train/val transforms and device-side normalisation.

``decode="tensor"`` (the default) maps a uint8 CHW RGB tensor to a uint8 crop,
*not* normalised: uint8 batches are four times smaller than float32 ones to move
from the workers to the GPU, where :func:`normalize_batch` converts them.
``decode="pil"`` is the classic ``torchvision.transforms`` pipeline on PIL images.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
from torchvision import transforms as tv1
from torchvision.transforms import v2

from ddpkit._docs import see
from ddpkit.data.gpu_decode import Encoded, centre_crop, crop_resize

__all__ = [
    "AUTO_AUGMENTS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "normalize_batch",
    "train_transform",
    "val_transform",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_Transform = Callable[[Any], torch.Tensor]
_ATTEMPTS = 10  # crop boxes RandomResizedCrop tries before its central fallback
AUTO_AUGMENTS = ("rand", "trivial", "augmix")
_MAGNITUDES = {"rand": (0, 30), "trivial": (0, 30), "augmix": (1, 10)}


def _auto_augment(name: str | None, magnitude: int, num_ops: int, pil: bool) -> Any:
    """The torchvision op of a preset (v2 for tensors, v1 for PIL images), or None."""
    ops: Any = tv1 if pil else v2
    if name == "rand":
        return ops.RandAugment(num_ops=num_ops, magnitude=magnitude)
    if name == "trivial":
        return ops.TrivialAugmentWide()
    if name == "augmix":
        return ops.AugMix(severity=magnitude)
    return None


def _check_presets(name: str | None, magnitude: int, num_ops: int, random_erase: float) -> None:
    where = see("augmentation-presets")
    if name is not None and name not in AUTO_AUGMENTS:
        raise ValueError(
            f"auto_augment must be None or one of {AUTO_AUGMENTS}, got {name!r}. {where}"
        )
    low, high = _MAGNITUDES.get(name or "rand", (0, 30))
    if (
        isinstance(magnitude, bool)
        or not isinstance(magnitude, int)
        or not low <= magnitude <= high
    ):
        raise ValueError(
            f"magnitude must be a whole number in {low}..{high} for auto_augment={name!r}, "
            f"got {magnitude!r} (rand: torchvision's m/30 of each op's strongest, timm's "
            f"rand-m9 is about 27 here; augmix: severity out of 10, default 3). {where}"
        )
    if isinstance(num_ops, bool) or not isinstance(num_ops, int) or num_ops < 1:
        raise ValueError(f"num_ops must be a whole number, 1 or more, got {num_ops!r}. {where}")
    if isinstance(random_erase, bool) or not 0.0 <= random_erase <= 1.0:
        raise ValueError(
            f"random_erase is a probability in 0..1, got {random_erase!r} (timm's reprob 0.25). "
            f"{where}"
        )


class _TensorTrainTransform:
    """RandomResizedCrop + RandomHorizontalFlip on a uint8 CHW tensor.

    Draws the crop box as ``v2.RandomResizedCrop`` does (same distribution and
    fallback) from one ``torch.rand`` call and calls ``interpolate`` directly:
    on one core, 15-45 % more photos per second than the v2 classes. Drawing
    the box with ``RandomResizedCrop.get_params`` instead (a few small tensors
    per try) costs about 6 % of the images per second of a decode + crop.
    """

    def __init__(
        self,
        size: int,
        scale: tuple[float, float],
        ratio: tuple[float, float],
        hflip: bool,
        presets: tuple[Any, Any] = (None, None),
    ) -> None:
        self.size, self.scale, self.ratio, self.hflip = size, scale, ratio, hflip
        self._log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        # After the crop (on the small image, as timm does): an auto-augment op and RandomErasing.
        self.augment, self.erase = presets

    def _box(self, height: int, width: int, u: list[float]) -> tuple[int, int, int, int]:
        area = height * width
        (s0, s1), (r0, r1) = self.scale, self._log_ratio
        for k in range(_ATTEMPTS):
            us, ur, ut, ul = u[4 * k : 4 * k + 4]
            target_area = area * (s0 + us * (s1 - s0))
            aspect = math.exp(r0 + ur * (r1 - r0))
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                return int(ut * (height - h + 1)), int(ul * (width - w + 1)), h, w
        # No draw fitted: a central crop as large as the ratio range allows.
        aspect = min(max(width / height, self.ratio[0]), self.ratio[1])
        w, h = min(width, round(height * aspect)), min(height, round(width / aspect))
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Any) -> Any:
        # The flip's draw is taken with hflip=False too: a seed gives the same box either way.
        if isinstance(img, Encoded):  # decode="cuda": the same draws, the crop on the GPU later
            u = torch.rand(4 * _ATTEMPTS + 1, dtype=torch.float64).tolist()
            box = self._box(img.height, img.width, u)
            return img.cropped(box, self.hflip and u[-1] < 0.5, self.size)
        _check_chw(img)
        u = torch.rand(4 * _ATTEMPTS + 1, dtype=torch.float64).tolist()
        box = self._box(img.shape[-2], img.shape[-1], u)
        out = crop_resize(img, box, self.hflip and u[-1] < 0.5, self.size)
        if self.augment is not None:
            out = self.augment(out).contiguous()
        if self.erase is not None:
            out = self.erase(out)
        return out

    def __repr__(self) -> str:
        presets = "".join(f", {p!r}" for p in (self.augment, self.erase) if p is not None)
        return (
            f"train_transform({self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"hflip={self.hflip}{presets})"
        )


class _TensorValTransform:
    """Resize the shorter side, then CenterCrop, on a uint8 CHW tensor."""

    def __init__(self, size: int, resize: int) -> None:
        self.size, self.resize = size, resize

    def __call__(self, img: Any) -> Any:
        if isinstance(img, Encoded):  # decode="cuda": resized and cropped on the GPU later
            return img.centred(self.resize, self.size)
        _check_chw(img)
        return centre_crop(img, self.resize, self.size)

    def __repr__(self) -> str:
        return f"val_transform({self.size}, {self.resize})"


def planned_on_gpu(transform: Any) -> bool:
    """Whether ``transform`` can plan its work for a batch decoded on the GPU (decode="cuda")."""
    if isinstance(transform, _TensorValTransform):
        return True
    return (
        isinstance(transform, _TensorTrainTransform)
        and transform.augment is None
        and transform.erase is None
    )


def _check_chw(img: Any) -> None:
    if not isinstance(img, torch.Tensor):
        raise TypeError(
            f"decode='tensor' transforms take a uint8 CHW tensor, got {type(img).__name__}; "
            "use decode='pil' for PIL images, or convert them with pil_to_tensor"
        )
    if img.dim() != 3:
        raise ValueError(
            f"expected one CHW image, got shape {tuple(img.shape)}; transform each image "
            "(in the dataset) before batching"
        )


def _check_args(decode: str, sizes: dict[str, int], pairs: dict[str, tuple[float, float]]) -> None:
    if decode not in ("tensor", "pil"):
        raise ValueError(f"decode must be 'tensor' or 'pil', got {decode!r}")
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be a positive number of pixels, got {value}")
    for name, (lo, hi) in pairs.items():
        if not 0 < lo <= hi:
            raise ValueError(f"{name} must be (low, high) with 0 < low <= high, got {(lo, hi)}")


def _pil_pipeline(
    steps: list[Any], mean: Sequence[float], std: Sequence[float], after: Sequence[Any] = ()
) -> _Transform:
    normalized = [*steps, tv1.ToTensor(), tv1.Normalize(mean, std), *after]
    return cast(_Transform, tv1.Compose(normalized))


def train_transform(
    size: int = 224,
    *,
    decode: Literal["tensor", "pil"] = "tensor",
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: bool = True,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    auto_augment: Literal["rand", "trivial", "augmix"] | None = None,
    magnitude: int = 9,
    num_ops: int = 2,
    random_erase: float = 0.0,
) -> Callable[[Any], torch.Tensor]:
    """Return the ImageNet training augmentation: RandomResizedCrop + RandomHorizontalFlip.

    Presets from ``torchvision.transforms.v2`` follow the crop, as in timm:
    ``auto_augment="rand"`` (RandAugment, ``num_ops`` ops of ``magnitude``
    0..30), ``"trivial"`` (TrivialAugmentWide), ``"augmix"`` (AugMix of
    severity ``magnitude`` 1..10), then Random Erasing with probability
    ``random_erase`` (zeros; after ``Normalize`` on the PIL path). On the
    tensor path they take and give uint8.

    ``magnitude`` is torchvision's scale, not timm's: RandAugment's 31 bins
    make magnitude ``m`` ``m / 30`` of each op's strongest (``Rotate``: ``m``
    degrees of 30), so the default 9 is 30 %. timm's ``rand-m9-n2`` is 9/10
    of its strongest (27 degrees), about ``magnitude=27, num_ops=2`` here
    (timm also applies each op with probability 0.5, and its ranges differ
    a little per op).

    The crop box follows ``torchvision.transforms.RandomResizedCrop``'s
    distribution on both paths. Random draws come from torch's global RNG, which
    :func:`build_loader` (``train=True``) seeds for each sample from ``(seed,
    epoch, index)``: a sample's crop and flip are the same whichever worker
    loads it.

    Args:
        size: side of the square output crop, in pixels.
        decode: ``"tensor"`` for uint8 CHW RGB tensor input and uint8
            ``(3, size, size)`` contiguous output, not normalised (call
            :func:`normalize_batch` on the device); ``"pil"`` for ``PIL.Image``
            RGB input and normalised float32 output.
        scale: range of the crop's area, as a fraction of the image's area.
        ratio: range of the crop's aspect ratio (width / height), drawn log-uniformly.
        hflip: mirror half of the crops left to right; False for images whose
            mirror image means something else (digits, text, some medical images).
        mean: per-channel mean for ``Normalize``; used with ``decode="pil"`` only.
        std: per-channel standard deviation; used with ``decode="pil"`` only.
        auto_augment: None, ``"rand"``, ``"trivial"`` or ``"augmix"``.
        magnitude: strength of ``"rand"``, 0..30 (``m / 30`` of each op's
            strongest; timm's ``m9`` is about 27), or severity of ``"augmix"`` (1..10).
        num_ops: ops RandAugment applies to each image.
        random_erase: probability of erasing a random rectangle (0: never).

    Returns:
        A picklable callable taking one image.

    Raises:
        ValueError: ``decode`` is not ``"tensor"`` or ``"pil"``, ``size`` is not
            positive, ``scale`` / ``ratio`` is not an increasing positive pair,
            an unknown ``auto_augment``, or a strength out of its range.

    Example:
        >>> dataset = LazyLMDBDataset("train.lmdb", transform=train_transform(224))
        >>> images = normalize_batch(images.cuda(non_blocking=True))
    """
    _check_args(decode, {"size": size}, {"scale": scale, "ratio": ratio})
    _check_presets(auto_augment, magnitude, num_ops, random_erase)
    pil = decode == "pil"
    augment = _auto_augment(auto_augment, magnitude, num_ops, pil)
    erase = (tv1 if pil else v2).RandomErasing(p=random_erase) if random_erase > 0 else None
    if not pil:
        box = ((scale[0], scale[1]), (ratio[0], ratio[1]))
        return _TensorTrainTransform(size, *box, hflip, (augment, erase))
    steps = [tv1.RandomResizedCrop(size, scale=scale, ratio=ratio)]
    if hflip:
        steps.append(tv1.RandomHorizontalFlip())
    if augment is not None:
        steps.append(augment)
    return _pil_pipeline(steps, mean, std, [erase] if erase is not None else [])


def val_transform(
    size: int = 224,
    resize: int | None = None,
    *,
    decode: Literal["tensor", "pil"] = "tensor",
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> Callable[[Any], torch.Tensor]:
    """Return the ImageNet evaluation transform: Resize(resize) + CenterCrop(size).

    Args:
        size: side of the square output crop, in pixels.
        resize: the shorter side is resized to this many pixels before cropping.
            Default: ``round(size * 256 / 224)``, ImageNet's 256 for 224 (the
            crop keeps the central 87.5 % of the shorter side at any size).
        decode: ``"tensor"`` (uint8 CHW in, uint8 out, not normalised) or ``"pil"``
            (``PIL.Image`` in, normalised float32 out); see :func:`train_transform`.
        mean: per-channel mean for ``Normalize``; used with ``decode="pil"`` only.
        std: per-channel standard deviation; used with ``decode="pil"`` only.

    Returns:
        A picklable, deterministic callable taking one image.

    Raises:
        ValueError: ``decode`` is invalid, or ``size`` or ``resize`` is not positive.

    Example:
        >>> val_set = LazyLMDBDataset("val.lmdb", transform=val_transform(224))  # resize 256
    """
    if resize is None:
        resize = round(size * 256 / 224)
    _check_args(decode, {"size": size, "resize": resize}, {})
    if decode == "tensor":
        return _TensorValTransform(size, resize)
    return _pil_pipeline([tv1.Resize(resize), tv1.CenterCrop(size)], mean, std)


_Stats = tuple[tuple[float, ...], tuple[float, ...], float]  # mean, std, pixel range


@functools.lru_cache(maxsize=64)
def _affine(stats: _Stats, dev: torch.device, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Cached so that a training step does not copy two tiny tensors to the
    # GPU (a synchronising host-to-device copy) on every call.
    mean, std, pixel = stats
    scale = torch.tensor([1.0 / (pixel * s) for s in std], dtype=torch.float64)
    shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)], dtype=torch.float64)
    return scale.view(-1, 1, 1).to(dev, dt), shift.view(-1, 1, 1).to(dev, dt)


def normalize_batch(
    x: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Convert a uint8 image batch to ``dtype`` and normalise it, on ``x``'s device.

    Computes ``(x / 255 - mean) / std`` per channel as ``x.to(dtype) * scale -
    shift`` in place on the converted copy. A floating-point ``x`` is taken to be
    in [0, 1] already: only ``(x - mean) / std``. ``x`` itself is not modified;
    its memory format (channels_last too) is kept. In bfloat16 errors reach ~1e-2.

    Args:
        x: uint8 (0..255) or floating (0..1) images, NCHW or CHW.
        mean: per-channel mean of the [0, 1] pixel values.
        std: per-channel standard deviation of the [0, 1] pixel values.
        dtype: the floating dtype of the result.

    Returns:
        A new tensor of ``dtype`` with ``x``'s shape, device and memory format.

    Raises:
        ValueError: ``x.shape[-3]`` (channels) differs from ``len(mean)`` or ``len(std)``.

    Example:
        >>> for images, targets in loader:
        ...     images = normalize_batch(images.to(device, non_blocking=True))
    """
    if x.dim() < 3 or not x.shape[-3] == len(mean) == len(std):
        raise ValueError(
            f"normalize_batch expects NCHW or CHW images with {len(mean)} channels (one per "
            f"mean value; {len(std)} std values), got shape {tuple(x.shape)}; pass mean and "
            "std with one value per channel, or move the channels to dimension -3"
        )
    pixel = 1.0 if x.is_floating_point() else 255.0
    scale, shift = _affine((tuple(mean), tuple(std), pixel), x.device, dtype)
    return x.to(dtype=dtype, copy=True).mul_(scale).sub_(shift)
