"""The one image decoder and checker, shared by the builder, ``verify`` and the dataset.

``LazyLMDBDataset`` decodes with :func:`decode_tensor` (or :func:`decode_pil`),
``build_lmdb(check="decode")`` and ``ddpkit lmdb verify`` check with
:func:`check_image`, which runs that same decoder: "verify says ok" means
"training can read it". No input kills the process: formats whose fast
decoder can crash on damaged data are checked or decoded another way.

Every path reads the image's size from its header first and refuses one of
more pixels than :func:`pixel_limit` allows (:class:`ImageTooLargeError`):
a 700-byte file whose header claims 65000 x 65000 would otherwise decode to
13 GB. The limit is Pillow's by default; ``max_pixels=`` of the dataset, the
builder and ``verify`` (``--max-pixels``) sets another.
"""

from __future__ import annotations

import functools
import io
import numbers
import struct
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ddpkit._docs import see
from ddpkit.data.image_checks import check_png, check_tiff_strips, restart_intervals

__all__ = [
    "Check",
    "ImageTooLargeError",
    "check_image",
    "check_jpeg_data",
    "check_png",
    "decode_pil",
    "decode_tensor",
    "image_size",
    "pixel_limit",
    "prepare_image",
    "tensor_decoders",
]

Check = Literal["none", "header", "decode"]
Buffer = bytes | bytearray


class ImageTooLargeError(ValueError):
    """An image's header claims more pixels than the limit; refused before any decoding."""


def pixel_limit(max_pixels: int | None = None) -> int | None:
    """The most pixels an image may have: ``max_pixels``, else Pillow's limit (None: none).

    Pillow's limit is the one at which ``PIL.Image.open`` refuses a file,
    ``2 * PIL.Image.MAX_IMAGE_PIXELS`` (178,956,970 pixels unless changed;
    ``MAX_IMAGE_PIXELS = None`` turns it off), read at each call.

    Raises:
        TypeError, ValueError: ``max_pixels`` is not a whole number of at least 1.
    """
    if max_pixels is None:
        pillow = Image.MAX_IMAGE_PIXELS
        return None if pillow is None else 2 * int(pillow)
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, numbers.Integral):
        raise TypeError(f"max_pixels must be a whole number of pixels, got {max_pixels!r}")
    if max_pixels < 1:
        raise ValueError(f"max_pixels must be at least 1, got {max_pixels}")
    return int(max_pixels)


def image_size(raw: Buffer) -> tuple[int, int]:
    """``(width, height)`` from the image's header, without decoding its pixels.

    Raises:
        UnidentifiedImageError: not a format Pillow identifies.
        Exception: what Pillow raises for a damaged header.
    """
    with _open(raw) as image:
        return image.size


def _check_size(raw: Buffer, max_pixels: int | None, image: Image.Image | None = None) -> None:
    """Raise :class:`ImageTooLargeError` if the header claims more pixels than the limit."""
    limit = pixel_limit(max_pixels)
    if limit is None:
        return
    width, height = image.size if image is not None else image_size(raw)
    if width * height > limit:
        raise ImageTooLargeError(
            f"its header says {width}x{height} = {width * height:,} pixels, over the limit "
            f"of {limit:,} (a damaged header or a decompression bomb: decoding it would take "
            f"{width * height * 3 / 2**30:.1f} GiB). If the image is real, raise the limit: "
            "max_pixels= of the dataset, build_lmdb and verify (--max-pixels). "
            + see("data-lmdb-databases-datasets-loaders")
        )


def _open(raw: Buffer) -> Image.Image:
    """``PIL.Image.open`` of ``raw`` (the header only) without Pillow's own pixel check.

    The caller applies :func:`pixel_limit`, which may be set above Pillow's.
    Raises what ``Image.open`` raises for bytes it cannot identify.
    """
    Image.init()
    fp = io.BytesIO(raw)
    prefix = bytes(raw[:16])
    for name in Image.ID:
        factory, accept = Image.OPEN[name]
        result = accept(prefix) if accept is not None else True
        if not result or isinstance(result, str):
            continue
        fp.seek(0)
        try:
            return factory(fp, "")
        except (SyntaxError, IndexError, TypeError, struct.error):
            continue  # as Image.open does: try the next format
        except Image.DecompressionBombError as exc:  # a GIF frame larger than its screen
            raise ImageTooLargeError(
                f"{exc} If the image is real, raise the limit: max_pixels= (--max-pixels). "
                + see("data-lmdb-databases-datasets-loaders")
            ) from exc
    raise UnidentifiedImageError("cannot identify image file")


