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
from typing import Literal, cast

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
    "decode_pil",
    "decode_tensor",
    "decode_tensor_known",
    "image_size",
    "jpeg_for_decoder",
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
    width, height = image.size if image is not None else image_size(raw)
    _check_pixels(width, height, max_pixels)


def _check_pixels(width: int, height: int, max_pixels: int | None) -> None:
    """Raise :class:`ImageTooLargeError` if ``width x height`` is more than the limit."""
    limit = pixel_limit(max_pixels)
    if limit is not None and width * height > limit:
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
            from torchcodec.decoders import ImageReadMode as Mode
            from torchcodec.decoders import decode_jpeg, decode_webp
        except Exception:  # not installed, or its native library does not load with this torch
            return None
        # Its arguments as the decoder keeps them (an enum, a device): named by strings,
        # their parsing costs about 0.5 % of a photo's decode. One source in, one image out.
        jpeg = functools.partial(decode_jpeg, mode=Mode.RGB, device=torch.device("cpu"))
        return {"jpeg": cast(Decoder, jpeg), "webp": functools.partial(decode_webp, mode=Mode.RGB)}
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


_JPEG_START = b"\xff\xd8\xff"  # SOI, then a marker
# JPEG markers that carry no length: TEM and RST0..RST7 (SOI is read before the loop).
_BARE_MARKERS = frozenset({0x01, *range(0xD0, 0xD8)})
# Start-of-frame markers: every SOFn but DHT (C4), JPG (C8) and DAC (CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Every other marker that carries a length: the walk hops over its segment.
_PLAIN_SEGMENTS = frozenset(range(0xFF)) - _BARE_MARKERS - _SOF_MARKERS - {0xD9, 0xDA, 0xE1}
_SEGMENT = struct.Struct(">BBH")  # 0xFF, the marker, the segment's length
_FRAME = struct.Struct(">BHH")  # a frame header's start: sample bits, height, width
# An APP1 segment renamed so: APP15, which no decoder reads (see _without_orientation).
_HIDDEN_APP1 = 0xEF


def _jpeg_header(raw: Buffer) -> tuple[tuple[int, int] | None, list[int]]:
    """A JPEG's ``(width, height)`` and where each APP1 segment's marker (EXIF, XMP) is.

    One walk of the markers up to the scan. The size is None for anything
    unusual (a second frame header, a height the DNL marker gives, 12-bit
    samples, a segment running past the end, no frame header): Pillow then
    reads the header and says what is wrong. Pillow's own parse of a header
    costs a sixth of a decoded photo; this walk, a few microseconds.
    """
    size: tuple[int, int] | None = None
    app1: list[int] = []
    usual, end, offset = True, len(raw), 2
    segment_at = _SEGMENT.unpack_from
    while offset + 4 <= end:
        ff, marker, length = segment_at(raw, offset)
        if ff != 0xFF:
            break
        if marker in _PLAIN_SEGMENTS and length >= 2:  # tables, APP0, comments ...: hopped
            offset += 2 + length
            continue
        if marker == 0xFF:  # a fill byte before the marker
            offset += 1
            continue
        if marker in _BARE_MARKERS:
            offset += 2
            continue
        if marker == 0xDA or marker == 0xD9:  # the scan (every header segment read), or the end
            return (size if usual and marker == 0xDA else None), app1
        segment, offset = offset + 4, offset + 2 + length
        if length < 2 or offset > end:
            break
        if marker in _SOF_MARKERS:
            if size is not None or length < 8:
                usual = False
                continue
            bits, height, width = _FRAME.unpack_from(raw, segment)
            usual = usual and bits == 8 and width > 0 and height > 0  # 8-bit samples only
            size = (width, height)
        elif marker == 0xE1:
            app1.append(segment - 3)
    return None, app1


def _without_orientation(raw: Buffer, app1: list[int]) -> bytearray:
    """A copy of the JPEG ``raw`` whose APP1 segments no decoder reads: nothing rotates it.

    TorchCodec applies the EXIF orientation it finds in the first APP1 segment
    (none if an XMP segment comes first), torchvision's decoder none, Pillow
    none unless asked. Rather than guess what a decoder did, no decoder is
    shown an APP1 segment (``app1``: where their markers are), so every path
    gives the stored pixels, as ``ImageFolder``'s loader does. Each becomes
    APP15 in the copy, which decoders skip; the caller's bytes never change.
    """
    data = bytearray(raw)
    for marker in app1:
        data[marker] = _HIDDEN_APP1
    return data


