"""Tests of ``ddpkit.data.image_checks``: the PNG, TIFF and JPEG checks that an image's data
fill the size its header declares.

The PNG and JPEG checks read bytes with ``struct`` and ``zlib`` only, so they run here; the
TIFF check needs Pillow to open damaged files, so those run in a child process.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from lmdb_fixtures import encode, photo

from ddpkit.data import image_checks
from ddpkit.data.image_checks import check_png, restart_intervals


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    """``(kind, body)`` of each chunk of a PNG, in order."""
    pos, out = 8, []
    while pos < len(png):
        length, kind = struct.unpack_from(">I4s", png, pos)
        out.append((kind, png[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return out


def _chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(kind + body)
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def _png(chunks: list[tuple[bytes, bytes]]) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"".join(_chunk(kind, body) for kind, body in chunks)


def _with_data(png: bytes, data: bytes, piece: int | None = None) -> bytes:
    """``png`` with its image data replaced by ``data`` (deflated), in IDAT chunks of ``piece``."""
    packed = zlib.compress(data)
    piece = piece or len(packed)
    idat = [(b"IDAT", packed[k : k + piece]) for k in range(0, len(packed), piece)]
    chunks = [c for c in _chunks(png) if c[0] != b"IDAT"]
    return _png(chunks[:-1] + idat + chunks[-1:])


def _inflated(png: bytes) -> bytes:
    return zlib.decompress(b"".join(body for kind, body in _chunks(png) if kind == b"IDAT"))


def _interlaced_png(width: int, height: int, color: int, depth: int) -> tuple[bytes, int]:
    """An Adam7 PNG (Pillow writes none) with all-zero rows, and its data size, pixel by pixel."""
    bits = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color] * depth
    size = 0
    for x0, y0, dx, dy in [
        (0, 0, 8, 8),
        (4, 0, 8, 8),
        (0, 4, 4, 8),
        (2, 0, 4, 4),
        (0, 2, 2, 4),
        (1, 0, 2, 2),
        (0, 1, 1, 2),
    ]:
        columns, rows = len(range(x0, width, dx)), len(range(y0, height, dy))
        if columns and rows:
            size += rows * (1 + (columns * bits + 7) // 8)
    header = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 1)
    return _png([(b"IHDR", header), (b"IDAT", zlib.compress(bytes(size))), (b"IEND", b"")]), size


@pytest.mark.parametrize(
    ("mode", "size"),
    [
        ("1", (37, 21)),
        ("L", (40, 48)),
        ("LA", (13, 7)),
        ("P", (40, 48)),
        ("RGB", (40, 48)),
        ("RGBA", (9, 31)),
        ("I;16", (17, 5)),
    ],
)
def test_whole_pngs_of_every_colour_type_and_depth_pass(mode: str, size: tuple[int, int]) -> None:
    image = photo(4, size).convert("L" if mode == "I;16" else mode)
    if mode == "I;16":
        image = image.convert("I").point(lambda v: v * 257).convert("I;16")
    png = encode(image, "PNG")
    check_png(png)
    check_png(bytearray(png))  # the builder hands it a bytearray


@pytest.mark.parametrize(
    ("width", "height", "color", "depth"),
    [(33, 21, 2, 8), (3, 2, 0, 1), (1, 1, 6, 16), (17, 9, 3, 4)],  # (3, 2): empty passes
)
def test_interlaced_pngs_are_measured_pass_by_pass(
    width: int, height: int, color: int, depth: int
) -> None:
    png, size = _interlaced_png(width, height, color, depth)
    check_png(png)
    with pytest.raises(ValueError, match=f"hold {size - 1} of the {size} bytes"):
        check_png(_with_data(png, bytes(size - 1)))


def test_png_data_one_byte_short_of_the_header_is_refused_with_both_counts() -> None:
    png = encode(photo(2, (40, 48)), "PNG")
    data = _inflated(png)
    assert len(data) == 48 * (1 + 40 * 3)  # a filter byte and three bytes a pixel, per row
    check_png(_with_data(png, data))  # rebuilt whole: still accepted
    message = f"PNG image data hold {len(data) - 1} of the {len(data)} bytes its 40x48 header"
    with pytest.raises(ValueError, match=message):
        check_png(_with_data(png, data[:-1]))


def test_png_data_are_counted_across_idat_chunks_and_extra_bytes_are_accepted() -> None:
    png = encode(photo(5, (40, 48)), "PNG")
    data = _inflated(png)
    check_png(_with_data(png, data, piece=7))  # many small IDAT chunks add up
    check_png(_with_data(png, data + bytes(5000), piece=100))  # more than the header needs
    with pytest.raises(ValueError, match=f"hold {len(data) // 2} of the {len(data)} bytes"):
        check_png(_with_data(png, data[: len(data) // 2], piece=7))


def _damaged_pngs() -> dict[str, tuple[bytes, str]]:
    png = encode(photo(6, (40, 48)), "PNG")
    chunks = _chunks(png)
    ihdr = chunks[0][1]
    end_of_idat = len(png) - 12  # the IEND chunk is the last 12 bytes
    flipped = bytearray(png)
    flipped[8 + 8 + 2] ^= 0x01  # a byte of IHDR's body: its width
    return {
        "cut-in-ihdr-header": (png[:15], "PNG cut short at byte 15: the file is truncated"),
        "no-iend": (png[:end_of_idat], f"PNG cut short at byte {end_of_idat}"),
        "cut-in-idat": (png[: end_of_idat - 40], r"chunk b'IDAT' runs past the end of the file"),
        "bit-flip": (bytes(flipped), r"chunk b'IHDR' fails its checksum: the file is damaged"),
        "no-ihdr": (_png(chunks[1:]), "PNG without an IHDR header chunk"),
        "colour-type-5": (
            _png([(b"IHDR", ihdr[:9] + b"\x05" + ihdr[10:]), *chunks[1:]]),
            r"PNG header is invalid \(colour type 5, 40x48\)",
        ),
        "zero-width": (
            _png([(b"IHDR", bytes(4) + ihdr[4:]), *chunks[1:]]),
            r"PNG header is invalid \(colour type 2, 0x48\)",
        ),
        "not-zlib": (
            _png([chunks[0], (b"IDAT", b"\x00" * 64), chunks[-1]]),
            "PNG image data are not valid zlib data",
        ),
    }


@pytest.mark.parametrize("case", sorted(_damaged_pngs()))
def test_each_kind_of_png_damage_is_named(case: str) -> None:
    data, message = _damaged_pngs()[case]
    with pytest.raises(ValueError, match=message):
        check_png(data)


def _set_tiff(data: bytes, tag: int, value: int) -> bytes:
    """``data`` (little-endian TIFF) with tag ``tag`` of its first IFD set to ``value``."""
    out = bytearray(data)
    ifd = struct.unpack_from("<I", out, 4)[0]
    for k in range(struct.unpack_from("<H", out, ifd)[0]):
        entry = ifd + 2 + 12 * k
        if struct.unpack_from("<H", out, entry)[0] == tag:
            struct.pack_into("<HII", out, entry + 2, 4, 1, value)  # one LONG
            return bytes(out)
    raise AssertionError(f"no tag {tag}")


_VERDICTS = """
import importlib.util, io, json, sys
from pathlib import Path
from PIL import Image
# The module alone (it needs only NumPy and Pillow): importing ddpkit would load torch.
spec = importlib.util.spec_from_file_location("image_checks", sys.argv[2])
checks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checks)
verdicts = {}
for path in sorted(Path(sys.argv[1]).iterdir()):
    try:
        checks.check_tiff_strips(Image.open(io.BytesIO(path.read_bytes())))
        verdicts[path.name] = "ok"
    except ValueError as exc:
        verdicts[path.name] = str(exc)