Decoder = Callable[[torch.Tensor], torch.Tensor]


def _load_decoders(library: str) -> dict[str, Decoder] | None:
    """The JPEG and WebP decoders of ``library`` (``"torchcodec"`` or ``"torchvision"``),
    each taking the encoded bytes as a uint8 tensor and giving ``3 x H x W`` RGB (or
    ``N x 3 x H x W`` for an animated WebP); None where ``library`` cannot decode here."""
    if library == "torchcodec":
        # TorchCodec's image decoders (0.16+) are built against torch 2.11+; with an older
        # torch its native library does not load (or worse), so it is not even imported.
        if torch.torch_version.TorchVersion(torch.__version__) < "2.11":
            return None
        try:
            from torchcodec.decoders import decode_jpeg, decode_webp
        except Exception:  # not installed, or its native library does not load with this torch
            return None

        def jpeg(data: torch.Tensor) -> torch.Tensor:
            image = decode_jpeg(data, mode="RGB")
            assert isinstance(image, torch.Tensor)  # one source in, one image out
            return image

        return {"jpeg": jpeg, "webp": functools.partial(decode_webp, mode="RGB")}
    try:
        from torchvision.io import ImageReadMode, decode_image
    except ImportError:  # a torchvision without its image codecs
        return None
    rgb = functools.partial(decode_image, mode=ImageReadMode.RGB)
    return {"jpeg": rgb, "webp": rgb}


@functools.cache
def tensor_decoders() -> tuple[str, dict[str, Decoder]]:
    """The library :func:`decode_tensor` decodes JPEG and WebP with, and its decoders.

    TorchCodec where it is installed and loads with this torch, else
    torchvision.io (whose image codecs torchvision 0.29 deprecated in favour of
    TorchCodec), else ``("pillow", {})``: Pillow decodes everything. Decided
    once per process; the builder, ``verify`` and the dataset all ask here.
    """
    for library in ("torchcodec", "torchvision"):
        decoders = _load_decoders(library)
        if decoders is not None:
            return library, decoders
    return "pillow", {}


# EXIF orientation -> the flips that undo it (then a transpose for 5-8). TorchCodec
# applies the orientation, which neither decode_pil nor torchvision's decoder did:
# undone, every path sees the stored pixels, as ImageFolder's loader does.
_FLIP_X, _FLIP_Y, _FLIP_XY = (-1,), (-2,), (-2, -1)
_UNDO_ORIENTATION = {
    2: _FLIP_X,
    3: _FLIP_XY,
    4: _FLIP_Y,
    5: (),
    6: _FLIP_X,
    7: _FLIP_XY,
    8: _FLIP_Y,
}


def _orientation(header: Image.Image) -> int:
    """The EXIF orientation tag (1: as stored); from the EXIF block only, as TorchCodec
    reads it (Pillow's ``getexif`` would also take one from XMP)."""
    block = header.info.get("exif")
    if not block:
        return 1
    exif = Image.Exif()
    try:
        exif.load(block)
    except Exception:  # a damaged EXIF block: the decoder's own check decides below
        return 1
    value = exif.get(0x0112, 1)
    return value if isinstance(value, int) else 1