def _webp_without_orientation(raw: Buffer) -> Buffer:
    """The WebP ``raw``, or a copy whose EXIF chunk no decoder reads (TorchCodec applies it)."""
    if len(raw) < 21 or bytes(raw[12:16]) != b"VP8X" or not raw[20] & 0x08:
        return raw
    data = bytearray(raw)
    data[20] &= 0xFF ^ 0x08  # the extended header's "has EXIF" flag
    offset = 12
    while offset + 8 <= len(data):  # RIFF chunks: fourcc, little-endian size, even padding
        size = int.from_bytes(data[offset + 4 : offset + 8], "little")
        if bytes(data[offset : offset + 4]) == b"EXIF":
            data[offset : offset + 4] = b"exif"  # an unknown chunk: skipped by every reader
        offset += 8 + size + (size & 1)
    return data


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
    return decode_tensor_known(raw, 0, max_pixels=max_pixels)[0]


def decode_tensor_known(
    raw: Buffer, known: int, *, max_pixels: int | None = None
) -> tuple[torch.Tensor, int]:
    """:func:`decode_tensor`, with what an earlier decode of the same bytes found.

    What must be found once per record, not once per read: for a JPEG with an
    ordinary header (8-bit samples, one frame, no APP1 segment) whose data
    were found whole, its size. Given that (``known``, from an earlier call
    on the same bytes), its header is not walked and its data not checked for
    a short end again; its size is still checked against ``max_pixels`` and
    against what the decoder gives. ``LazyLMDBDataset`` keeps it per record,
    shared by its DataLoader workers, so a record's header and data are
    examined in the first epoch and only decoded after.

    Args:
        raw: the encoded bytes.
        known: what this function returned for the same bytes before; 0:
            nothing (the first read, or not a JPEG of that kind).
        max_pixels: as for :func:`decode_tensor`.

    Returns:
        The image, as :func:`decode_tensor` gives it, and what to pass as
        ``known`` next time: ``width << 16 | height``, or 0.

    Raises:
        As :func:`decode_tensor`.
    """
    if known or raw[:3] == _JPEG_START:  # nearly every photo: one function to the decoder
        jpeg = tensor_decoders()[1].get("jpeg")
        if jpeg is not None:
            return _jpeg(jpeg, raw, max_pixels, known)
    kind = _kind(raw)
    decode = tensor_decoders()[1].get(kind)
    if decode is None or (kind == "webp" and _animated_webp(raw)):
        return _pillow_tensor(raw, max_pixels), 0  # PNG (checked there), GIF, BMP, TIFF ...
    with _open(raw) as header:  # WebP: Pillow reads its header
        width, height = header.size
    _check_pixels(width, height, max_pixels)
    image = _fast_decoded(decode, _webp_without_orientation(raw), width, height)
    return (_pillow_tensor(raw, max_pixels) if image is None else image), 0


def _jpeg(
    decode: Decoder, raw: Buffer, max_pixels: int | None, known: int
) -> tuple[torch.Tensor, int]:
    """The JPEG ``raw`` decoded by the fast decoder ``decode``, checked, else by Pillow; and
    what :func:`decode_tensor_known` may remember of it (``width << 16 | height``, or 0).

    With ``known``, the header is not walked and the data not checked for a
    short end. Written out in one function: right after a decode, each Python
    call more costs about 0.3 % of the photo's decode.
    """
    app1: list[int] = []
    size: tuple[int, int] | None = (known >> 16, known & 0xFFFF)
    if not known:  # the first read
        size, app1 = _jpeg_header(raw)
    usual = size is not None and not app1
    if size is None:  # a header out of the ordinary: Pillow reads it
        with _open(raw) as header:
            size = header.size
    width, height = size
    limit = pixel_limit(max_pixels)
    if limit is not None and width * height > limit:
        _check_pixels(width, height, max_pixels)  # raises, with the words
    if app1:
        data = _without_orientation(raw, app1)
    else:  # frombuffer needs a writable buffer: the dataset's records are one already
        data = raw if isinstance(raw, bytearray) else bytearray(raw)
    try:
        image = decode(torch.frombuffer(data, dtype=torch.uint8))
    except RuntimeError:
        image = None
    if image is None or image.shape != (3, height, width):
        if known:  # not what was found before (never, for the same bytes): the whole way
            return decode_tensor_known(raw, 0, max_pixels=max_pixels)
        return _pillow_tensor(raw, max_pixels), 0  # Pillow says what is wrong
    if not known and _uniform_corner(image.numpy()):  # a NumPy view, no copy
        check_jpeg_data(raw, decoded=image.numpy().transpose(1, 2, 0))
    return image, (width << 16 | height) if usual else 0


