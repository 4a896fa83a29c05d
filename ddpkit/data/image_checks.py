"""Checks that an encoded image's data fill the size its header declares, format by format.

Decoders pad what is missing with black or a flat colour, and say so at most
on stderr: a PNG's rows are counted from its inflated data, a TIFF's from its
strips, a JPEG's restart intervals from its markers. ``ddpkit.data.images``
runs them on every decode path.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["check_png", "check_tiff_strips", "restart_intervals"]

Buffer = bytes | bytearray


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


def check_tiff_strips(image: Image.Image) -> None:
    """Refuse a TIFF whose strips or tiles cover fewer rows than its header declares.

    Pillow leaves the rows no strip covers black, without a word.
    """
    width, height = image.size
    # Pixels each row's strips or tiles span: a row is covered once they reach across it.
    across = np.zeros(height, dtype=np.int64)
    for tile in getattr(image, "tile", []):
        x0, y0, x1, y1 = tile[1]
        across[max(y0, 0) : min(y1, height)] += max(0, min(x1, width) - max(x0, 0))
    covered = across >= width
    if not covered.all():
        raise ValueError(
            f"TIFF strips cover {int(covered.sum())} of the {height} rows its {width}x{height} "
            "header declares: the file is truncated or its header damaged"
        )


def restart_intervals(data: bytes) -> tuple[int, int] | None:
    """``(intervals the data hold, intervals the header needs)`` of a one-scan JPEG with
    restart markers, or None for any other JPEG."""
    pos, interval, blocks, scans, scan_start = 2, 0, 0, 0, 0
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        length = struct.unpack_from(">H", data, pos + 2)[0]
        if marker == 0xDD and length >= 4:  # DRI: MCUs per restart interval
            interval = struct.unpack_from(">H", data, pos + 4)[0]
        elif marker in (0xC0, 0xC1) and pos + 10 <= len(data):  # sequential SOF
            height, width, count = struct.unpack_from(">HHB", data, pos + 5)
            factors = [
                data[pos + 11 + 3 * c] for c in range(count) if pos + 12 + 3 * c <= len(data)
            ]
            h_max = max((f >> 4 for f in factors), default=1) or 1
            v_max = max((f & 15 for f in factors), default=1) or 1
            size = (8 * h_max, 8 * v_max) if count > 1 else (8, 8)
            blocks = -(-width // size[0]) * -(-height // size[1])
        elif marker == 0xDA:
            scans += 1
            scan_start = pos + 2 + length
            break
        pos += 2 + length
    if not (interval and blocks and scans == 1):
        return None
    scan = data[scan_start:]
    markers = sum(scan.count(bytes((0xFF, 0xD0 + k))) for k in range(8))
    return markers + 1, -(-blocks // interval)