def decode_tensor(raw: Buffer, *, max_pixels: int | None = None) -> torch.Tensor:
    """Decode encoded image bytes to a uint8 ``3 x H x W`` RGB tensor.

    JPEG and WebP go through TorchCodec's decoders (torchvision's where
    TorchCodec cannot load: :func:`tensor_decoders`), grayscale, CMYK and
    alpha converted to RGB, EXIF orientation not applied; PNG, GIF and
    animated WebP (their first frame: the fast decoders would make every
    frame) and the formats those do not read (BMP, TIFF ...) through Pillow.
    PNG is first checked whole (:func:`check_png`): torchvision's PNG decoder
    kills the process on damaged data, and Pillow silently pads a short one.

    Args:
        raw: the encoded bytes.
        max_pixels: the most pixels an image may have (:func:`pixel_limit`;
            default: Pillow's limit), checked from the header before decoding.

    Raises:
        ImageTooLargeError: the header claims more pixels than the limit.
        Exception: whatever the decoders raise for bytes that are not an image
            they can read (``ValueError``, ``RuntimeError``, ``OSError``,
            ``UnidentifiedImageError`` ...); never a crash.
    """
    kind = _kind(raw)
    decode = tensor_decoders()[1].get(kind)
    if decode is None or (kind == "webp" and _animated_webp(raw)):
        return _pillow_tensor(raw, max_pixels)  # PNG (checked there), GIF, BMP, TIFF ...
    with _open(raw) as header:  # reads the header only
        _check_size(raw, max_pixels, header)
        size, orientation = header.size, _orientation(header)
    data = raw if isinstance(raw, bytearray) else bytearray(raw)  # frombuffer needs writable
    try:
        image = decode(torch.frombuffer(data, dtype=torch.uint8))
    except RuntimeError:
        # Pillow says what is wrong, or reads what the fast decoder cannot
        return _pillow_tensor(raw, max_pixels)
    if image.ndim == 4:  # an animated image: its first frame
        image = image[0]
    if orientation in _UNDO_ORIENTATION and tensor_decoders()[0] == "torchcodec":
        flips = _UNDO_ORIENTATION[orientation]
        image = image.flip(flips) if flips else image
        image = (image.transpose(-1, -2) if orientation >= 5 else image).contiguous()
    if image.shape[1:] != (size[1], size[0]):  # a decoder read another orientation
        return _pillow_tensor(raw, max_pixels)
    if kind == "jpeg" and _uniform_corner(image[:, -4:, -4:].reshape(3, -1)):
        check_jpeg_data(raw)
    return image


def _animated_webp(raw: Buffer) -> bool:
    """Whether an extended (VP8X) WebP sets its animation flag."""
    return bytes(raw[12:16]) == b"VP8X" and len(raw) > 20 and bool(raw[20] & 0x02)


def decode_pil(raw: Buffer, *, max_pixels: int | None = None) -> Image.Image:
    """Decode encoded image bytes to an RGB ``PIL.Image`` (alpha dropped, as ImageFolder does).

    The size is checked against ``max_pixels`` from the header first, and a
    PNG is checked whole (:func:`check_png`), as for :func:`decode_tensor`.

    Raises:
        ImageTooLargeError: the header claims more pixels than the limit.
    """
    image = _open(raw)
    _check_size(raw, max_pixels, image)
    kind = _kind(raw)
    if kind == "png":
        check_png(raw)
    elif kind == "other" and image.format == "TIFF":
        check_tiff_strips(image)
    try:  # here, not lazily in a transform later: a short file is an error of decoding
        image.load()
    except Image.DecompressionBombError as exc:  # Pillow's own check inside its TIFF reader
        raise ImageTooLargeError(
            f"{exc} Pillow's readers of TIFF and GIF apply its own limit too: raise "
            "PIL.Image.MAX_IMAGE_PIXELS as well as max_pixels. "
            + see("data-lmdb-databases-datasets-loaders")
        ) from exc
    rgb = _rgb(image)
    if kind == "jpeg":
        corner = np.asarray(rgb.crop((rgb.width - 4, rgb.height - 4, rgb.width, rgb.height)))
        if _uniform_corner(torch.from_numpy(corner.reshape(-1, 3).T.copy())):
            check_jpeg_data(raw)
    return rgb


# Where a JPEG's compressed data end before its last row, libjpeg warns ("premature
# end of data segment"), which neither torchvision nor Pillow report, and gives every
# missing block the same flat value: a uniform bottom-right corner. Only then is the
# data checked (a second decode), so a whole image costs nothing more.
_FILLER_PROBE = bytes((k * 37 + 11) % 255 for k in range(2048))  # no 0xFF: not a marker


def _uniform_corner(corner: torch.Tensor) -> bool:
    """Whether the ``channels x pixels`` corner of a decoded image is one flat colour."""
    return bool((corner == corner[:, :1]).all())


