"""The public API: every exported name resolves, and importing ddpkit stays light."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit

ROOT = Path(__file__).resolve().parent.parent


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


@pytest.mark.parametrize(
    ("old", "module", "new"),
    [
        ("LaunchEnv", "ddpkit.launchers", "LaunchEnv"),
        ("detect_launcher", "ddpkit.launchers", "detect_launcher"),
        ("RankZeroError", "ddpkit.rank0", "Rank0Error"),
        ("rank_zero_first", "ddpkit.rank0", "rank0_first"),
    ],
)
def test_former_names_still_resolve_with_a_warning(old: str, module: str, new: str) -> None:
    assert old not in ddpkit.__all__
    with pytest.warns(DeprecationWarning, match=f"ddpkit.{old} is deprecated"):
        value = getattr(ddpkit, old)
    assert value is getattr(importlib.import_module(module), new)


def test_former_checkpoint_names_still_resolve_with_a_warning() -> None:
    import ddpkit.checkpoint

    with pytest.warns(DeprecationWarning, match="now ddpkit.Rank0Error"):
        assert ddpkit.checkpoint.RankZeroError is ddpkit.Rank0Error  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="now ddpkit.rank0_first"):
        assert ddpkit.checkpoint.rank_zero_first is ddpkit.rank0_first  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match=r"CheckpointManager\(prefix=...\)"):
        manager = ddpkit.CheckpointManager("run", network="net")  # type: ignore[call-arg]
    assert manager.prefix == "net"


def test_every_exception_a_public_call_raises_is_exported() -> None:
    import ddpkit.testing

    raised = set()
    for path in (ROOT / "ddpkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # Errors a caller catches are named ...Error (internal signals are not).
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                raised.add(node.name)
    exported = set(ddpkit.__all__) | set(ddpkit.testing.__all__)
    assert sorted(raised - exported) == []