def _fast_decoded(decode: Decoder, data: Buffer, width: int, height: int) -> torch.Tensor | None:
    """``data`` decoded by a fast decoder if it gives the header's size; else None.

    Every call into torch here is one that dispatches nothing (``ndim``,
    ``shape``): right after a decode, each one that does costs about 1 % of the decode.
    """
    if not isinstance(data, bytearray):
        data = bytearray(data)  # frombuffer needs a writable buffer
    try:
        image = decode(torch.frombuffer(data, dtype=torch.uint8))
    except RuntimeError:
        return None  # Pillow says what is wrong, or reads what the fast decoder cannot
    if image.ndim == 4:  # an animated image: its first frame
        image = image[0]
    return image if image.shape == (3, height, width) else None


def jpeg_for_decoder(
    raw: Buffer, *, max_pixels: int | None = None
) -> tuple[bytearray, int, int] | None:
    """A JPEG as any decoder reads it alike, with its width and height from the header.

    The bytes are a copy whose APP1 segments no decoder reads (no EXIF
    orientation applied, as in :func:`decode_tensor`); the size is checked
    against ``max_pixels``. None for another format, or a JPEG header out of
    the ordinary (:func:`decode_tensor` reads those).

    Raises:
        ImageTooLargeError: the header claims more pixels than the limit.
    """
    if _kind(raw) != "jpeg":
        return None
    size, app1 = _jpeg_header(raw)
    if size is None:
        return None
    width, height = size
    _check_pixels(width, height, max_pixels)
    return (_without_orientation(raw, app1) if app1 else bytearray(raw)), width, height


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
        if _uniform_corner(corner.transpose(2, 0, 1)):  # the whole corner: the same test
            check_jpeg_data(raw, decoded=np.asarray(rgb))
    return rgb


# Where a JPEG's compressed data end before its last row, libjpeg warns ("premature
# end of data segment"), which neither torchvision nor Pillow report, and gives every
# missing block a flat value (mid-gray for whole MCUs; the block before's colour in an
# MCU the data end in): a uniform bottom-right corner. Only then is the data checked
# (a second decode), so a whole image costs nothing more.
_FILLER_PROBE = bytes((k * 37 + 11) % 255 for k in range(2048))  # no 0xFF: not a marker


def _uniform_corner(pixels: np.ndarray) -> bool:
    """Whether the bottom-right 4 x 4 corner of a ``channels x rows x columns`` image is flat."""
    # Two neighbours that differ settle it for nearly every photo, in a microsecond.
    if pixels.shape[2] > 1 and pixels[0, -1, -1] != pixels[0, -1, -2]:
        return False
    corner = pixels[:, -4:, -4:]
    return bool((corner == corner[:, :1, :1]).all())


def check_jpeg_data(raw: Buffer, *, decoded: np.ndarray | None = None) -> None:
    """Check that a JPEG's compressed data fill the size its header declares.

    libjpeg fills the blocks past the end of short data with a flat colour and
    says so only on stderr. Decoded again with bytes the decoder would skip
    after complete data inserted before the end marker, a short image changes
    where its data ran out; a whole one does not.

    Args:
        raw: the JPEG.
        decoded: its ``height x width x 3`` RGB pixels as the caller decoded
            them, if it has them. Equal to the probed decode, the image is
            whole after one decode here instead of two (every decoder
            ``decode_tensor`` uses gives Pillow's pixels); else both are
            decoded, as without them.

    Raises:
        ValueError: the data end before the image does (a truncated file, or a
            header raised to more rows or columns than the data hold).
    """
    data = bytes(raw)
    end = data.rfind(b"\xff\xd9")
    end = len(data) if end < 0 else end
    probed = _pillow_pixels(data[:end] + _FILLER_PROBE + b"\xff\xd9")
    if decoded is not None and _same_as_rgb(probed, decoded):
        short = False  # the probe was skipped: the decoder read whole data before it
    else:
        short = not np.array_equal(_pillow_pixels(data), probed)
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


def _same_as_rgb(pixels: np.ndarray, rgb: np.ndarray) -> bool:
    """Whether Pillow's pixels of a JPEG (gray, or RGB) are the ``H x W x 3`` image ``rgb``."""
    if pixels.ndim == 2:  # gray: each channel of the RGB image
        return rgb.shape[:2] == pixels.shape and all(
            np.array_equal(rgb[..., c], pixels) for c in range(3)
        )
    return pixels.shape == rgb.shape and np.array_equal(pixels, rgb)


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
