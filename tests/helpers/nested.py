"""``torch.equal`` through the nested dicts and lists of a checkpoint's parts."""

from __future__ import annotations

from typing import Any

import torch


def assert_nested_equal(found: Any, expected: Any, where: str = "") -> None:
    """Every tensor ``torch.equal``, every other value ``==``; ``where`` names a difference."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(found, torch.Tensor), where
        assert torch.equal(found, expected), where
    elif isinstance(expected, dict):
        assert found.keys() == expected.keys(), where
        for key, value in expected.items():
            assert_nested_equal(found[key], value, f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(found) == len(expected), where
        for index, value in enumerate(expected):
            assert_nested_equal(found[index], value, f"{where}/{index}")
    else:
        assert found == expected, where
