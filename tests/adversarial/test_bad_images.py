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

import pytest
from lmdb_fixtures import encode, photo
from torch.utils.data import DataLoader

from ddpkit.data import LazyLMDBDataset, LMDBFormatError, build_lmdb, verify_report
from ddpkit.data.images import check_image, decode_pil, decode_tensor
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
    cases["png-interlaced-whole"] = encode(photo(9, (33, 21)), "PNG", interlace=1)
    cases["empty"] = b""
    cases["text"] = b"definitely not an image"
    return cases


def _verdicts(rank: int, world_size: int) -> dict[str, tuple[bool, bool, bool]]:
    """(checker ok, tensor decode ok, PIL decode ok) per case; a crash fails the caller."""
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


def test_no_damaged_image_crashes_a_decoder_and_all_three_agree() -> None:
    verdicts = run_distributed(_verdicts, 1, init=None, timeout=240)[0]
    for name, (checked, tensor, _) in verdicts.items():
        assert checked == tensor, name  # verify says ok exactly when the dataset can decode
    for fmt in FORMATS:
        assert verdicts[f"{fmt}-whole"] == (True, True, True), fmt
        assert verdicts[f"{fmt}-cut0.3"][0] is False, fmt
    assert verdicts["png-short-rows"] == (False, False, False)
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
