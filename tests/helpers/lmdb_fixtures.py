"""Small real images and databases written with the format primitives, for the data tests."""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from pathlib import Path

import lmdb
import numpy as np
from PIL import Image

from ddpkit.data.lmdb_index import INDEX_KEY, encode_index, sample_key


def photo(seed: int, size: tuple[int, int] = (96, 72)) -> Image.Image:
    """A crop of one of scikit-learn's sample photographs (real image statistics)."""
    from sklearn.datasets import load_sample_images

    images = load_sample_images().images
    rng = np.random.default_rng(seed)
    src = images[seed % len(images)]
    w, h = size
    y = int(rng.integers(0, src.shape[0] - h))
    x = int(rng.integers(0, src.shape[1] - w))
    return Image.fromarray(src[y : y + h, x : x + w])


def encode(image: Image.Image, fmt: str = "JPEG", **kwargs: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def decoders_say(data: bytes) -> list[str]:
    """``"decoded"`` or ``"<Error>: <message>"`` from ``decode_tensor`` and ``decode_pil``, in turn.

    Damaged data can crash a decoder: call this in a child process.
    """
    from ddpkit.data.images import decode_pil, decode_tensor

    said = []
    for decode in (decode_tensor, decode_pil):
        try:
            decode(data)
            said.append("decoded")
        except Exception as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    return said


def varied_images() -> list[bytes]:
    """RGB JPEG, grayscale JPEG, CMYK JPEG, RGBA PNG, palette PNG, WebP, BMP."""
    base = photo(0)
    return [
        encode(base, quality=90),
        encode(base.convert("L")),
        encode(base.convert("CMYK")),
        encode(base.convert("RGBA"), "PNG"),
        encode(base.convert("P"), "PNG"),
        encode(base, "WEBP"),
        encode(base, "BMP"),
    ]


def write_db(
    path: Path,
    images: Sequence[bytes],
    labels: Sequence[int],
    classes: Sequence[str],
    *,
    index: bytes | None = None,
) -> Path:
    """A ddpkit LMDB written directly with the format primitives (no builder)."""
    env = lmdb.open(str(path), map_size=64 << 20)
    with env.begin(write=True) as txn:
        for i, data in enumerate(images):
            txn.put(sample_key(i), data, append=True)
        txn.put(INDEX_KEY, index if index is not None else encode_index(labels, classes))
    env.close()
    return path


def write_legacy_db(path: Path, images: Sequence[bytes], labels: Sequence[int]) -> Path:
    """The layout of the widely copied folder2lmdb.py, with pickle as its dumps()."""
    env = lmdb.open(str(path), map_size=64 << 20)
    keys = [f"{i}".encode("ascii") for i in range(len(images))]
    with env.begin(write=True) as txn:
        for key, data, label in zip(keys, images, labels, strict=True):
            txn.put(key, pickle.dumps((data, label)))
        txn.put(b"__keys__", pickle.dumps(keys))
        txn.put(b"__len__", pickle.dumps(len(keys)))
    env.close()
    return path
