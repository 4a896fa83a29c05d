"""Decoding on the GPU: workers hand over encoded bytes and crop boxes, each batch decodes there.

With ``LazyLMDBDataset(decode="cuda")`` a DataLoader worker reads a JPEG's
bytes and its size from the header (no pixel decoded), and ddpkit's
``train_transform`` draws the crop box and the flip from the same random
numbers it draws for a decoded image: the same boxes from the same seed, so
a resume stays exact. The batch (:class:`EncodedBatch`) goes to the training
process, which decodes all its JPEGs in one call of TorchCodec's CUDA
decoder (nvJPEG), then crops, resizes and flips each image on the GPU.
What the GPU decoder cannot read (PNG, WebP, a JPEG it refuses) is decoded
on the CPU as before, by the worker or here, and counted
(:attr:`EncodedBatch.cpu_decoded`); its crop is taken on the GPU alike.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as nnf
from torch.utils.data import default_collate
from torchvision.transforms.v2 import functional as tvf

from ddpkit._docs import see
from ddpkit.data.images import Buffer, decode_tensor, jpeg_for_decoder

__all__ = ["Encoded", "EncodedBatch", "collate", "cpu_decoded", "encode", "require_cuda"]

Box = tuple[int, int, int, int]  # top, left, height, width

_count_lock = threading.Lock()
_CPU_DECODED = [0]  # images of encoded batches decoded on the CPU in this process, so far


def require_cuda() -> None:
    """Refuse ``decode="cuda"`` where there is no CUDA device or no CUDA JPEG decoder.

    Raises:
        ValueError: names what is missing and what to use instead.
    """
    if not torch.cuda.is_available():
        raise ValueError(
            "decode='cuda' (the example's --decode cuda) decodes each batch on the GPU with "
            "TorchCodec's CUDA JPEG decoder (nvJPEG): it needs a CUDA device, and "
            "torch.cuda.is_available() is False here. Use decode='tensor' (workers decode on "
            "the CPU). " + see("data-lmdb-databases-datasets-loaders")
        )
    try:
        from torchcodec.decoders import decode_jpeg  # noqa: F401
    except Exception as exc:
        raise ValueError(
            f"decode='cuda' needs TorchCodec's decode_jpeg (pip install torchcodec), which "
            f"does not load here: {type(exc).__name__}: {exc}"
        ) from None


class Encoded:
    """One image as a worker hands it over: its bytes (or, for a CPU decode, its pixels),
    its size, and what to make of it (a crop box, a flip and a side; or a resize and a
    centre crop)."""

    __slots__ = (
        "box",
        "data",
        "flip",
        "height",
        "max_pixels",
        "pixels",
        "resize",
        "size",
        "where",
        "width",
    )

    def __init__(
        self,
        data: torch.Tensor | None,
        pixels: torch.Tensor | None,
        height: int,
        width: int,
        *,
        where: str = "an image",
        max_pixels: int | None = None,
    ) -> None:
        self.data, self.pixels, self.height, self.width = data, pixels, height, width
        self.where, self.max_pixels = where, max_pixels  # for a message, and a CPU decode
        self.box: Box | None = None
        self.flip = False
        self.size: int | None = None
        self.resize: int | None = None

    def cropped(self, box: Box, flip: bool, size: int) -> Encoded:
        """Take crop ``box`` (top, left, height, width), resize it to ``size``, flip it if asked."""
        self.box, self.flip, self.size = box, flip, size
        return self

    def centred(self, resize: int, size: int) -> Encoded:
        """Resize the shorter side to ``resize``, then take the centre ``size`` x ``size``."""
        self.resize, self.size = resize, size
        return self

    def __reduce__(self) -> Any:  # slots: pickled through the constructor and the plan
        return _rebuilt, (
            self.data,
            self.pixels,
            self.height,
            self.width,
            self.box,
            self.flip,
            self.size,
            self.resize,
            self.where,
            self.max_pixels,
        )

    def __repr__(self) -> str:
        how = "bytes" if self.data is not None else "pixels"
        return f"Encoded({how}, {self.width}x{self.height}, box={self.box}, size={self.size})"


def _rebuilt(
    data: Any,
    pixels: Any,
    height: int,
    width: int,
    box: Any,
    flip: bool,
    size: Any,
    resize: Any,
    where: str,
    max_pixels: int | None,
) -> Encoded:
    item = Encoded(data, pixels, height, width, where=where, max_pixels=max_pixels)
    item.box, item.flip, item.size, item.resize = box, flip, size, resize
    return item


def encode(raw: Buffer, *, max_pixels: int | None = None, where: str = "an image") -> Encoded:
    """What a worker hands over for the image ``raw``: a JPEG's bytes, else its pixels.

    A JPEG keeps its bytes, its APP1 segments hidden so that no decoder applies
    an EXIF orientation (as :func:`~ddpkit.data.images.decode_tensor`), its size
    read from the header and checked against ``max_pixels``. Any other format,
    or a JPEG header out of the ordinary, is decoded here on the CPU, counted.
    ``where`` names the image in the message of a JPEG that later does not
    decode (``"sample 7 (record 7 of train.lmdb)"``).

    Raises:
        ImageTooLargeError: the header claims more pixels than the limit.
    """
    jpeg = jpeg_for_decoder(raw, max_pixels=max_pixels)
    if jpeg is not None:
        data, width, height = jpeg
        array = torch.frombuffer(data, dtype=torch.uint8)
        return Encoded(array, None, height, width, where=where, max_pixels=max_pixels)
    pixels = decode_tensor(raw, max_pixels=max_pixels)
    return Encoded(None, pixels, int(pixels.shape[-2]), int(pixels.shape[-1]), where=where)


class EncodedBatch:
    """A batch of :class:`Encoded` images; :meth:`decode` makes it a uint8 batch on a device.

    Attributes:
        items: the images, in the batch's order.
        cpu_decoded: how many of them were decoded on the CPU (by a worker, or
            by :meth:`decode` when the GPU decoder refused one); known after
            :meth:`decode`.
    """

    def __init__(self, items: Sequence[Encoded]) -> None:
        self.items = list(items)
        self.cpu_decoded = self._by_workers = sum(1 for item in self.items if item.data is None)
        self._counted = False  # the process's count holds this batch

    def __len__(self) -> int:
        return len(self.items)

    @property
    def shape(self) -> tuple[int, ...]:
        """``(N, 3, size, size)``: the shape :meth:`decode` returns."""
        side = self.items[0].size if self.items else 0
        return (len(self.items), 3, side or 0, side or 0)

    def pin_memory(self, device: Any = None) -> EncodedBatch:
        """The DataLoader's pin-memory thread: the CPU-decoded pixels in page-locked memory."""
        for item in self.items:
            if item.pixels is not None:
                item.pixels = item.pixels.pin_memory()
        return self

    def to(self, device: Any, non_blocking: bool = False) -> torch.Tensor:
        """:meth:`decode` on ``device`` (what ``batch.to(device)`` means for a tensor)."""
        return self.decode(torch.device(device))

    def decode(self, device: torch.device) -> torch.Tensor:
        """Every image decoded on ``device``, cropped, resized and flipped there: uint8 NCHW.

        The JPEGs decode in one call (nvJPEG on a GPU); one the decoder refuses,
        or decodes to another size than its header's, is decoded on the CPU
        instead (:func:`~ddpkit.data.images.decode_tensor`: it names what is
        wrong with a damaged one) and counted in :attr:`cpu_decoded`.
        """
        images = self._decoded(device)
        out = [_planned(image, item) for image, item in zip(images, self.items, strict=True)]
        with _count_lock:  # once per batch, however often it is decoded
            _CPU_DECODED[0] += 0 if self._counted else self.cpu_decoded
            self._counted = True
        return torch.stack(out) if out else torch.empty(self.shape, dtype=torch.uint8)

    def _decoded(self, device: torch.device) -> list[torch.Tensor]:
        images: list[torch.Tensor | None] = [
            None if item.pixels is None else item.pixels.to(device, non_blocking=True)
            for item in self.items
        ]
        jpegs = [i for i, item in enumerate(self.items) if item.data is not None]
        self.cpu_decoded = self._by_workers  # this decode's count, not added to an earlier one
        if jpegs:
            decoded = _decode_jpegs([self.items[i] for i in jpegs], device)
            for i, image in zip(jpegs, decoded, strict=True):
                item = self.items[i]
                if image is None or tuple(image.shape[-2:]) != (item.height, item.width):
                    image = _on_the_cpu(item).to(device)
                    self.cpu_decoded += 1
                images[i] = image
        return [image for image in images if image is not None]


