"""make_shapes_dataset: deterministic, complete, validated."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from ddpkit.data.shapes import SHAPE_CLASSES, make_shapes_dataset


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


@pytest.mark.timeout(60)
def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    kw = {"classes": 3, "train_per_class": 4, "val_per_class": 2, "size": 32}
    make_shapes_dataset(tmp_path / "a", seed=1, **kw)
    make_shapes_dataset(tmp_path / "b", seed=1, **kw)
    make_shapes_dataset(tmp_path / "c", seed=2, **kw)
    a, b, c = (_tree(tmp_path / n) for n in "abc")
    assert a == b
    assert a.keys() == c.keys()
    assert a != c


@pytest.mark.timeout(60)
def test_counts_classes_and_images(tmp_path: Path) -> None:
    train, val = make_shapes_dataset(
        tmp_path, classes=7, train_per_class=5, val_per_class=3, size=40
    )
    assert (train, val) == (tmp_path / "train", tmp_path / "val")
    assert sorted(p.name for p in train.iterdir()) == sorted(SHAPE_CLASSES[:7])
    assert SHAPE_CLASSES[:4] == ("red_circle", "green_circle", "blue_circle", "red_triangle")
    assert len(set(SHAPE_CLASSES)) == 15
    for d in train.iterdir():
        assert len(list(d.glob("*.jpg"))) == 5
    for d in val.iterdir():
        assert len(list(d.glob("*.jpg"))) == 3
    with Image.open(next(train.rglob("*.jpg"))) as img:
        assert img.format == "JPEG"
        assert img.size == (40, 40)
        assert img.mode == "RGB"


@pytest.mark.timeout(60)
def test_complete_tree_is_kept_incomplete_is_redrawn(tmp_path: Path) -> None:
    kw = {"classes": 2, "train_per_class": 3, "val_per_class": 2, "size": 24}
    make_shapes_dataset(tmp_path, **kw)
    first = next((tmp_path / "train").rglob("*.jpg"))
    mtime = first.stat().st_mtime_ns
    make_shapes_dataset(tmp_path, **kw)
    assert first.stat().st_mtime_ns == mtime
    before = _tree(tmp_path)
    first.unlink()
    make_shapes_dataset(tmp_path, **kw)
    assert _tree(tmp_path) == before
    make_shapes_dataset(tmp_path, **{**kw, "train_per_class": 4})
    assert len(list((tmp_path / "train").rglob("*.jpg"))) == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"classes": 0}, "classes must be between 1 and 15"),
        ({"classes": 16}, "classes must be between 1 and 15"),
        ({"train_per_class": 0}, "train_per_class must be at least 1"),
        ({"val_per_class": -1}, "val_per_class must be at least 1"),
        ({"size": 8}, "size must be at least 16"),
    ],
)
@pytest.mark.timeout(30)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_shapes_dataset(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "train").exists()
