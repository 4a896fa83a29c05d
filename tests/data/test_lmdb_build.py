"""build_lmdb on real image files: sources, checks, errors, interruption, overwrite."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from torchvision.datasets import ImageFolder

from ddpkit.data import (
    BuildSummary,
    ImageError,
    LazyLMDBDataset,
    build_lmdb,
)
from ddpkit.data.lmdb_format import open_env, read_index
from ddpkit.data.lmdb_index import LMDBFormatError, sample_key
from ddpkit.data.lmdb_sources import list_source


@cache
def _photos() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_sample_images

    return tuple(load_sample_images().images)


def _crop(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    photo = _photos()[seed % 2]
    rng = np.random.default_rng(seed)
    y = int(rng.integers(0, photo.shape[0] - height))
    x = int(rng.integers(0, photo.shape[1] - width))
    return Image.fromarray(photo[y : y + height, x : x + width])


def _save(image: Image.Image, path: Path, **kwargs: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **kwargs)
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """An ImageFolder tree: uneven classes, names whose case changes their order, mixed modes."""
    root = tmp_path / "tree"
    for i in range(3):
        _save(_crop(i), root / "Zebra" / f"z{i}.jpg", quality=90)
    for i in range(4):
        _save(_crop(10 + i), root / "apple" / f"a{i}.jpg", quality=85)
    _save(_crop(20).convert("RGBA"), root / "apple" / "alpha.png")
    _save(_crop(21).convert("L"), root / "bird" / "gray.jpg")
    _save(_crop(22), root / "bird" / "nested" / "b0.jpeg")
    (root / "bird" / "notes.txt").write_text("not an image: ImageFolder ignores it")
    return root


def _read_back(db: Path) -> tuple[list[int], tuple[str, ...], list[str], list[bytes]]:
    index = read_index(db, columns=("path",))
    env = open_env(db)
    try:
        with env.begin() as txn:
            images = [txn.get(sample_key(i)) for i in range(len(index))]
    finally:
        env.close()
    return index.labels.tolist(), index.classes, list(index.columns["path"]), images


def _leftovers(output: Path) -> list[str]:
    return sorted(p.name for p in output.parent.iterdir() if p.name.startswith(output.name))


@pytest.mark.parametrize("workers", [1, 2])
def test_imagefolder_round_trip_matches_torchvision(tree: Path, workers: int) -> None:
    summary = build_lmdb(tree, tree.parent / "db", workers=workers, progress=False)
    reference = ImageFolder(str(tree))
    labels, classes, paths, images = _read_back(tree.parent / "db")

    assert classes == tuple(reference.classes) == ("Zebra", "apple", "bird")
    assert {c: i for i, c in enumerate(classes)} == reference.class_to_idx
    assert labels == [label for _, label in reference.samples]
    assert paths == [Path(p).relative_to(tree).as_posix() for p, _ in reference.samples]
    assert images == [Path(p).read_bytes() for p, _ in reference.samples]
    assert summary.samples == len(reference) == 10
    assert summary.class_counts == (3, 5, 2)
    assert summary.bytes_written == sum(len(b) for b in images)
    assert summary.skipped == ()
    assert read_index(tree.parent / "db").metadata["source_format"] == "imagefolder"
    assert "wrote 10 samples in 3 classes" in summary.format()


def test_list_file_round_trip(tree: Path, tmp_path: Path) -> None:
    files = sorted(tree.rglob("*.jpg"))
    listing = tmp_path / "lists" / "train.txt"
    listing.parent.mkdir()
    lines = [
        "# path label",
        f"{files[0].relative_to(tree)},2",
        "",
        f"{files[1].relative_to(tree)} 0",
        f"{files[2]}\t1",  # absolute
        f"{files[3].relative_to(tree)}, 0",
    ]
    listing.write_text("\n".join(lines) + "\n")

    summary = build_lmdb(listing, tmp_path / "db", root=str(tree), progress=False)
    labels, classes, paths, images = _read_back(tmp_path / "db")
    assert labels == [2, 0, 1, 0]
    assert classes == ("0", "1", "2")
    assert paths == [
        str(files[0].relative_to(tree)),
        str(files[1].relative_to(tree)),
        str(files[2]),
        str(files[3].relative_to(tree)),
    ]
    assert images == [f.read_bytes() for f in files[:4]]
    assert summary.class_counts == (2, 1, 1)

    # Relative paths default to the list file's directory; classes may be named.
    beside = tree / "list.csv"
    beside.write_text(f"{files[1].relative_to(tree)},1\n{files[0].relative_to(tree)},0\n")
    build_lmdb(beside, tmp_path / "db2", classes=["cat", "dog"], progress=False)
    labels, classes, _, images = _read_back(tmp_path / "db2")
    assert (labels, classes) == ([1, 0], ("cat", "dog"))
    assert images == [files[1].read_bytes(), files[0].read_bytes()]


def test_list_file_with_class_names(tree: Path, tmp_path: Path) -> None:
    files = sorted(tree.rglob("*.jpg"))
    spaced = tree / "my photos" / "a, b.jpg"  # the label is the last field, whatever the path
    spaced.parent.mkdir()
    spaced.write_bytes(files[3].read_bytes())
    rows = [
        (spaced, "dog"),
        (files[0], "cat"),
        (files[1], "emu"),
        (files[2], "dog"),
    ]
    sep = [",", " ", "\t", ", "]
    listing = tree / "names.txt"
    lines = [f"{f.relative_to(tree)}{s}{name}" for (f, name), s in zip(rows, sep, strict=True)]
    listing.write_text("# path label\n" + "\n".join(lines) + "\n")

    build_lmdb(listing, tmp_path / "db", progress=False)
    _, _, paths, images = _read_back(tmp_path / "db")
    assert paths == ["my photos/a, b.jpg", *(str(f.relative_to(tree)) for f in files[:3])]
    assert images == [f.read_bytes() for f, _ in rows]
    dataset = LazyLMDBDataset(str(tmp_path / "db"))
    assert dataset.classes == ["cat", "dog", "emu"]  # sorted, as ImageFolder sorts
    assert dataset.targets == [1, 0, 2, 1]
    image, label = dataset[0]
    assert label == 1
    assert image.shape[0] == 3

    # classes= fixes the order (and may name classes the file does not use).
    build_lmdb(listing, tmp_path / "db2", classes=["emu", "dog", "cat", "fox"], progress=False)
    dataset = LazyLMDBDataset(str(tmp_path / "db2"))
    assert (dataset.classes, dataset.targets) == (["emu", "dog", "cat", "fox"], [1, 2, 0, 1])
    with pytest.raises(ValueError, match=r"line 3: class 'cat' is not one of the 2 classes given"):
        build_lmdb(listing, tmp_path / "db3", classes=["dog", "emu"], progress=False)


def test_list_file_reader_keeps_the_names_not_the_lines(tmp_path: Path) -> None:
    # Two reads of the file; between them only the distinct names are kept.
    listing = tmp_path / "big.txt"
    names = ("cat", "dog", "emu")
    listing.write_text("".join(f"dir/image-{i:06d}.jpg,{names[i % 3]}\n" for i in range(50_000)))
    tracemalloc.start()
    try:
        source = list_source(str(listing), None, None)
        labels = np.fromiter((sample.label for sample in source.samples), np.int64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (source.classes, source.total) == (names, 50_000)
    assert labels[:4].tolist() == [0, 1, 2, 0]
    assert peak < 1_500_000  # the lines alone would take over 4 MB


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("a.jpg", "line 2: expected 'path,label'"),
        ("a.jpg,-1", "line 2: label -1"),
        (
            "a.jpg,0\nb b.jpg,cat",
            r"line 3: 'b b.jpg,cat' has a class name, but line 2 \('a.jpg,0'\) has an integer "
            r"label; write every label as a class name or every label as an integer index",
        ),
        (
            "a.jpg cat\nb.jpg 1",
            r"line 3: 'b.jpg 1' has an integer label, but line 2 \('a.jpg cat'\)",
        ),
    ],
)
def test_list_file_errors_name_the_line(tmp_path: Path, line: str, match: str) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text(f"# header\n{line}\n")
    with pytest.raises(ValueError, match=match):
        build_lmdb(listing, tmp_path / "db", progress=False)
    assert not (tmp_path / "db").exists()


def _jpeg_bytes(seed: int) -> bytes:
    out = io.BytesIO()
    _crop(seed).save(out, format="JPEG", quality=80)
    return out.getvalue()


def test_parquet_binary_column_directory(tmp_path: Path) -> None:
    images = [_jpeg_bytes(i) for i in range(7)]
    names = ["dog", "cat", "dog", "emu", "cat", "dog", "cat"]
    source = tmp_path / "pq"
    source.mkdir()
    # Written out of name order: files are read sorted by name, each in small row groups.
    for name, rows in (("part-1.parquet", slice(4, 7)), ("part-0.parquet", slice(0, 4))):
        table = pa.table({"image": pa.array(images[rows], pa.binary()), "label": names[rows]})
        pq.write_table(table, source / name, row_group_size=2)

    summary = build_lmdb(source, tmp_path / "db", progress=False)
    labels, classes, paths, stored = _read_back(tmp_path / "db")
    assert classes == ("cat", "dog", "emu")
    assert [classes[k] for k in labels] == names
    assert stored == images
    assert paths[:2] == ["part-0.parquet#0", "part-0.parquet#1"]
    assert paths[4] == "part-1.parquet#0"
    assert summary.class_counts == (3, 3, 1)


def test_parquet_huggingface_image_struct(tmp_path: Path) -> None:
    images = [_jpeg_bytes(i) for i in range(3)]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    column = pa.array(
        [
            {"bytes": images[0], "path": "x.jpg"},
            {"bytes": images[1], "path": None},
            {"bytes": images[2], "path": "z.jpg"},
        ],
        type=struct,
    )
    pq.write_table(
        pa.table({"img": column, "y": pa.array([1, 0, 1], pa.int64())}), tmp_path / "train.parquet"
    )

    build_lmdb(
        tmp_path / "train.parquet",
        tmp_path / "db",
        image_column="img",
        label_column="y",
        progress=False,
    )
    labels, classes, paths, stored = _read_back(tmp_path / "db")
    assert (labels, classes, stored) == ([1, 0, 1], ("0", "1"), images)
    assert paths == ["x.jpg", "train.parquet#1", "z.jpg"]

    with pytest.raises(ValueError, match=r"no column\(s\) \['image'\]"):
        build_lmdb(tmp_path / "train.parquet", tmp_path / "db2", label_column="y")


def test_corrupt_image_fails_cleanly(tree: Path, tmp_path: Path) -> None:
    (tree / "apple" / "broken.jpg").write_bytes(os.urandom(2048))
    output = tmp_path / "db"
    with pytest.raises(ImageError, match=r"broken\.jpg: not an image format"):
        build_lmdb(tree, output, workers=2, progress=False)
    assert _leftovers(output) == []


def test_corrupt_image_skipped_keeps_labels_aligned(tree: Path, tmp_path: Path) -> None:
    broken = tree / "apple" / "broken.jpg"
    broken.write_bytes(os.urandom(2048))
    summary = build_lmdb(tree, tmp_path / "db", on_error="skip", progress=False)

    kept = [(p, y) for p, y in ImageFolder(str(tree)).samples if p != str(broken)]
    labels, _, _, images = _read_back(tmp_path / "db")
    assert [s[0] for s in summary.skipped] == [str(broken)]
    assert "not an image format" in summary.skipped[0][1]
    assert labels == [y for _, y in kept]
    assert images == [Path(p).read_bytes() for p, _ in kept]
    assert summary.samples == len(kept)
    assert "1 skipped" in summary.format()


def test_checks_header_decode_and_empty(tree: Path, tmp_path: Path) -> None:
    whole = (tree / "Zebra" / "z0.jpg").read_bytes()
    (tree / "Zebra" / "z0.jpg").write_bytes(whole[: len(whole) // 2])  # truncated: header intact
    build_lmdb(tree, tmp_path / "header", check="header", progress=False)
    with pytest.raises(ImageError, match=r"z0\.jpg: OSError: image file is truncated"):
        build_lmdb(tree, tmp_path / "decode", check="decode", progress=False)

    (tree / "Zebra" / "z0.jpg").write_bytes(b"")
    with pytest.raises(ImageError, match=r"z0\.jpg: empty"):
        build_lmdb(tree, tmp_path / "none", check="none", progress=False)
    assert _leftovers(tmp_path / "decode") == _leftovers(tmp_path / "none") == []


_BUILD_IN_CHILD = """
import signal, sys
# The SIGINT disposition the test needs, whatever this process inherited (a
# suite started with `&` from a script hands every child an ignored SIGINT).
ignored = sys.argv[3] == "ignored"
signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
from ddpkit.data.lmdb_build import build_lmdb
build_lmdb(sys.argv[1], sys.argv[2], workers=2, progress=False)
"""


@pytest.mark.parametrize(
    ("how", "sigint"),
    [(signal.SIGKILL, "default"), (signal.SIGINT, "default"), (signal.SIGINT, "ignored")],
    ids=["SIGKILL", "SIGINT", "SIGINT-ignored"],
)
def test_interrupted_build_leaves_no_database(
    tmp_path: Path, how: signal.Signals, sigint: str
) -> None:
    images = [_save(_crop(i), tmp_path / f"{i}.jpg") for i in range(4)]
    fifo = tmp_path / "stuck.jpg"
    os.mkfifo(fifo)
    # 1200 readable samples, then one whose read blocks until this test lets it go.
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{images[i % 4]},{i % 2}\n" for i in range(1200)) + f"{fifo},0\n")
    output = tmp_path / "db"
    child = subprocess.Popen(
        [sys.executable, "-c", _BUILD_IN_CHILD, str(listing), str(output), sigint],
        stderr=subprocess.PIPE,
    )
    writer: list[int] = []
    # Opening a FIFO for writing returns once the builder has opened it for reading.
    opener = threading.Thread(target=lambda: writer.append(os.open(fifo, os.O_WRONLY)))
    opener.daemon = True
    opener.start()
    opener.join(timeout=120)
    try:
        assert writer, f"the build never reached the FIFO: {child.poll()=}"
        child.send_signal(how)
        if sigint == "ignored":
            time.sleep(0.5)  # time for a SIGINT that was not ignored to stop the build
            os.write(writer[0], images[0].read_bytes())  # the last image, then end of file
    finally:
        for fd in writer:  # end of file for the blocked read, so a SIGINT can finish
            os.close(fd)
        _, stderr = child.communicate(timeout=120)

    temps = [p for p in tmp_path.iterdir() if p.name.startswith("db.tmp-")]
    if sigint == "ignored":
        # Left ignored, as Python leaves it: the build runs to the end.
        assert child.returncode == 0, stderr.decode()[-3000:]
        assert len(LazyLMDBDataset(str(output))) == 1201
        assert temps == []
        return
    assert child.returncode != 0
    assert not output.exists()
    if how == signal.SIGINT:
        assert b"KeyboardInterrupt" in stderr
        assert temps == []  # cleaned up on the way out
    else:
        # A killed build cannot clean up; what it leaves never opens as a database.
        assert len(temps) == 1
        with pytest.raises(LMDBFormatError, match="without a ddpkit index"):
            read_index(temps[0])


def test_map_grows_from_a_tiny_start(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    root = tmp_path / "noise"
    for i in range(14):  # incompressible PNGs, about 2 MB in all
        noise = rng.integers(0, 256, (200, 240, 3), dtype=np.uint8)
        _save(Image.fromarray(noise), root / f"c{i % 2}" / f"{i}.png")
    summary = build_lmdb(root, tmp_path / "db", map_size=64 * 1024, progress=False)
    reference = ImageFolder(str(root))
    labels, _, _, images = _read_back(tmp_path / "db")
    assert summary.bytes_written > 1_900_000
    assert images == [Path(p).read_bytes() for p, _ in reference.samples]
    assert labels == reference.targets


def test_overwrite(tree: Path, tmp_path: Path) -> None:
    output = tmp_path / "db"
    build_lmdb(tree, output, progress=False)
    before = _read_back(output)
    # A source that would fail at its first image: the refusal comes before any work.
    missing = tmp_path / "missing.txt"
    missing.write_text("nowhere.jpg,0\n")
    with pytest.raises(FileExistsError, match=r"db already exists; pass .*--overwrite"):
        build_lmdb(missing, output, progress=False)
    assert _read_back(output) == before

    summary = build_lmdb(tree, output, overwrite=True, max_side=32, progress=False)
    assert summary.samples == len(read_index(output)) == 10
    assert _read_back(output) != before
    assert _leftovers(output) == ["db"]

    not_a_db = tmp_path / "photos"
    not_a_db.mkdir()
    with pytest.raises(FileExistsError, match=r"without data\.mdb"):
        build_lmdb(tree, not_a_db, overwrite=True, progress=False)


def test_max_side_shrinks_only_large_images(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    large = _save(Image.fromarray(_photos()[0]).resize((1000, 700)), root / "a" / "large.jpg")
    _save(_crop(1, 400, 300).convert("RGBA"), root / "a" / "wide.png")
    small = _save(_crop(2, 200, 150), root / "b" / "small.jpg")
    build_lmdb(root, tmp_path / "db", max_side=256, quality=80, progress=False)
    _, _, paths, images = _read_back(tmp_path / "db")
    stored = dict(zip(paths, images, strict=True))

    with Image.open(io.BytesIO(stored["a/large.jpg"])) as image:
        assert (image.format, image.mode, image.size) == ("JPEG", "RGB", (256, 179))
    with Image.open(io.BytesIO(stored["a/wide.png"])) as image:
        assert (image.format, image.mode, image.size) == ("JPEG", "RGB", (256, 192))
    assert stored["b/small.jpg"] == small.read_bytes()
    assert large.stat().st_size > len(stored["a/large.jpg"])
    assert read_index(tmp_path / "db").metadata["max_side"] == "256"


def test_auto_detection_needs_a_recognisable_source(tmp_path: Path) -> None:
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match="neither class subdirectories nor"):
        build_lmdb(tmp_path / "flat", tmp_path / "db")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        build_lmdb(tmp_path / "nowhere", tmp_path / "db")


def test_images_per_second() -> None:
    summary = BuildSummary("db", 100, ("a",), (100,), 1000, 2.0)
    assert summary.images_per_second == 50.0
    assert "(50 img/s)" in summary.format()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"source_format": "zip"}, "source_format must be one of"),
        ({"quality": 0}, "quality must be at least 1; got 0"),
        ({"check": "full"}, "check must be one of none, header, decode; got 'full'"),
        ({"root": "/data"}, "root='/data' applies to list files only"),
    ],
)
def test_bad_options(tree: Path, options: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_lmdb(tree, tree.parent / "db", **options)  # type: ignore[arg-type]