def _on_the_cpu(item: Encoded) -> torch.Tensor:
    """A JPEG the GPU decoder refused, decoded on the CPU; a damaged one named.

    Raises:
        ValueError: the image does not decode; names it and ``ddpkit lmdb verify``.
    """
    assert item.data is not None
    try:
        return decode_tensor(item.data.numpy().tobytes(), max_pixels=item.max_pixels)
    except Exception as exc:
        raise ValueError(
            f"{item.where} does not decode as an image: {type(exc).__name__}: {exc}. "
            "`ddpkit lmdb verify` lists every bad record. "
            + see("data-lmdb-databases-datasets-loaders")
        ) from exc


def _decode_jpegs(items: list[Encoded], device: torch.device) -> list[torch.Tensor | None]:
    """The JPEGs decoded on ``device``: the whole batch in one call, else one at a time."""
    from torchcodec.decoders import decode_jpeg

    sources = [item.data for item in items if item.data is not None]
    try:
        decoded = decode_jpeg(sources, mode="RGB", device=device)
        assert isinstance(decoded, list)
        return list(decoded)
    except RuntimeError:  # one image the decoder refuses: the others one by one
        out: list[torch.Tensor | None] = []
        for source in sources:
            try:
                image = decode_jpeg(source, mode="RGB", device=device)
                out.append(image if isinstance(image, torch.Tensor) else None)
            except RuntimeError:
                out.append(None)
        return out


