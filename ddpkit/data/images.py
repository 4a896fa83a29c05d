"""The one image decoder and checker, shared by the builder, ``verify`` and the dataset.

``LazyLMDBDataset`` decodes with :func:`decode_tensor` (or :func:`decode_pil`),
``build_lmdb(check="decode")`` and ``ddpkit lmdb verify`` check with
:func:`check_image`, which runs that same decoder: "verify says ok" means
"training can read it". No input kills the process: formats whose fast
decoder can crash on damaged data are checked or decoded another way.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

try:  # torchvision's codecs are announced to move to TorchCodec; Pillow still decodes.
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_image as _tv_decode
except ImportError:  # pragma: no cover - only without torchvision.io's image codecs
    _tv_decode = None

__all__ = ["Check", "check_image", "check_png", "decode_pil", "decode_tensor", "prepare_image"]

Check = Literal["none", "header", "decode"]
Buffer = bytes | bytearray


def decode_tensor(raw: Buffer) -> torch.Tensor:
    """Decode encoded image bytes to a uint8 ``3 x H x W`` RGB tensor.

    JPEG, WebP and GIF go through torchvision's decoders (grayscale, CMYK and
    alpha converted to RGB, an animation's first frame); PNG and the formats
    torchvision does not read (BMP, TIFF ...) through Pillow. PNG is first
    checked whole (:func:`check_png`): torchvision's PNG decoder kills the
    process on damaged data, and Pillow silently pads a short one.

    Raises:
        Exception: whatever the decoders raise for bytes that are not an image
            they can read (``ValueError``, ``RuntimeError``, ``OSError``,
            ``UnidentifiedImageError`` ...); never a crash.
    """
    if _tv_decode is None or _kind(raw) not in ("jpeg", "webp", "gif"):
        return _pillow_tensor(raw)  # PNG (checked there), BMP, TIFF ...
    data = raw if isinstance(raw, bytearray) else bytearray(raw)  # frombuffer needs writable
    try:
        image: torch.Tensor = _tv_decode(
            torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB
        )
    except RuntimeError:
        return _pillow_tensor(raw)  # Pillow says what is wrong, or reads what torchvision cannot
    if image.ndim == 4:  # an animated image: its first frame
        image = image[0]
    return image


def decode_pil(raw: Buffer) -> Image.Image:
    """Decode encoded image bytes to an RGB ``PIL.Image`` (alpha dropped, as ImageFolder does).

    A PNG is checked whole first (:func:`check_png`), as for :func:`decode_tensor`.
    """
    if _kind(raw) == "png":
        check_png(raw)
    return _rgb(Image.open(io.BytesIO(raw)))


def _rgb(image: Image.Image) -> Image.Image:
    """An 8-bit RGB copy of ``image``: 16-bit gray scaled (not clipped), alpha dropped."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        gray = np.asarray(image, dtype=np.float64) / 257.0
        image = Image.fromarray(np.rint(gray).clip(0, 255).astype(np.uint8))
    # As torchvision's ImageFolder loader does: alpha is dropped, not composited,
    # so decode="pil" and decode="tensor" see the same pixels.
    return image if image.mode == "RGB" else image.convert("RGB")


def check_png(raw: Buffer) -> None:
    """Check a PNG's chunks (lengths, CRCs) and that its image data fill the declared size.

    Raises:
        ValueError: the file is cut short, a chunk is damaged, or the image
            data hold fewer rows than the header declares.
    """
    pos, header, need, got = 8, None, 0, 0
    inflate = zlib.decompressobj()
    while True:
        if pos + 12 > len(raw):
            raise ValueError(f"PNG cut short at byte {len(raw)}: the file is truncated")
        length, kind = struct.unpack_from(">I4s", raw, pos)
        end = pos + 12 + length
        if end > len(raw):
            raise ValueError(f"PNG chunk {kind!r} runs past the end of the file: truncated")
        body = bytes(raw[pos + 8 : end - 4])
        if zlib.crc32(kind + body) != struct.unpack_from(">I", raw, end - 4)[0]:
            raise ValueError(f"PNG chunk {kind!r} fails its checksum: the file is damaged")
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body[:13])
            need = _png_data_size(*header)
        elif kind == b"IDAT" and header is not None:
            got += _inflated_size(inflate, body, need - got + 1)
        elif kind == b"IEND":
            break
        pos = end
    if header is None:
        raise ValueError("PNG without an IHDR header chunk: the file is damaged")
    if got < need:
        raise ValueError(
            f"PNG image data hold {got} of the {need} bytes its {header[0]}x{header[1]} "
            "header declares: the file is truncated or damaged"
        )


def _png_data_size(
    width: int, height: int, depth: int, color: int, _c: int, _f: int, interlace: int
) -> int:
    """How many bytes of filtered rows a PNG's header promises (Adam7 passes when interlaced)."""
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(color)
    if channels is None or width == 0 or height == 0:
        raise ValueError(f"PNG header is invalid (colour type {color}, {width}x{height})")
    bits = channels * depth
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        w, h = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if w > 0 and h > 0:
            total += h * (1 + -(-(w * bits) // 8))
    return total


_ADAM7 = (
    (0, 0, 8, 8),
    (4, 0, 8, 8),
    (0, 4, 4, 8),
    (2, 0, 4, 4),
    (0, 2, 2, 4),
    (1, 0, 2, 2),
    (0, 1, 1, 2),
)


def _inflated_size(inflate: Any, data: bytes, limit: int) -> int:
    """Inflate ``data`` and count the output (at most ``limit`` bytes), keeping none of it."""
    got = 0
    while data and got < limit:
        try:
            out = inflate.decompress(data, min(limit - got, 1 << 20))
        except zlib.error as exc:
            raise ValueError(f"PNG image data are not valid zlib data ({exc})") from exc
        got += len(out)
        data = inflate.unconsumed_tail
        if not out:
            break
    return got


def _kind(raw: Buffer) -> str:
    head = bytes(raw[:12])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    return "other"


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
        if _kind(data) == "png":  # shrinking decodes it: Pillow would pad a short one silently
            check_png(data)
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
        image = _rgb(image)  # palette, alpha, CMYK, 16-bit ...: as the dataset sees it
    # thumbnail() keeps the aspect; a JPEG decodes at a reduced scale first, then Lanczos.
    image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    image.convert("RGB").save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _pillow_tensor(raw: Buffer) -> torch.Tensor:
    array = np.array(decode_pil(raw))
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
