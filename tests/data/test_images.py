"""ddpkit.data.images: the one decoder, and the checker that runs exactly that decoder."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from lmdb_fixtures import decoders_say, encode, photo, varied_images
from PIL import Image

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


def _with_exif(data: bytes, orientation: int) -> bytes:
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    payload = exif.tobytes()
    return data[:2] + b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload + data[2:]


def test_an_ordinary_jpeg_decodes_without_pillow_reading_its_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pillow's header parse cost a sixth of a photo: the markers are walked instead.
    from ddpkit.data import images

    def no_pillow(raw: object) -> None:
        raise AssertionError("Pillow read the header of an ordinary JPEG")

    jpeg = encode(photo(3), quality=90)
    expected = decode_tensor(jpeg)
    monkeypatch.setattr(images, "_open", no_pillow)
    assert torch.equal(decode_tensor(jpeg), expected)
    assert torch.equal(decode_tensor(_with_exif(jpeg, 6)), expected)  # the stored pixels
    with pytest.raises(images.ImageTooLargeError, match="over the limit of 100"):
        decode_tensor(jpeg, max_pixels=100)  # the size from the frame header


@pytest.mark.parametrize("orientation", [1, 2, 3, 6, 8])
def test_the_callers_bytes_are_never_changed(orientation: int) -> None:
    data = bytearray(_with_exif(encode(photo(3), quality=90), orientation))
    before = bytes(data)
    decode_tensor(data)
    assert data == before
    assert check_image(data, "decode") is None
    assert data == before


def _unusual_headers() -> list[bytes]:
    jpeg = encode(photo(3, (40, 30)), quality=90)
    frame = jpeg.index(b"\xff\xc0")
    length = int.from_bytes(jpeg[frame + 2 : frame + 4], "big")
    twice = (
        jpeg[: frame + 2 + length] + jpeg[frame : frame + 2 + length] + jpeg[frame + 2 + length :]
    )
    no_height = bytearray(jpeg)
    no_height[frame + 5 : frame + 7] = b"\x00\x00"  # the height a DNL marker would give
    twelve_bit = bytearray(jpeg)
    twelve_bit[frame + 4] = 12
    return [twice, bytes(no_height), bytes(twelve_bit), jpeg[: frame + 6]]


def _unusual_verdicts(rank: int, world_size: int) -> list[tuple[bool, bool]]:
    out = []
    for data in _unusual_headers():
        try:
            decode_tensor(data)
            decoded = True
        except Exception:
            decoded = False
        out.append((check_image(data, "decode") is None, decoded))
    return out


def test_unusual_jpeg_headers_are_read_by_pillow() -> None:
    from ddpkit.data import images

    assert images._jpeg_header(encode(photo(3, (40, 30))))[0] == (40, 30)
    for unusual in _unusual_headers():
        assert images._jpeg_header(unusual)[0] is None
    # Each still gets a verdict (in a child: a decoder may crash), the checker's.
    verdicts = run_distributed(_unusual_verdicts, 1, init=None, timeout=120)[0]
    assert len(verdicts) == 4
    for checked, decoded in verdicts:
        assert checked == decoded


def _cut_short(rank: int, world_size: int) -> dict[str, object]:
    """Verdicts on JPEGs cut a few bytes short, an end marker kept (in a child: damaged data)."""
    from ddpkit.data.images import check_image

    pixels = np.full((64, 64, 3), 200, np.uint8)
    pixels[:48] = np.random.default_rng(0).integers(0, 255, (48, 64, 3))
    pixels[48:, 48:] = (220, 30, 30)  # a flat corner, not the gray of whole missing MCUs
    whole = encode(Image.fromarray(pixels), quality=90)
    out: dict[str, object] = {}
    for cut in (1, 2, 3, 4):
        # The data end inside the last MCU: libjpeg decodes its rest from zero bits,
        # here a block flat in the colour before it.
        short = whole[: -2 - cut] + b"\xff\xd9"
        out[f"cut-{cut}"] = [check_image(short, "decode"), *decoders_say(short), _first_read(short)]
    return out


def _first_read(data: bytes) -> str | None:
    """What decode_tensor_known says of bytes read the first time (None: decoded)."""
    from ddpkit.data.images import decode_tensor_known

    try:
        decode_tensor_known(bytearray(data), 0)
    except Exception as exc:
        return str(exc)
    return None


def test_data_that_end_inside_the_last_mcu_are_refused() -> None:
    # The corner is flat then, in a colour of the image: any flat corner is checked.
    out = run_distributed(_cut_short, 1, init=None, timeout=120)[0]
    assert len(out) == 4
    for name, verdicts in out.items():
        assert len(verdicts) == 4, name  # check_image, decode_tensor, decode_pil, first read
        for verdict in verdicts:
            assert verdict is not None, name
            assert "JPEG data end before the image does" in verdict, name


def _flat_jpeg(colour: int, **kwargs: object) -> bytes:
    pixels = np.array(photo(7, (64, 48)).convert("RGB"))
    pixels[-32:, -32:] = colour  # whole MCUs of one colour: decoded flat
    return encode(Image.fromarray(pixels), quality=95, **kwargs)


@pytest.mark.parametrize(
    ("colour", "kwargs"),
    [(0, {}), (255, {}), (128, {}), (30, {"subsampling": 0}), (0, {"progressive": True})],
)
def test_a_whole_photo_with_a_flat_corner_is_checked_with_one_decode_more(
    monkeypatch: pytest.MonkeyPatch, colour: int, kwargs: dict[str, object]
) -> None:
    # A black border, a white background: the check decodes only the probed copy and
    # compares it with the pixels the caller already has (before: both, again).
    from ddpkit.data import images

    jpeg = _flat_jpeg(colour, **kwargs)
    decodes: list[int] = []
    real = images._pillow_pixels
    monkeypatch.setattr(images, "_pillow_pixels", lambda data: decodes.append(1) or real(data))
    tensor = decode_tensor(jpeg)
    assert images._uniform_corner(tensor.numpy())  # the corner is flat: checked
    assert decodes == [1]
    pil = decode_pil(jpeg)
    assert decodes == [1, 1]
    assert torch.equal(tensor, torch.from_numpy(np.array(pil)).permute(2, 0, 1))
    images.check_jpeg_data(jpeg)  # without the pixels: both decoded, as before
    assert decodes == [1, 1, 1, 1]


def test_a_photo_whose_last_row_ends_flat_is_still_checked_whole() -> None:
    # The last row ending in one colour is common (a sky, a black border): the test then
    # looks at the whole corner, and a short file there is still an error.
    from ddpkit.data import images

    pixels = np.array(photo(5, (64, 48)))
    pixels[-8:, -16:] = 30  # a flat corner: libjpeg's padding looks like this
    jpeg = encode(Image.fromarray(pixels), quality=95, subsampling=0)
    whole = decode_tensor(jpeg)
    assert images._uniform_corner(whole.numpy())  # a whole file with a flat corner: decoded
    assert torch.equal(
        whole, torch.from_numpy(np.array(Image.open(io.BytesIO(jpeg)))).permute(2, 0, 1)
    )
    with pytest.raises((ValueError, OSError), match="truncated"):
        decode_tensor(jpeg[: len(jpeg) * 2 // 3])


def test_what_a_first_decode_found_is_not_looked_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A record's header walk and its check for a short end happen on its first read;
    # later reads, given what that found, only decode (and check the size they get).
    from ddpkit.data import images
    from ddpkit.data.images import decode_tensor_known

    jpeg = bytearray(_flat_jpeg(0))  # a flat corner: the first read checks the data too
    expected = decode_tensor(jpeg)
    image, known = decode_tensor_known(jpeg, 0)
    assert torch.equal(image, expected)
    assert known == (64 << 16 | 48)  # width, height

    def looked(*args: object, **kwargs: object) -> None:
        raise AssertionError("looked for again")

    monkeypatch.setattr(images, "_jpeg_header", looked)
    monkeypatch.setattr(images, "check_jpeg_data", looked)
    monkeypatch.setattr(images, "_uniform_corner", looked)
    again, known_again = decode_tensor_known(jpeg, known)
    assert torch.equal(again, expected)
    assert known_again == known
    with pytest.raises(AssertionError, match="looked for again"):
        decode_tensor_known(jpeg, 0)  # without it: the whole way


def test_only_a_plain_whole_jpeg_is_remembered() -> None:
    from ddpkit.data.images import decode_tensor_known

    jpeg = encode(photo(3), quality=90)
    oriented = _with_exif(jpeg, 3)  # an APP1 segment: looked at each read
    for data in (oriented, *varied_images()[3:]):  # that, PNG, WebP, BMP ...
        image, known = decode_tensor_known(bytearray(data), 0)
        assert known == 0
        assert torch.equal(image, decode_tensor(data))
    image, known = decode_tensor_known(bytes(jpeg), 0)  # not a bytearray: copied, the same
    assert known == (96 << 16 | 72)
    assert torch.equal(image, decode_tensor(jpeg))


def test_a_remembered_size_still_meets_the_pixel_limit_and_the_decoder() -> None:
    from ddpkit.data.images import ImageTooLargeError, decode_tensor_known

    jpeg = bytearray(encode(photo(3), quality=90))
    _, known = decode_tensor_known(jpeg, 0)
    with pytest.raises(ImageTooLargeError, match="96x72"):  # a limit lowered since
        decode_tensor_known(jpeg, known, max_pixels=96 * 72 - 1)
    # Not what the decoder gives (never for the same bytes): the whole way, and the truth.
    image, found = decode_tensor_known(jpeg, 10 << 16 | 10)
    assert torch.equal(image, decode_tensor(jpeg))
    assert found == known
    image, found = decode_tensor_known(bytearray(varied_images()[3]), known)  # a PNG
    assert found == 0
    assert torch.equal(image, decode_tensor(varied_images()[3]))


def test_images_decode_through_torchcodecs_public_functions_only() -> None:
    # No private operator and no reads of tensor memory at computed addresses: the decoders
    # are TorchCodec's own functions, and the corner check reads a NumPy view.
    pytest.importorskip("torchcodec")
    import inspect

    from torchcodec.decoders import decode_jpeg

    from ddpkit.data import images

    source = inspect.getsource(images)
    assert "torch.ops" not in source
    assert "ctypes" not in source
    library, decoders = images.tensor_decoders()
    assert library == "torchcodec"
    assert decoders["jpeg"].func is decode_jpeg  # type: ignore[attr-defined]
    jpeg = bytearray(encode(photo(3), quality=90))
    assert torch.equal(decode_tensor(jpeg), decode_jpeg(torch.frombuffer(jpeg, dtype=torch.uint8)))