def _planned(image: torch.Tensor, item: Encoded) -> torch.Tensor:
    """``image`` (uint8 CHW on its device) as ``item``'s plan says: crop, resize, flip."""
    size = item.size
    if size is None:
        return image
    if item.resize is not None:
        return centre_crop(image, item.resize, size)
    assert item.box is not None
    return crop_resize(image, item.box, item.flip, size)


def crop_resize(image: torch.Tensor, box: Box, flip: bool, size: int) -> torch.Tensor:
    """Crop ``box`` out of uint8 CHW ``image``, resize it to ``size`` square, flip if asked.

    The one crop of ``train_transform``: in a worker on a decoded image, and on
    the GPU for a batch decoded there.
    """
    top, left, h, w = box
    crop = image[:, top : top + h, left : left + w]
    if image.device.type == "cpu":
        # interpolate has a native uint8 kernel on the CPU; elsewhere let torchvision
        # pick a dtype the device supports.
        out = nnf.interpolate(crop[None], (size, size), mode="bilinear", antialias=True)[0]
    else:
        out = tvf.resize(crop, [size, size], antialias=True)
    # contiguous() before flip: a channels-last input gives a channels-last resize,
    # and flip of a contiguous tensor is contiguous (one copy, not two).
    out = out.contiguous()
    return out.flip(-1) if flip else out


def centre_crop(image: torch.Tensor, resize: int, size: int) -> torch.Tensor:
    """Resize the shorter side of uint8 CHW ``image`` to ``resize``, take the centre ``size``."""
    out: torch.Tensor = tvf.center_crop(tvf.resize(image, [resize]), [size, size])
    return out.contiguous()


def collate(batch: list[Any]) -> Any:
    """DataLoader's default collation, but a batch of ``(Encoded, target)`` samples
    becomes ``(EncodedBatch, targets)``: its images decode in the training process."""
    if batch and isinstance(batch[0], tuple | list) and isinstance(batch[0][0], Encoded):
        targets = default_collate([sample[1] for sample in batch])
        items = [sample[0] for sample in batch]
        _one_buffer(items)
        return EncodedBatch(items), targets
    return default_collate(batch)


def _one_buffer(items: list[Encoded]) -> None:
    """Every JPEG's bytes as a view of one buffer: the batch crosses to the training
    process in one shared-memory segment, not one (and a file descriptor) per image."""
    parts = [item.data for item in items if item.data is not None]
    if len(parts) < 2:
        return
    buffer, offset = torch.cat(parts), 0
    for item in items:
        if item.data is not None:
            length = item.data.numel()
            item.data, offset = buffer[offset : offset + length], offset + length


def cpu_decoded() -> int:
    """Images of encoded batches this process decoded on the CPU so far (:class:`EncodedBatch`)."""
    with _count_lock:
        return _CPU_DECODED[0]
