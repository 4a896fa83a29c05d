"""The public API: every exported name resolves, and importing ddpkit stays light."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import ddpkit


def test_every_exported_name_resolves_to_its_module() -> None:
    assert set(ddpkit._EXPORTS) == set(ddpkit.__all__) - {"__version__"}
    for name, module in ddpkit._EXPORTS.items():
        assert getattr(ddpkit, name) is getattr(importlib.import_module(module), name), name
    assert set(ddpkit.__all__) <= set(dir(ddpkit))


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        ddpkit.no_such_thing  # type: ignore[attr-defined]  # noqa: B018


def test_import_does_not_load_torch() -> None:
    # The `ddpkit` command (--version, --help) must start fast.
    code = "import sys, ddpkit; print(ddpkit.__version__); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [ddpkit.__version__, "False"]
