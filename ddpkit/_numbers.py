"""Numeric arguments: one check for every real number ddpkit takes (NumPy scalars too)."""

from __future__ import annotations

import math
import numbers

__all__ = ["as_int", "is_real", "positive_seconds"]


def is_real(value: object) -> bool:
    """True for a real number: int, float, ``Fraction``, NumPy's scalars; never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_seconds(value: object) -> float | None:
    """``value`` as a float when it is a positive, finite real number, else None.

    The caller raises its own ``ValueError`` naming the argument; a bool, nan,
    inf, 0, a negative, a string or None all give None.
    """
    if not is_real(value):
        return None
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (OverflowError, ValueError):  # a Fraction too large for a float
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def as_int(name: str, value: object, low: int | None = None) -> int:
    """``value`` as an int: any integral number (NumPy's too), never a bool or ``1.5``.

    Raises:
        ValueError: not an integral number, or below ``low``; the message names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    number = int(value)
    if low is not None and number < low:
        raise ValueError(f"{name} must be at least {low}, got {number}")
    return number
