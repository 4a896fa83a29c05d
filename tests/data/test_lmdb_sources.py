"""ddpkit.data.lmdb_sources: samples from an ImageFolder tree, a list file, Parquet files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddpkit.data.lmdb_sources import (
    Sample,
    detect_format,
    imagefolder_source,
    list_source,
    parquet_source,
)


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not decoded here")
    return path


def test_the_format_is_detected_from_what_is_there(tmp_path: Path) -> None:
    assert detect_format(str(_touch(tmp_path / "a.parquet"))) == "parquet"
    assert detect_format(str(_touch(tmp_path / "train.txt"))) == "list"
    odd = tmp_path / "shards[1]"  # glob characters in the name are taken literally
    _touch(odd / "part.parquet")
    assert detect_format(str(odd)) == "parquet"
    _touch(tmp_path / "tree" / "cat" / "1.jpg")
    assert detect_format(str(tmp_path / "tree")) == "imagefolder"
    _touch(tmp_path / "flat" / "1.jpg")
    with pytest.raises(ValueError, match="pass source_format="):
        detect_format(str(tmp_path / "flat"))


def test_an_imagefolder_is_read_in_torchvisions_order_lazily(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    for name in ("dog/b.JPG", "dog/a.png", "dog/sub/c.jpeg", "cat/z.jpg", "cat/notes.txt"):
        _touch(root / name)
    source = imagefolder_source(str(root))
    assert (source.classes, source.total, source.problems) == (("cat", "dog"), 4, ())
    assert not isinstance(source.samples, list)  # produced as consumed
    samples = list(source.samples)
    assert [(s.name, s.label) for s in samples] == [
        ("cat/z.jpg", 0), ("dog/a.png", 1), ("dog/b.JPG", 1), ("dog/sub/c.jpeg", 1),
    ]  # fmt: skip
    assert samples[1] == Sample("dog/a.png", 1, str(root / "dog" / "a.png"), None)


def test_classes_and_extensions_are_torchvisions(tmp_path: Path) -> None:
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes

    from ddpkit.data import lmdb_sources

    assert lmdb_sources.IMG_EXTENSIONS == IMG_EXTENSIONS
    root = tmp_path / "tree"
    for name in ("b/1.jpg", "a/2.jpg", ".hidden/3.jpg", "B/4.jpg", "ä/5.jpg", "10/6.jpg"):
        _touch(root / name)
    _touch(root / "top.jpg")  # a file at the top is no class
    (root / "link").symlink_to(root / "a")
    assert imagefolder_source(str(root)).classes == tuple(find_classes(str(root))[0])
    empty = tmp_path / "empty"
    _touch(empty / "top.jpg")
    with pytest.raises(FileNotFoundError, match="no class directory"):
        imagefolder_source(str(empty))


def test_a_class_without_images_is_refused(tmp_path: Path) -> None:
    _touch(tmp_path / "tree" / "cat" / "1.jpg")
    _touch(tmp_path / "tree" / "dog" / "readme.txt")
    with pytest.raises(FileNotFoundError, match="class 'dog' holds no image file"):
        imagefolder_source(str(tmp_path / "tree"))


def test_a_list_file_with_integer_labels(tmp_path: Path) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text(
        "\ufeff# path label\n\nimg/a b,c.jpg,3\n  img/d.jpg\t0  \nimg/e.jpg 1\n", encoding="utf-8"
    )
    source = list_source(str(listing), None, None)
    assert (source.classes, source.total) == (("0", "1", "2", "3"), 3)
    samples = list(source.samples)
    assert [(s.name, s.label) for s in samples] == [("img/a b,c.jpg", 3), ("img/d.jpg", 0),
                                                    ("img/e.jpg", 1)]  # fmt: skip
    assert samples[0].file == str(tmp_path / "img/a b,c.jpg")  # beside the list file
    rooted = list(list_source(str(listing), "/data", ["w", "x", "y", "z"]).samples)
    assert rooted[1].file == "/data/img/d.jpg"
    with pytest.raises(ValueError, match="line 3: label 3 is negative or beyond the 2 classes"):
        list_source(str(listing), None, ["a", "b"])


def test_an_empty_list_file_has_no_samples(tmp_path: Path) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text("# nothing yet\n\n")
    source = list_source(str(listing), None, None)
    assert (source.classes, source.total, list(source.samples)) == ((), 0, [])


def test_a_list_file_changed_between_the_two_reads_is_refused(tmp_path: Path) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text("a.jpg,cat\nb.jpg,dog\n")
    source = list_source(str(listing), None, None)
    listing.write_text("a.jpg,cat\nb.jpg,emu\n")
    with pytest.raises(ValueError, match="line 2: label 'emu' does not fit the labels read"):
        list(source.samples)


def _parquet(path: Path, images: pa.Array, labels: pa.Array) -> Path:
    pq.write_table(pa.table({"image": images, "label": labels}), path)
    return path


def test_parquet_labels_as_names_dictionary_or_given_classes(tmp_path: Path) -> None:
    images = pa.array([b"x", None, b"z"], pa.large_binary())
    names = pa.array(["dog", "cat", "dog"]).dictionary_encode()
    path = _parquet(tmp_path / "a.parquet", images, names)
    source = parquet_source(str(path), "image", "label", None)
    assert (source.classes, source.total) == (("cat", "dog"), 3)
    samples = list(source.samples)
    assert [(s.name, s.label, s.data) for s in samples] == [
        ("a.parquet#0", 1, b"x"), ("a.parquet#1", 0, b""), ("a.parquet#2", 1, b"z"),
    ]  # fmt: skip
    given = parquet_source(str(path), "image", "label", ["dog", "cat", "emu"])
    assert [s.label for s in given.samples] == [0, 1, 0]


@pytest.mark.parametrize(
    ("labels", "classes", "match"),
    [
        (pa.array(["dog", None, "cat"]), None, r"row 1 .* has label None"),
        (pa.array([0, 1, 2]), ["a", "b"], r"row 2 .* has label 2, not one of the 2 classes"),
        (pa.array([0, -1, 0]), None, r"row 1 .* has label -1"),
        (pa.array(["dog", "cat", "emu"]), ["dog", "cat"], r"row 2 .* has label 'emu'"),
    ],
)
def test_a_parquet_label_outside_the_classes_names_its_row(
    tmp_path: Path, labels: pa.Array, classes: list[str] | None, match: str
) -> None:
    path = _parquet(tmp_path / "a.parquet", pa.array([b"x"] * 3), labels)
    with pytest.raises(ValueError, match=match):
        parquet_source(str(path), "image", "label", classes)


def test_parquet_columns_of_the_wrong_kind_or_missing_are_refused(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "a.parquet", pa.array(["not bytes"]), pa.array([0]))
    with pytest.raises(ValueError, match="column 'image' has type string; expected binary"):
        parquet_source(str(path), "image", "label", None)
    with pytest.raises(ValueError, match=r"no column\(s\) \['y'\]"):
        parquet_source(str(path), "image", "y", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.parquet files"):
        parquet_source(str(tmp_path / "empty"), "image", "label", None)
