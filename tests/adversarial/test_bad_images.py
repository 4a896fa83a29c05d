"""Damaged images in every format the builder accepts: named, never a crash, one verdict.

Every decode here runs in a child process: a decoder that crashes on a
regression fails one test instead of killing the run.
"""

from __future__ import annotations

import io
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from lmdb_fixtures import decoders_say, encode, photo
from PIL import Image
from torch.utils.data import DataLoader

from ddpkit.data import LazyLMDBDataset, LMDBFormatError, build_lmdb, verify_report
from ddpkit.data.images import ImageTooLargeError, check_image, decode_pil, decode_tensor
from ddpkit.testing import run_distributed

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def short_png(rows: int = 10, height: int = 48, width: int = 40) -> bytes:
    """A PNG whose image data hold ``rows`` of the ``height`` rows its header declares."""
    row = [bytes((x * 3 + y) % 256 for x in range(width * 3)) for y in range(rows)]
    raw = b"".join(b"\x00" + r for r in row)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw))
            + _chunk(b"IEND", b""))  # fmt: skip


def _set_jpeg(data: bytes, height: int | None, width: int | None) -> bytes:
    """``data`` with its SOF marker's height and/or width replaced."""
    out, pos = bytearray(data), 2
    while pos + 4 <= len(out):
        marker, length = out[pos + 1], struct.unpack_from(">H", out, pos + 2)[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a SOF marker
            if height is not None:
                struct.pack_into(">H", out, pos + 5, height)
            if width is not None:
                struct.pack_into(">H", out, pos + 7, width)
            return bytes(out)
        pos += 2 + length
    raise AssertionError("no SOF marker")


def _set_png(data: bytes, width: int | None, height: int | None) -> bytes:
    """``data`` with its IHDR width and/or height replaced, the CRC made right again."""
    out = bytearray(data)
    if width is not None:
        struct.pack_into(">I", out, 16, width)
    if height is not None:
        struct.pack_into(">I", out, 20, height)
    struct.pack_into(">I", out, 29, zlib.crc32(bytes(out[12:29])))
    return bytes(out)


def _set_at(data: bytes, fmt: str, offset: int, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _set_tiff(data: bytes, tag: int, value: int) -> bytes:
    """``data`` (little-endian TIFF) with tag ``tag`` of its first IFD set to ``value``."""
    out = bytearray(data)
    ifd = struct.unpack_from("<I", out, 4)[0]
    for k in range(struct.unpack_from("<H", out, ifd)[0]):
        entry = ifd + 2 + 12 * k
        if struct.unpack_from("<H", out, entry)[0] == tag:
            struct.pack_into("<HI", out, entry + 2, 4, 1)  # one LONG
            struct.pack_into("<I", out, entry + 8, value)
            return bytes(out)
    raise AssertionError(f"no tag {tag}")


def _set_webp(data: bytes, width: int | None, height: int | None) -> bytes:
    """A lossy (VP8) or lossless (VP8L) WebP with its frame size replaced."""
    out = bytearray(data)
    chunk = bytes(out[12:16])
    if chunk == b"VP8 ":  # 14-bit width and height after the 3-byte start code
        if width is not None:
            struct.pack_into("<H", out, 26, width & 0x3FFF)
        if height is not None:
            struct.pack_into("<H", out, 28, height & 0x3FFF)
    elif chunk == b"VP8L":  # (width - 1) and (height - 1) in 14 bits each after 0x2F
        bits = struct.unpack_from("<I", out, 21)[0]
        if width is not None:
            bits = (bits & ~0x3FFF) | (width - 1)
        if height is not None:
            bits = (bits & ~(0x3FFF << 14)) | ((height - 1) << 14)
        struct.pack_into("<I", out, 21, bits)
    else:
        raise AssertionError(chunk)
    return bytes(out)


def _set_ppm(data: bytes, width: int | None, height: int | None) -> bytes:
    magic, size, rest = data.split(b"\n", 2)
    w, h = size.split()
    return b"\n".join([magic, b"%d %d" % (width or int(w), height or int(h)), rest])


HUGE = 65000  # 65000 x 65000 = 4.2e9 pixels: 12.6 GiB as RGB


def huge_headers() -> dict[str, bytes]:
    """Every size field of every format the builder accepts set huge: over Pillow's limit."""
    rgb = photo(5, (48, 40)).convert("RGB")
    jpeg, progressive = encode(rgb, "JPEG"), encode(rgb, "JPEG", progressive=True)
    png, gif, bmp = encode(rgb, "PNG"), encode(rgb, "GIF"), encode(rgb, "BMP")
    tiff = encode(rgb, "TIFF")
    lossy, lossless = encode(rgb, "WEBP"), encode(rgb, "WEBP", lossless=True)
    ppm, pgm = encode(rgb, "PPM"), encode(rgb.convert("L"), "PPM")
    big = 16383  # WebP's 14-bit sizes: 16383 x 16383 = 2.7e8 pixels
    cases = {}
    # One field huge, the other large enough that the product passes the limit.
    for name, w, h in [("height", 4000, HUGE), ("width", HUGE, 4000), ("both", HUGE, HUGE)]:
        cases[f"JPEG-{name}"] = _set_jpeg(jpeg, h, w)
        cases[f"JPEG-progressive-{name}"] = _set_jpeg(progressive, h, w)
        cases[f"PNG-{name}"] = _set_png(png, w * 20, h * 20)
        cases[f"PPM-{name}"] = _set_ppm(ppm, w * 20, h * 20)
        cases[f"PGM-{name}"] = _set_ppm(pgm, w * 20, h * 20)
    cases["WEBP-both"] = _set_webp(lossy, big, big)
    cases["WEBP-lossless-both"] = _set_webp(lossless, big, big)
    cases["GIF-screen"] = _set_at(_set_at(gif, "<H", 6, 65535), "<H", 8, 65535)
    cases["BMP-width"] = _set_at(_set_at(bmp, "<i", 18, 10**6), "<i", 22, 5000)
    cases["BMP-height"] = _set_at(_set_at(bmp, "<i", 22, 10**6), "<i", 18, 5000)
    cases["BMP-top-down-height"] = _set_at(_set_at(bmp, "<i", 22, -(10**6)), "<i", 18, 5000)
    cases["TIFF-width"] = _set_tiff(_set_tiff(tiff, 256, 10**6), 257, 5000)
    cases["TIFF-height"] = _set_tiff(_set_tiff(tiff, 257, 10**6), 256, 5000)
    return cases


def short_data() -> dict[str, bytes]:
    """Every format with a header claiming more rows or columns than its data hold."""
    rgb = photo(5, (48, 40)).convert("RGB")
    jpegs = {
        "JPEG": encode(rgb, "JPEG"),
        "JPEG-progressive": encode(rgb, "JPEG", progressive=True),
        "JPEG-gray": encode(rgb.convert("L"), "JPEG"),
        "JPEG-444": encode(rgb, "JPEG", subsampling=0),
        "JPEG-restarts": encode(rgb, "JPEG", restart_marker_blocks=1),
    }
    cases = {}
    for name, w, h in [("rows", None, 4096), ("cols", 4096, None), ("rows2", None, 80)]:
        for fmt, data in jpegs.items():
            cases[f"{fmt}-{name}"] = _set_jpeg(data, h, w)
        cases[f"PNG-{name}"] = _set_png(encode(rgb, "PNG"), w, h)
        cases[f"PPM-{name}"] = _set_ppm(encode(rgb, "PPM"), w, h)
        cases[f"BMP-{name}"] = _set_at(encode(rgb, "BMP"), "<i", 22 if h else 18, h or w)
        cases[f"TIFF-{name}"] = _set_tiff(encode(rgb, "TIFF"), 257 if h else 256, h or w)
        cases[f"WEBP-{name}"] = _set_webp(encode(rgb, "WEBP"), w, h)
        cases[f"WEBP-lossless-{name}"] = _set_webp(encode(rgb, "WEBP", lossless=True), w, h)
    cases["JPEG-4096-rows"] = _set_jpeg(encode(photo(1, (64, 64)).convert("RGB")), 4096, None)
    return cases


def _cap_memory(gib: int = 4) -> None:
    """Let this (child) process grow by ``gib`` GiB at most: a regression fails, no OOM kill."""
    import resource

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    cap = pages * resource.getpagesize() + (gib << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _damaged(fmt: str) -> dict[str, bytes]:
    good = encode(photo(FORMATS.index(fmt) + 3, (48, 40)).convert("RGB"), fmt)
    cases = {f"{fmt}-whole": good}
    for fraction in (0.05, 0.3, 0.6, 0.9):
        cases[f"{fmt}-cut{fraction}"] = good[: max(1, int(len(good) * fraction))]
    cases[f"{fmt}-cut-last"] = good[:-1]
    rng = random.Random(fmt)
    for k in range(8):
        flipped = bytearray(good)
        for _ in range(4):
            flipped[rng.randrange(8, len(flipped))] ^= 1 << rng.randrange(8)
        cases[f"{fmt}-flip{k}"] = bytes(flipped)
    return cases


def corpus() -> dict[str, bytes]:
    cases = {name: data for fmt in FORMATS for name, data in _damaged(fmt).items()}
    cases["png-short-rows"] = short_png()
    cases.update({f"huge-{k}": v for k, v in huge_headers().items()})
    cases.update({f"short-{k}": v for k, v in short_data().items()})
    # Whole images whose last block is one flat colour: checked twice, still read.
    cases["flat-gray-whole"] = encode(Image.new("RGB", (48, 40), (128, 128, 128)), "JPEG")
    cases["flat-white-whole"] = encode(Image.new("RGB", (40, 48), (255, 255, 255)), "JPEG")
    flat = Image.new("RGB", (56, 40), (128, 128, 128))
    cases["flat-restarts-whole"] = encode(flat, "JPEG", restart_marker_blocks=1)
    cases["flat-gray-restarts-whole"] = encode(flat.convert("L"), "JPEG", restart_marker_rows=1)
    cases["png-interlaced-whole"] = encode(photo(9, (33, 21)), "PNG", interlace=1)
    cases["empty"] = b""
    cases["text"] = b"definitely not an image"
    return cases


def _verdicts(rank: int, world_size: int) -> dict[str, tuple[bool, bool, bool]]:
    """(checker ok, tensor decode ok, PIL decode ok) per case; a crash fails the caller."""
    _cap_memory()
    out = {}
    for name, data in corpus().items():
        results = []
        for decode in (decode_tensor, decode_pil):
            try:
                decode(data)
                results.append(True)
            except Exception:
                results.append(False)
        out[name] = (check_image(data, "decode") is None, results[0], results[1])
    return out


def _corpus_job(rank: int, world_size: int) -> dict[str, Any]:
    """The verdicts, and each JPEG and WebP decoded with each library: one child for both."""
    return {"verdicts": _verdicts(rank, world_size), "by_library": _by_library(rank, world_size)}


@pytest.fixture(scope="module")
def corpus_results() -> dict[str, Any]:
    return dict(run_distributed(_corpus_job, 1, init=None, timeout=240)[0])


def test_no_damaged_image_crashes_a_decoder_and_all_three_agree(
    corpus_results: dict[str, Any],
) -> None:
    verdicts = corpus_results["verdicts"]
    for name, (checked, tensor, _) in verdicts.items():
        assert checked == tensor, name  # verify says ok exactly when the dataset can decode
    for fmt in FORMATS:
        assert verdicts[f"{fmt}-whole"] == (True, True, True), fmt
        assert verdicts[f"{fmt}-cut0.3"][0] is False, fmt
    assert verdicts["png-short-rows"] == (False, False, False)
    for name, verdict in verdicts.items():  # refused by every reader, never padded
        if name.startswith(("huge-", "short-")):
            assert verdict == (False, False, False), name
    for name in ("flat-gray", "flat-white", "flat-restarts", "flat-gray-restarts"):
        assert verdicts[f"{name}-whole"] == (True, True, True), name
    assert verdicts["png-interlaced-whole"] == (True, True, True)
    # A PNG cut anywhere is refused by every reader, not padded with black rows.
    assert not any(any(v) for n, v in verdicts.items() if n.startswith("PNG-cut"))


def _random_png_mutations(rank: int, world_size: int, seed: int, rounds: int) -> int:
    rng = random.Random(seed)
    base = encode(photo(seed, (32, 24)), "PNG")
    refused = 0
    for _ in range(rounds):
        data = bytearray(base)
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        try:
            decode_tensor(bytes(data))
        except Exception:
            refused += 1
    return refused


def test_random_png_damage_never_crashes() -> None:
    refused = run_distributed(_random_png_mutations, 1, args=(7, 400), init=None, timeout=240)[0]
    assert refused > 100  # most mutations break the CRCs: they are caught, not decoded


def _read_all_with_workers(rank: int, world_size: int, db: str) -> tuple[int, list[str]]:
    loader = DataLoader(LazyLMDBDataset(db), batch_size=None, num_workers=2, collate_fn=None)
    errors: list[str] = []
    count = 0
    iterator = iter(loader)
    while True:
        try:
            next(iterator)
            count += 1
        except StopIteration:
            return count, errors
        except LMDBFormatError as exc:  # a DataLoader re-raises a worker's error and stops
            errors.append(str(exc))
            return count, errors


def test_the_short_png_is_stopped_at_build_time_and_a_stored_one_is_named(tmp_path: Path) -> None:
    root = tmp_path / "imgs"
    for k in range(2):
        (root / f"c{k}").mkdir(parents=True)
        for i in range(3):
            (root / f"c{k}" / f"{i}.png").write_bytes(encode(photo(i + 3 * k, (40, 48)), "PNG"))
    (root / "c1" / "short.png").write_bytes(short_png())
    summary = build_lmdb(root, tmp_path / "db", check="decode", on_error="skip", progress=False)
    assert [Path(p).name for p, _ in summary.skipped] == ["short.png"]
    assert "truncated" in summary.skipped[0][1]
    # Stored anyway (check="none"), it is named by verify and by the dataset, in a worker.
    build_lmdb(root, tmp_path / "raw", check="none", progress=False)
    report = verify_report(tmp_path / "raw")
    assert [b.path for b in report.bad] == ["c1/short.png"]
    _, errors = run_distributed(
        _read_all_with_workers, 1, args=(str(tmp_path / "raw"),), init=None, timeout=240
    )[0]
    assert errors, "the dataset read the short PNG without a word"
    assert "built from c1/short.png" in errors[0]  # named: the sample and its source file
    assert "does not decode as an image" in errors[0]
    assert "truncated" in errors[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_decodes_to_the_same_pixels_both_ways(fmt: str) -> None:
    data = encode(photo(2, (40, 48)), fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    tensor = decode_tensor(data)
    assert tensor.shape == (3, 48, 40)
    import numpy as np
    import torch

    pil = torch.from_numpy(np.array(decode_pil(data))).permute(2, 0, 1)
    if fmt in ("PNG", "BMP", "TIFF", "WEBP", "GIF"):  # lossless: exact
        assert torch.equal(tensor, pil), fmt
    else:  # two JPEG decoders may differ by rounding
        assert (tensor.int() - pil.int()).abs().max() <= 3


def test_a_sixteen_bit_png_is_scaled_not_clipped() -> None:
    import numpy as np
    from PIL import Image

    levels = (np.arange(48 * 40).reshape(48, 40) * 27).astype(np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(levels).save(buffer, "PNG")
    tensor = decode_tensor(buffer.getvalue())
    expected = np.rint(levels / 257.0).astype(np.uint8)
    assert np.array_equal(tensor[0].numpy(), expected)


def test_shrinking_neither_hides_a_short_png_nor_whitens_sixteen_bits() -> None:
    import numpy as np
    from PIL import Image

    from ddpkit.data.images import prepare_image

    data, reason = prepare_image(short_png(rows=10, height=96, width=80), "header", 32, 90)
    assert data is None
    assert "truncated" in reason
    buffer = io.BytesIO()
    Image.fromarray(np.full((96, 80), 32768, dtype=np.uint16)).save(buffer, "PNG")
    shrunk, reason = prepare_image(buffer.getvalue(), "header", 32, 90)
    assert reason == ""
    assert shrunk is not None
    mean = float(decode_tensor(shrunk).float().mean())
    assert abs(mean - 128) < 3  # 32768 / 257, as decode_tensor of the original gives


def _huge_reasons(rank: int, world_size: int) -> dict[str, list[str]]:
    """What each path says of each huge header, in a child whose memory is capped."""
    _cap_memory()
    out = {}
    for name, data in huge_headers().items():
        checked = [check_image(data, "header") or "", check_image(data, "decode") or ""]
        out[name] = checked + decoders_say(data)
    return out


def test_every_huge_size_field_is_refused_from_the_header_on_every_path() -> None:
    reasons = run_distributed(_huge_reasons, 1, init=None, timeout=240)[0]
    assert len(reasons) == 23
    for name, said in reasons.items():
        for reason in said:
            assert "ImageTooLargeError: its header says" in reason, (name, reason)
            assert "over the limit of 178,956,970" in reason, (name, reason)
            assert "max_pixels=" in reason
            assert "--max-pixels" in reason
    assert "65000x65000 = 4,225,000,000 pixels" in reasons["JPEG-both"][3]


def _limits(rank: int, world_size: int) -> dict[str, bool]:
    """Which decodes of a 48x40 image (1,920 pixels) succeed at which limits."""
    out = {}
    for fmt in FORMATS:
        data = encode(photo(3, (48, 40)).convert("RGB"), fmt)
        for label, limit in (("below", 1919), ("at", 1920)):
            for decode in (decode_tensor, decode_pil):
                try:
                    decode(data, max_pixels=limit)
                    out[f"{fmt}-{label}-{decode.__name__}"] = True
                except ImageTooLargeError:
                    out[f"{fmt}-{label}-{decode.__name__}"] = False
            out[f"{fmt}-{label}-check"] = check_image(data, "decode", max_pixels=limit) is None
        Image.MAX_IMAGE_PIXELS = 500  # Pillow's own limit is 1,000 pixels now
        out[f"{fmt}-pillow-default"] = check_image(data, "header") is None
        out[f"{fmt}-pillow-raised"] = check_image(data, "decode", max_pixels=5000) is None
        Image.MAX_IMAGE_PIXELS = 89_478_485
    return out


def test_the_limit_is_one_setting_for_every_path_and_can_be_raised_past_pillows() -> None:
    results = run_distributed(_limits, 1, init=None, timeout=240)[0]
    for fmt in FORMATS:
        for path in ("decode_tensor", "decode_pil", "check"):
            assert results[f"{fmt}-below-{path}"] is False, (fmt, path)
            assert results[f"{fmt}-at-{path}"] is True, (fmt, path)
        assert results[f"{fmt}-pillow-default"] is False, fmt  # the default follows Pillow's
        # max_pixels overrides it, but where Pillow's TIFF reader checks again itself.
        assert results[f"{fmt}-pillow-raised"] is (fmt != "TIFF"), fmt


def _dataset_errors(rank: int, world_size: int, db: str, max_pixels: int | None) -> list[str]:
    _cap_memory()
    errors = []
    for decode in ("tensor", "pil"):
        dataset = LazyLMDBDataset(db, decode=decode, max_pixels=max_pixels)  # type: ignore[arg-type]
        for i in range(len(dataset)):
            try:
                dataset[i]
            except LMDBFormatError as exc:
                errors.append(str(exc))
    return errors


def _tree_with(tmp_path: Path, name: str, data: bytes) -> Path:
    root = tmp_path / "imgs"
    for k in range(2):
        (root / f"c{k}").mkdir(parents=True)
        (root / f"c{k}" / "0.jpg").write_bytes(encode(photo(k, (40, 48)).convert("RGB")))
    (root / "c1" / name).write_bytes(data)
    return root


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("huge", "its header says 65000x65000 = 4,225,000,000 pixels, over the limit"),
        ("tall", "JPEG data end before the image does: its header says 64x4096"),
    ],
)
def test_build_verify_and_the_dataset_name_the_bad_jpeg(
    tmp_path: Path, case: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = encode(photo(1, (64, 64)).convert("RGB"))
    data = _set_jpeg(good, 65000, 65000) if case == "huge" else _set_jpeg(good, 4096, None)
    root = _tree_with(tmp_path, "bad.jpg", data)
    for check in ("decode", "header") if case == "huge" else ("decode",):
        summary = build_lmdb(
            root, tmp_path / f"db-{check}", check=check, on_error="skip", progress=False
        )
        assert [(Path(p).name, said in r) for p, r in summary.skipped] == [("bad.jpg", True)]
    from ddpkit.cli import main

    assert main(["lmdb", "build", str(root), str(tmp_path / "x"), "--check", "decode"]) == 1
    assert said in capsys.readouterr().err
    build_lmdb(root, tmp_path / "raw", check="none", progress=False)
    report = verify_report(tmp_path / "raw")
    assert [(b.path, said in b.reason) for b in report.bad] == [("c1/bad.jpg", True)]
    assert main(["lmdb", "verify", str(tmp_path / "raw")]) == 1
    assert said in capsys.readouterr().out
    errors = run_distributed(
        _dataset_errors, 1, args=(str(tmp_path / "raw"), None), init=None, timeout=240
    )[0]
    assert len(errors) == 2
    assert all(said in e and "built from c1/bad.jpg" in e for e in errors)


def test_a_raised_limit_is_honoured_by_build_verify_and_the_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _tree_with(tmp_path, "big.jpg", encode(photo(1, (64, 64)).convert("RGB")))
    summary = build_lmdb(
        root, tmp_path / "db", check="decode", on_error="skip", max_pixels=4000, progress=False
    )
    assert [Path(p).name for p, _ in summary.skipped] == ["big.jpg"]  # 4,096 pixels
    assert "over the limit of 4,000" in summary.skipped[0][1]
    build_lmdb(root, tmp_path / "raw", check="none", progress=False)
    assert len(verify_report(tmp_path / "raw", max_pixels=4000).bad) == 1
    assert verify_report(tmp_path / "raw", max_pixels=4096).ok
    from ddpkit.cli import main

    assert main(["lmdb", "verify", str(tmp_path / "raw"), "--max-pixels", "4000"]) == 1
    assert "over the limit of 4,000" in capsys.readouterr().out
    assert main(["lmdb", "verify", str(tmp_path / "raw"), "--max-pixels", "4096"]) == 0
    errors = run_distributed(
        _dataset_errors, 1, args=(str(tmp_path / "raw"), 4000), init=None, timeout=240
    )[0]
    assert len(errors) == 2
    assert "over the limit of 4,000" in errors[0]
    with pytest.raises(ValueError, match="max_pixels must be at least 1"):
        LazyLMDBDataset(tmp_path / "raw", max_pixels=0)


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes((0xFF, marker)) + struct.pack(">H", len(payload) + 2) + payload


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


XMP = b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta xmlns:x='adobe:ns:meta/'/>"
# APP1 (and other) segments in the orders cameras and editors write them: TorchCodec
# reads the orientation of the first APP1 only, Pillow's info["exif"] the first EXIF.
APP1_ORDERS: dict[str, Any] = {
    "exif": lambda o: [_segment(0xE1, _exif(o))],
    "xmp-exif": lambda o: [_segment(0xE1, XMP), _segment(0xE1, _exif(o))],
    "exif-xmp": lambda o: [_segment(0xE1, _exif(o)), _segment(0xE1, XMP)],
    "exif1-exif": lambda o: [_segment(0xE1, _exif(1)), _segment(0xE1, _exif(o))],
    "exif-exif1": lambda o: [_segment(0xE1, _exif(o)), _segment(0xE1, _exif(1))],
    "icc-exif": lambda o: [_segment(0xE2, b"ICC_PROFILE\x00\x01\x01"), _segment(0xE1, _exif(o))],
    "comment-exif": lambda o: [_segment(0xFE, b"made by hand"), _segment(0xE1, _exif(o))],
    "fill-exif": lambda o: [b"\xff\xff" + _segment(0xE1, _exif(o))[1:]],  # fill bytes first
    "bare-tiff": lambda o: [_segment(0xE1, _exif(o)[6:])],  # no Exif identifier
}


def app1_orders(base: Image.Image) -> dict[str, bytes]:
    """``base`` as one JPEG, with each order of :data:`APP1_ORDERS` inserted after SOI
    for every orientation: the compressed data, so the stored pixels, are the same."""
    plain = encode(base, "JPEG", quality=90)
    return {
        f"app1-{order}-{o}": plain[:2] + b"".join(segments(o)) + plain[2:]
        for order, segments in APP1_ORDERS.items()
        for o in range(1, 9)
    } | {"app1-none": plain}


def decoder_corpus() -> dict[str, bytes]:
    """The damaged corpus, with what TorchCodec reads differently from torchvision:
    every EXIF orientation, APP1 segments in every order, animated WebP, CMYK, gray, alpha."""
    cases = corpus()
    base = photo(0, (96, 72)).convert("RGB")
    cases.update(app1_orders(base))
    for orientation in range(10):  # 0 and 9 are not orientations: ignored
        exif = Image.Exif()
        exif[0x0112] = orientation
        cases[f"exif{orientation}-jpeg"] = encode(base, "JPEG", exif=exif.tobytes())
        cases[f"exif{orientation}-webp"] = encode(base, "WEBP", exif=exif.tobytes())
    frames = [photo(1, (96, 72)).convert("RGB")]
    for extra in ({"lossless": True}, {}):
        name = f"animated-WEBP-{'lossless' if extra else 'lossy'}"
        cases[name] = encode(base, "WEBP", save_all=True, append_images=frames, **extra)
    cases["cmyk-jpeg"] = encode(base.convert("CMYK"), "JPEG")
    cases["gray-jpeg"] = encode(base.convert("L"), "JPEG")
    cases["rgba-webp"] = encode(base.convert("RGBA"), "WEBP")
    return cases


def _by_library(rank: int, world_size: int) -> dict[str, dict[str, object]]:
    """Each case's decode_tensor result (pixels or error type) with TorchCodec, then with
    torchvision.io deciding, as ddpkit did before TorchCodec (both must load here)."""
    import warnings

    from ddpkit.data import images

    # Only JPEG and WebP reach the library; Pillow decodes the rest on either.
    cases = {n: d for n, d in decoder_corpus().items() if images._kind(d) in ("jpeg", "webp")}
    out: dict[str, dict[str, object]] = {}
    for library in ("torchcodec", "torchvision"):
        decoders = images._load_decoders(library)
        assert decoders is not None, library
        images.tensor_decoders = lambda library=library, d=decoders: (library, d)
        results: dict[str, object] = {}
        for name, data in cases.items():
            with warnings.catch_warnings():  # torchvision's: deprecated, called on purpose
                warnings.simplefilter("ignore", DeprecationWarning)
                try:
                    results[name] = decode_tensor(data)
                except Exception as exc:
                    results[name] = type(exc).__name__
        out[library] = results
    return out


def test_torchcodec_decodes_every_image_as_torchvision_did(
    corpus_results: dict[str, Any],
) -> None:
    import torch

    new, old = (
        corpus_results["by_library"]["torchcodec"],
        corpus_results["by_library"]["torchvision"],
    )
    assert new.keys() == old.keys()
    for name in new:
        if isinstance(old[name], torch.Tensor):
            assert isinstance(new[name], torch.Tensor), (name, new[name])
            assert torch.equal(new[name], old[name]), name
        else:
            assert new[name] == old[name], name  # the same error, named alike
    for orientation in range(10):  # stored pixels, as decode_pil and ImageFolder see them
        assert new[f"exif{orientation}-jpeg"].shape == (3, 72, 96), orientation
        assert torch.equal(new[f"exif{orientation}-webp"], new["exif1-webp"]), orientation


def test_every_app1_segment_order_decodes_to_the_stored_pixels(
    corpus_results: dict[str, Any],
) -> None:
    # The same compressed data under any APP1 segments: the same pixels from every
    # decoder, whichever segment holds the orientation and whatever precedes it.
    import torch

    new = corpus_results["by_library"]["torchcodec"]
    stored = new["app1-none"]
    assert isinstance(stored, torch.Tensor)
    assert stored.shape == (3, 72, 96)
    names = [n for n in new if n.startswith("app1-") and n != "app1-none"]
    assert len(names) == 8 * len(APP1_ORDERS)
    for name in names:
        assert isinstance(new[name], torch.Tensor), (name, new[name])
        assert torch.equal(new[name], stored), name
    assert "app1-xmp-exif-3" in names  # the order TorchCodec alone left unrotated
    assert new["animated-WEBP-lossless"].shape == (3, 72, 96)