def check_jpeg_data(raw: Buffer) -> None:
    """Check that a JPEG's compressed data fill the size its header declares.

    libjpeg fills the blocks past the end of short data with a flat colour and
    says so only on stderr. Decoded again with bytes the decoder would skip
    after complete data inserted before the end marker, a short image changes
    where its data ran out; a whole one does not.

    Raises:
        ValueError: the data end before the image does (a truncated file, or a
            header raised to more rows or columns than the data hold).
    """
    data = bytes(raw)
    end = data.rfind(b"\xff\xd9")
    end = len(data) if end < 0 else end
    probed = data[:end] + _FILLER_PROBE + b"\xff\xd9"
    short = not np.array_equal(_pillow_pixels(data), _pillow_pixels(probed))
    # With restart markers the decoder stops at the end marker it finds in place of the
    # next restart marker, probe or not: count the intervals instead.
    if not short and (intervals := restart_intervals(data)) is not None:
        held, needed = intervals
        short = held < needed
    if not short:
        return
    width, height = image_size(raw)
    raise ValueError(
        f"JPEG data end before the image does: its header says {width}x{height}, but the "
        "compressed data fill only part of it (the decoder would pad the rest with a flat "
        "colour); the file is truncated or its header damaged. "
        + see("data-lmdb-databases-datasets-loaders")
    )


def _pillow_pixels(data: bytes) -> np.ndarray:
    with _open(data) as image:
        return np.asarray(image)


def _rgb(image: Image.Image) -> Image.Image:
    """An 8-bit RGB copy of ``image``: 16-bit gray scaled (not clipped), alpha dropped."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        gray = np.asarray(image, dtype=np.float64) / 257.0
        image = Image.fromarray(np.rint(gray).clip(0, 255).astype(np.uint8))
    # As torchvision's ImageFolder loader does: alpha is dropped, not composited,
    # so decode="pil" and decode="tensor" see the same pixels.
    return image if image.mode == "RGB" else image.convert("RGB")


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


def check_image(data: Buffer | None, level: Check, *, max_pixels: int | None = None) -> str | None:
    """Why ``data`` is not a usable image at ``level``, or None when it is.

    Args:
        data: the encoded bytes (None: a record that is missing).
        level: ``"none"`` (non-empty), ``"header"`` (Pillow identifies the
            format and size, within ``max_pixels``) or ``"decode"``
            (:func:`decode_tensor` succeeds: exactly what the dataset does).
        max_pixels: the most pixels an image may have (:func:`pixel_limit`).
    """
    if data is None:
        return "no record under its key: the database is damaged"
    if not data:
        return "empty (0 bytes)"
    try:
        if level == "decode":
            decode_tensor(data, max_pixels=max_pixels)
        elif level == "header":
            with _open(data) as image:  # reads the header only
                _check_size(data, max_pixels, image)
    except UnidentifiedImageError:
        return "not an image format PIL can identify"
    # Whatever a damaged file makes a decoder raise (RuntimeError, OSError,
    # SyntaxError, DecompressionBombError ...) is a fact about that image.
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def prepare_image(
    data: Buffer | None,
    check: Check,
    max_side: int | None,
    quality: int,
    *,
    max_pixels: int | None = None,
) -> tuple[bytes | None, str]:
    """What the builder stores for one image: ``(bytes, "")`` or ``(None, why not)``.

    The bytes are ``data`` as read, or a smaller RGB JPEG at ``quality`` when
    the longer side exceeds ``max_side``. An image of more pixels than
    ``max_pixels`` allows is refused at every ``check`` but ``"none"``, and
    before shrinking. Runs in worker threads: decoding, resizing and encoding
    release the GIL.
    """
    problem = check_image(data, check, max_pixels=max_pixels)
    if problem is not None:
        return None, problem
    assert data is not None
    if max_side is None:
        return bytes(data), ""
    try:
        with _open(data) as image:  # reads the header only
            _check_size(data, max_pixels, image)  # shrinking decodes it whole
            if _kind(data) == "png":  # Pillow would pad a short one silently
                check_png(data)
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


def _pillow_tensor(raw: Buffer, max_pixels: int | None) -> torch.Tensor:
    array = np.array(decode_pil(raw, max_pixels=max_pixels))
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
