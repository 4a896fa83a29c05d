"""The one image decoder and checker, shared by the builder, ``verify`` and the dataset.

``LazyLMDBDataset`` decodes with :func:`decode_tensor` (or :func:`decode_pil`),
``build_lmdb(check="decode")`` and ``ddpkit lmdb verify`` check with
:func:`check_image`, which runs that same decoder: "verify says ok" means
"training can read it".
"""

from __future__ import annotations

import io
from typing import Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

try:  # torchvision's codecs are announced to move to TorchCodec; Pillow still decodes.
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_image as _tv_decode
except ImportError:  # pragma: no cover - only without torchvision.io's image codecs
    _tv_decode = None

__all__ = ["Check", "check_image", "decode_pil", "decode_tensor", "prepare_image"]

Check = Literal["none", "header", "decode"]
Buffer = bytes | bytearray


def decode_tensor(raw: Buffer) -> torch.Tensor:
    """Decode encoded image bytes to a uint8 ``3 x H x W`` RGB tensor.

    torchvision's decoder (JPEG, PNG, WebP, GIF; grayscale, CMYK and alpha
    converted to RGB, 16-bit PNG scaled to 8 bits, an animation's first
    frame), and Pillow for the formats torchvision does not decode (BMP, TIFF ...).

    Raises:
        Exception: whatever the decoders raise for bytes that are not an image
            they can read (``RuntimeError``, ``OSError``, ``UnidentifiedImageError`` ...).
    """
    if _tv_decode is None:
        return _pillow_tensor(raw)
    data = raw if isinstance(raw, bytearray) else bytearray(raw)  # frombuffer needs writable
    try:
        image: torch.Tensor = _tv_decode(
            torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB
        )
    except RuntimeError:
        return _pillow_tensor(raw)  # formats torchvision does not decode: BMP, TIFF ...
    if image.ndim == 4:  # an animated image: its first frame
        image = image[0]
    if image.dtype != torch.uint8:  # 16-bit PNG
        image = (image.to(torch.float32) / 257.0).round().to(torch.uint8)
    return image


def decode_pil(raw: Buffer) -> Image.Image:
    """Decode encoded image bytes to an RGB ``PIL.Image`` (alpha dropped, as ImageFolder does)."""
    image = Image.open(io.BytesIO(raw))
    # As torchvision's ImageFolder loader does: alpha is dropped, not composited,
    # so decode="pil" and decode="tensor" see the same pixels.
    return image if image.mode == "RGB" else image.convert("RGB")


def check_image(data: Buffer | None, level: Check) -> str | None:
    """Why ``data`` is not a usable image at ``level``, or None when it is.

    Args:
        data: the encoded bytes (None: a record that is missing).
        level: ``"none"`` (non-empty), ``"header"`` (Pillow identifies the
            format and size) or ``"decode"`` (:func:`decode_tensor` succeeds:
            exactly what the dataset does).
    """
    if data is None:
        return "no record under its key: the database is damaged"
    if not data:
        return "empty (0 bytes)"
    try:
        if level == "decode":
            decode_tensor(data)
        elif level == "header":
            with Image.open(io.BytesIO(data)):  # reads the header only
                pass
    except UnidentifiedImageError:
        return "not an image format PIL can identify"
    # Whatever a damaged file makes a decoder raise (RuntimeError, OSError,
    # SyntaxError, DecompressionBombError ...) is a fact about that image.
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def prepare_image(
    data: Buffer | None, check: Check, max_side: int | None, quality: int
) -> tuple[bytes | None, str]:
    """What the builder stores for one image: ``(bytes, "")`` or ``(None, why not)``.

    The bytes are ``data`` as read, or a smaller RGB JPEG at ``quality`` when
    the longer side exceeds ``max_side``. Runs in worker threads: decoding,
    resizing and encoding release the GIL.
    """
    problem = check_image(data, check)
    if problem is not None:
        return None, problem
    assert data is not None
    if max_side is None:
        return bytes(data), ""
    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            if max(image.size) <= max_side:
                return bytes(data), ""
            return _shrink(image, max_side, quality), ""
    except UnidentifiedImageError:
        return None, "not an image format PIL can identify"
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _shrink(image: Image.Image, max_side: int, quality: int) -> bytes:
    if image.mode not in ("RGB", "L"):
        image = image.convert("RGB")  # palette, alpha, CMYK ...: resample in RGB
    # thumbnail() keeps the aspect, lets a JPEG decode at a reduced scale first, then Lanczos.
    image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    image.convert("RGB").save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _pillow_tensor(raw: Buffer) -> torch.Tensor:
    array = np.array(decode_pil(raw))
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
