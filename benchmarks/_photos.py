"""Shared by the benchmarks: a tree of real-photograph JPEGs, and the folder2lmdb-style database.

The images are crops of scikit-learn's two sample photographs (china and
flower, 427x640), rescaled and cropped to ImageNet-like sizes, so JPEG
decoding costs what it costs on real photos rather than on flat synthetic
patterns. Everything is derived from a seed: the same arguments always give
the same files.

The "seed" database is the layout of the folder2lmdb.py script that the
classic multi-node ImageNet recipe copies: one ``pickle.dumps((raw_bytes,
label))`` per sample under the ASCII key ``"0"``, ``"1"`` ..., plus pickled
``__keys__`` and ``__len__`` records. The script used ``pyarrow.serialize``,
which pyarrow has removed; pickle stands in for it.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
from pathlib import Path

import lmdb
import numpy as np
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

OUT = Path(__file__).resolve().parent / "out"


def photo_tree(n: int = 2000, classes: int = 10, *, seed: int = 0) -> Path:
    """An ImageFolder tree of ``n`` JPEGs over ``classes`` classes under ``benchmarks/out/``.

    Kept between runs: a tree that already holds ``n`` images in ``classes``
    class directories is reused as it is.
    """
    root = OUT / f"photos-{n}-{classes}-seed{seed}"
    if root.is_dir() and _count(root) == (classes, n):
        return root
    from sklearn.datasets import load_sample_images

    sources = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(seed)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for k in range(classes):
        (tmp / f"class_{k:03d}").mkdir(parents=True)
    for i in range(n):
        image = _random_photo(sources[int(rng.integers(len(sources)))], rng)
        path = tmp / f"class_{i % classes:03d}" / f"img_{i:06d}.jpg"
        image.save(path, "JPEG", quality=int(rng.integers(85, 96)))
    shutil.rmtree(root, ignore_errors=True)
    os.rename(tmp, root)
    return root


def _count(root: Path) -> tuple[int, int]:
    dirs = [d for d in root.iterdir() if d.is_dir()]
    return len(dirs), sum(len(list(d.glob("*.jpg"))) for d in dirs)


def _random_photo(src: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A crop with the shorter side 300..427 px, aspect 3:4..4:3, 80 % landscape."""
    aspect = math.exp(rng.uniform(0.0, math.log(4 / 3)))
    if rng.random() < 0.2:
        aspect = 1 / aspect
    short = rng.uniform(300, 427)
    w, h = (short * aspect, short) if aspect >= 1 else (short, short / aspect)
    # The smallest rescale of the 640x427 source that still holds the crop;
    # crops too big for the source at full size shrink to fit it.
    need = max(w / src.width, h / src.height)
    if need > 1:
        w, h, need = w / need, h / need, 1.0
    scale = rng.uniform(max(0.6, need), 1.0)
    sw, sh = (
        max(round(src.width * scale), math.ceil(w)),
        max(round(src.height * scale), math.ceil(h)),
    )
    scaled = src.resize((sw, sh), Image.Resampling.BICUBIC)
    w, h = int(w), int(h)
    x, y = int(rng.integers(0, sw - w + 1)), int(rng.integers(0, sh - h + 1))
    crop = scaled.crop((x, y, x + w, y + h))
    return crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop


# -- the folder2lmdb.py build, as the recipe has it ------------------------------------


def raw_reader(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _as_list(batch: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
    return batch  # the recipe's collate_fn=lambda x: x


def folder2lmdb(tree: str | os.PathLike[str], outpath: str, *, workers: int = 2) -> int:
    """Write ``tree`` as folder2lmdb.py does; returns the number of samples.

    As in the recipe: an ImageFolder whose loader returns the file's bytes, a
    DataLoader (batch size 1) to read them in ``workers`` processes, one
    pickled ``(bytes, label)`` per ASCII key, a commit every 5000 samples, and
    the pickled key list and length at the end. ``outpath`` does not exist
    beforehand, so LMDB writes a single file (``subdir=False``) as the recipe does.
    """
    write_frequency = 5000
    dataset = ImageFolder(os.fspath(tree), loader=raw_reader)
    data_loader = DataLoader(dataset, num_workers=workers, collate_fn=_as_list)
    db = lmdb.open(
        outpath,
        subdir=os.path.isdir(outpath),
        map_size=1099511627776 * 2,
        readonly=False,
        meminit=False,
        map_async=True,
    )
    txn = db.begin(write=True)
    idx = -1
    for idx, data in enumerate(data_loader):
        image, label = data[0]
        txn.put("{}".format(idx).encode("ascii"), pickle.dumps((image, label)))  # noqa: UP032
        if idx % write_frequency == 0:
            txn.commit()
            txn = db.begin(write=True)
    txn.commit()
    keys = ["{}".format(k).encode("ascii") for k in range(idx + 1)]  # noqa: UP032
    with db.begin(write=True) as txn:
        txn.put(b"__keys__", pickle.dumps(keys))
        txn.put(b"__len__", pickle.dumps(len(keys)))
    db.sync()
    db.close()
    return len(keys)


def remove_db(path: str | os.PathLike[str]) -> None:
    """Remove a database: a directory, or a single file and its ``-lock`` file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        shutil.rmtree(path)
    for p in (path, path + "-lock"):
        if os.path.isfile(p):
            os.remove(p)