print(json.dumps(verdicts))
"""


def _tiff_verdicts(tmp_path: Path, cases: dict[str, bytes]) -> dict[str, str]:
    """``check_tiff_strips``' verdict on each case, from a child process (Pillow reads them)."""
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    done = subprocess.run(
        [sys.executable, "-c", _VERDICTS, str(tmp_path), image_checks.__file__],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    verdicts: dict[str, str] = json.loads(done.stdout)
    return verdicts


def test_tiff_strips_must_cover_every_row_the_header_declares(tmp_path: Path) -> None:
    image = photo(7, (100, 70))
    strips = encode(image, "TIFF", tiffinfo={278: 8})  # RowsPerStrip 8: nine strips
    cases = {
        "one-strip": encode(image, "TIFF"),
        "nine-strips": strips,
        "deflate": encode(image, "TIFF", compression="tiff_deflate"),
        "taller-header": _set_tiff(strips, 257, 100),  # ImageLength 100: 72 rows have strips
        "fewer-rows-per-strip": _set_tiff(strips, 278, 4),  # 9 strips of 4 rows: 36
    }
    verdicts = _tiff_verdicts(tmp_path, cases)
    assert verdicts["one-strip"] == verdicts["nine-strips"] == verdicts["deflate"] == "ok"
    assert verdicts["taller-header"].startswith(
        "TIFF strips cover 72 of the 100 rows its 100x100 header declares"
    )
    assert verdicts["fewer-rows-per-strip"].startswith("TIFF strips cover 36 of the 70 rows")
    assert all("truncated" in v for k, v in verdicts.items() if v != "ok")


def _tiled_tiff(width: int = 32, height: int = 16, tile: int = 16) -> bytes:
    """An uncompressed 8-bit grey TIFF stored in square tiles (Pillow writes no tiles itself)."""
    count = -(-width // tile) * -(-height // tile)
    pixels = bytes(k % 251 for k in range(tile * tile * count))
    tags = [(256, width), (257, height), (258, 8), (259, 1), (262, 1), (277, 1)]
    tags += [(322, tile), (323, tile)]
    first = 8 + 2 + 12 * (len(tags) + 2) + 4  # where the two offset arrays start
    data = first + 8 * count
    offsets = [data + k * tile * tile for k in range(count)]
    out = bytearray(b"II*\x00" + struct.pack("<IH", 8, len(tags) + 2))
    for tag, value in tags:
        out += struct.pack("<HHII", tag, 4, 1, value)
    out += struct.pack("<HHII", 324, 4, count, first)
    out += struct.pack("<HHII", 325, 4, count, first + 4 * count)
    out += struct.pack("<I", 0)
    out += struct.pack(f"<{count}I", *offsets)
    out += struct.pack(f"<{count}I", *[tile * tile] * count)
    return bytes(out + pixels)


def test_a_whole_tiled_tiff_passes(tmp_path: Path) -> None:
    cases = {"tiled": _tiled_tiff()}
    verdicts = _tiff_verdicts(tmp_path, cases)
    assert verdicts["tiled"] == "ok"


def test_restart_intervals_counts_a_whole_scan_and_ignores_jpegs_without_them() -> None:
    image = photo(8, (40, 32))  # 4:2:0 colour: 16x16 MCUs, 3 x 2 of them
    assert restart_intervals(encode(image, "JPEG", restart_marker_blocks=1)) == (6, 6)
    assert restart_intervals(encode(image, "JPEG", restart_marker_blocks=4)) == (2, 2)
    grey = image.convert("L")  # one component: 8x8 MCUs, 5 x 4, one row of 5 per interval
    assert restart_intervals(encode(grey, "JPEG", restart_marker_rows=1)) == (4, 4)
    assert restart_intervals(encode(image, "JPEG")) is None  # no DRI marker
    progressive = encode(image, "JPEG", progressive=True, restart_marker_blocks=1)
    assert restart_intervals(progressive) is None  # several scans


def test_restart_intervals_of_a_cut_scan_fall_short() -> None:
    whole = encode(photo(9, (64, 64)), "JPEG", restart_marker_blocks=1)  # 16 intervals
    assert restart_intervals(whole) == (16, 16)
    scan = whole.index(b"\xff\xda")  # the scan's header, then its data
    cut = whole[: scan + (len(whole) - scan) // 2] + b"\xff\xd9"
    held, needed = restart_intervals(cut) or (0, 0)
    assert needed == 16
    assert 1 <= held < needed
    assert restart_intervals(whole[:2]) is None  # nothing past the SOI marker
