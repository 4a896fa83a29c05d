"""ddpkit.data.images: the one decoder, and the checker that runs exactly that decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lmdb_fixtures import encode, photo, varied_images

from ddpkit.data.images import check_image, decode_pil, decode_tensor, prepare_image
from ddpkit.testing import run_distributed


def _good_and_bad() -> dict[str, bytes]:
    jpeg = encode(photo(3))
    cases = {f"varied{i}": data for i, data in enumerate(varied_images())}
    cases.update(
        {
            "tiff": encode(photo(4), "TIFF"),
            "gif": encode(photo(5).convert("P"), "GIF"),
            "jpeg-cut-in-half": jpeg[: len(jpeg) // 2],
            "jpeg-header-only": jpeg[:20],
            "text": b"not an image at all",
            "one-byte": b"\xff",
        }
    )
    return cases


def _verdicts(rank: int, world_size: int) -> dict[str, tuple[bool, bool, str | None]]:
    """(checker says ok, decoder succeeds, reason) per case, in a child: a decoder may crash."""
    out = {}
    for name, data in _good_and_bad().items():
        try:
            decode_tensor(data)
            decoded = True
        except Exception:
            decoded = False
        reason = check_image(data, "decode")
        out[name] = (reason is None, decoded, reason)
    return out


def test_the_checker_agrees_with_the_decoder() -> None:
    verdicts = run_distributed(_verdicts, 1, init=None, timeout=120)[0]
    for name, (ok, decoded, reason) in verdicts.items():
        assert ok == decoded, (name, reason)
    good = {n for n, (ok, _, _) in verdicts.items() if ok}
    assert good == {*(f"varied{i}" for i in range(7)), "tiff", "gif"}


def test_tensor_and_pil_decodes_see_the_same_pixels() -> None:
    for data in varied_images()[3:5] + varied_images()[6:]:  # lossless: PNG (RGBA, P), BMP
        tensor = decode_tensor(data)
        pil = torch.from_numpy(np.array(decode_pil(data))).permute(2, 0, 1)
        assert tensor.dtype == torch.uint8
        assert tensor.shape[0] == 3
        assert torch.equal(tensor, pil)


def test_decode_tensor_takes_bytes_and_bytearray() -> None:
    data = encode(photo(1))
    assert torch.equal(decode_tensor(data), decode_tensor(bytearray(data)))


@pytest.mark.parametrize(
    ("data", "level", "reason"),
    [
        (None, "decode", "no record under its key"),
        (b"", "none", "empty (0 bytes)"),
        (b"garbage", "header", "not an image format PIL can identify"),
        (b"garbage", "none", None),  # "none" checks only that there are bytes
    ],
)
def test_check_levels(data: bytes | None, level: str, reason: str | None) -> None:
    found = check_image(data, level)  # type: ignore[arg-type]
    assert found == reason if reason is None else found is not None and reason in found


def test_prepare_image_shrinks_only_large_images() -> None:
    big, small = encode(photo(0, (96, 72))), encode(photo(1, (40, 30)))
    assert prepare_image(small, "header", 64, 90) == (small, "")
    shrunk, reason = prepare_image(big, "decode", 64, 90)
    assert reason == ""
    assert shrunk is not None
    assert decode_tensor(shrunk).shape == (3, 48, 64)
    assert prepare_image(b"junk", "decode", 64, 90)[0] is None


def test_torchcodec_decodes_where_it_loads_and_torchvision_only_with_an_older_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddpkit.data import images

    pytest.importorskip("torchcodec")
    assert images.tensor_decoders()[0] == "torchcodec"
    monkeypatch.setattr(torch, "__version__", "2.10.0")  # TorchCodec's images need 2.11+
    assert images._load_decoders("torchcodec") is None
    images.tensor_decoders.cache_clear()
    try:
        assert images.tensor_decoders()[0] == "torchvision"
    finally:
        images.tensor_decoders.cache_clear()
