"""A small, learnable image dataset drawn on the fly: coloured shapes on textured backgrounds.

``make_shapes_dataset`` writes an ImageFolder tree of JPEG files whose class
is a shape and a colour (``red_circle``, ``blue_star``, ...). Position, size,
rotation, shade and background vary per image, so a classifier has to learn
the shape and the colour rather than memorise pixels. It exists so that the
whole pipeline (ImageFolder -> LMDB -> DDP training) can be run end to end in
minutes on a laptop, without downloading anything.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["SHAPE_CLASSES", "make_shapes_dataset"]

# Shapes from the most to the least distinct at small sizes (at 32 px a small
# network confuses star with cross and square with triangle before the others).
_SHAPES = ("circle", "triangle", "square", "cross", "star")
_COLOURS = {"red": (210, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210)}
# Shape-major order: red_circle, green_circle, blue_circle, red_triangle, ... so
# that the first k classes (k >= 4) can be told apart by neither colour nor
# shape alone; the demo's 6 are three colours times circle and triangle.
SHAPE_CLASSES: tuple[str, ...] = tuple(f"{c}_{s}" for s in _SHAPES for c in _COLOURS)
_SPLITS = ("train", "val")


def make_shapes_dataset(
    root: str | os.PathLike[str],
    *,
    classes: int = 10,
    train_per_class: int = 200,
    val_per_class: int = 50,
    size: int = 64,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``root/train/<class>/*.jpg`` and ``root/val/<class>/*.jpg``, an ImageFolder of shapes.

    The folders are the first ``classes`` names of ``SHAPE_CLASSES``
    (``"red_circle"``, ``"green_circle"``, ``"blue_circle"``, ``"red_triangle"``,
    ...); after ``build_lmdb``, as with ImageFolder, label ``k`` is the ``k``-th
    folder name in sorted order (``"blue_circle"`` is 0 for 6 classes).
    Each image is drawn from its own generator seeded with ``(seed, split,
    class, index)``, so the same arguments give byte-identical files. A split
    whose tree already holds exactly the requested classes and counts is
    left as it is; an incomplete one is redrawn.

    Args:
        root: directory that receives ``train/`` and ``val/``.
        classes: number of classes, 1 .. ``len(SHAPE_CLASSES)`` (15).
        train_per_class: training images per class.
        val_per_class: validation images per class.
        size: side of the square images, in pixels (at least 16).
        seed: seed of the drawing.

    Returns:
        ``(root / "train", root / "val")``.

    Raises:
        ValueError: ``classes`` outside 1 .. 15, a count below 1, or ``size`` below 16.

    Example:
        >>> train_dir, val_dir = make_shapes_dataset("data/shapes", classes=10)  # doctest: +SKIP
        >>> build_lmdb(train_dir, "data/train.lmdb")  # doctest: +SKIP
    """
    if not 1 <= classes <= len(SHAPE_CLASSES):
        raise ValueError(
            f"classes must be between 1 and {len(SHAPE_CLASSES)} (the shape x colour "
            f"combinations), got {classes}"
        )
    for name, value in (("train_per_class", train_per_class), ("val_per_class", val_per_class)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if size < 16:
        raise ValueError(f"size must be at least 16 pixels, got {size}")
    root = Path(root)
    names = SHAPE_CLASSES[:classes]
    for split_index, (split, count) in enumerate(
        zip(_SPLITS, (train_per_class, val_per_class), strict=True)
    ):
        directory = root / split
        if _complete(directory, names, count):
            continue
        if directory.exists():
            shutil.rmtree(directory)
        for label, name in enumerate(names):
            class_dir = directory / name
            class_dir.mkdir(parents=True)
            for index in range(count):
                rng = np.random.default_rng([seed, split_index, label, index])
                image = _draw(rng, name, size)
                image.save(class_dir / f"{index:05d}.jpg", quality=90)
    return root / "train", root / "val"


def _complete(directory: Path, names: Sequence[str], count: int) -> bool:
    if not directory.is_dir():
        return False
    if sorted(p.name for p in directory.iterdir()) != sorted(names):
        return False
    return all(len(list((directory / n).glob("*.jpg"))) == count for n in names)


def _draw(rng: np.random.Generator, name: str, size: int) -> Image.Image:
    colour_name, shape = name.split("_", 1)
    image = Image.fromarray(_background(rng, size))
    shade = np.clip(np.array(_COLOURS[colour_name]) + rng.integers(-30, 31, 3), 0, 255)
    fill = (int(shade[0]), int(shade[1]), int(shade[2]))
    radius = size * rng.uniform(0.26, 0.4)
    margin = radius * 1.05
    cx, cy = rng.uniform(margin, size - margin, 2)
    angle = rng.uniform(0, 2 * math.pi)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=fill)
    else:
        draw.polygon(_outline(shape, cx, cy, radius, angle), fill=fill)
    return image


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    # A grey linear gradient with a faint tint and per-pixel noise: busy enough
    # that the shape's edge and colour are what separates the classes.
    base = rng.uniform(90, 200)
    slope = rng.uniform(-60, 60, 2)
    ramp = np.linspace(-0.5, 0.5, size)
    grey = base + slope[0] * ramp[None, :] + slope[1] * ramp[:, None]
    tint = rng.uniform(-15, 15, 3)
    noise = rng.normal(0, 12, (size, size, 3))
    pixels = grey[:, :, None] + tint[None, None, :] + noise
    out: np.ndarray = np.clip(pixels, 0, 255).astype(np.uint8)
    return out


def _outline(
    shape: str, cx: float, cy: float, radius: float, angle: float
) -> list[tuple[float, float]]:
    if shape == "square":
        polar = [(radius, angle + k * math.pi / 2) for k in range(4)]
    elif shape == "triangle":
        polar = [(radius, angle + k * 2 * math.pi / 3) for k in range(3)]
    elif shape == "star":
        polar = [
            (radius if k % 2 == 0 else radius * 0.45, angle + k * math.pi / 5) for k in range(10)
        ]
    else:  # cross: a plus sign of arm half-width radius / 3
        w = radius / 3
        corners = [(w, w), (w, radius), (-w, radius), (-w, w), (-radius, w), (-radius, -w)]
        corners += [(-w, -w), (-w, -radius), (w, -radius), (w, -w), (radius, -w), (radius, w)]
        polar = [(math.hypot(x, y), angle + math.atan2(y, x)) for x, y in corners]
    return [(cx + r * math.cos(a), cy + r * math.sin(a)) for r, a in polar]
