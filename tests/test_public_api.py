"""The public API: every exported name resolves, and importing ddpkit stays light."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import ddpkit
from ddpkit import _graveyard

ROOT = Path(__file__).resolve().parent.parent


FACES = ("ddpkit", "ddpkit.data", "ddpkit.distributed", "ddpkit.checkpoint", "ddpkit.training")


def _static_imports(face: str) -> dict[str, str]:
    """Name -> module of the face's ``if TYPE_CHECKING:`` imports (what type checkers see)."""
    spec = importlib.util.find_spec(face)
    assert spec is not None
    assert spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    guarded = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    return {
        alias.name: node.module
        for block in guarded
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


@pytest.mark.parametrize("face", FACES)
def test_every_exported_name_resolves_to_the_module_type_checkers_see(face: str) -> None:
    module = importlib.import_module(face)
    static = _static_imports(face)
    assert set(static) == set(module.__all__) - {"__version__"}, "__all__ and the imports differ"
    for name, home in static.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize("face", FACES)
def test_importing_a_face_loads_no_torch(face: str) -> None:
    # The `ddpkit` command and a script's `from ddpkit.data import ...` line start fast;
    # a name's module loads when the name is first read.
    code = f"import sys, {face}; print(sorted(m for m in ('torch', 'lmdb') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        ddpkit.no_such_thing  # type: ignore[attr-defined]  # noqa: B018


def test_unknown_names_of_a_face_are_attribute_errors_naming_the_face() -> None:
    for face in FACES[1:]:
        with pytest.raises(AttributeError, match=f"{face}.*no_such_thing"):
            importlib.import_module(face).no_such_thing  # noqa: B018


# Every name of ddpkit 0.1.0's __all__ and the module it was imported from then.
_RELEASE_0_1_0 = {
    "ddpkit._procs": ["RankFailedError"],
    "ddpkit.comm": [
        "all_gather_object",
        "all_reduce_sum",
        "barrier",
        "get_local_rank",
        "get_rank",
        "get_world_size",
        "is_main_process",
    ],
    "ddpkit.data": [
        "BuildSummary",
        "DistributedEvalSampler",
        "IMAGENET_MEAN",
        "IMAGENET_STD",
        "ImageError",
        "LMDBFormatError",
        "LazyLMDBDataset",
        "build_lmdb",
        "build_loader",
        "normalize_batch",
        "set_epoch",
        "train_transform",
        "val_transform",
    ],
    "ddpkit.dist": ["DistInfo", "RendezvousError", "init_distributed", "shutdown"],
    "ddpkit.launch": ["spawn"],
    "ddpkit.launchers": ["LaunchEnv", "detect_launcher"],
    "ddpkit.network": ["NetworkConfigError", "configure_network"],
    "ddpkit.checkpoint": [
        "CheckpointError",
        "CheckpointManager",
        "load_checkpoint",
        "rank0_only",
        "save_checkpoint",
    ],
    "ddpkit.losses": ["FocalLoss"],
    "ddpkit.models": ["PretrainedReport", "freeze_backbone", "load_pretrained"],
    "ddpkit.parallel": ["no_sync", "unwrap_model", "wrap_ddp"],
    "ddpkit.train": ["History", "TrainingError", "evaluate", "fit"],
}
# 0.1.0's top-level names that are no longer exported at the top.
_LEFT_THE_TOP = {
    "LaunchEnv": "ddpkit.distributed.launchers",
    "detect_launcher": "ddpkit.distributed.launchers",
}
_CASES = [(module, name) for module, names in _RELEASE_0_1_0.items() for name in names]


def _import_fresh(module: str) -> tuple[Any, list[warnings.WarningMessage]]:
    """Import ``module`` as a first import would (a stand-in warns when it is imported)."""
    if module in _graveyard.MOVED_MODULES:
        sys.modules.pop(module, None)
        parent, _, child = module.rpartition(".")
        if hasattr(sys.modules[parent], child):
            delattr(sys.modules[parent], child)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # An import statement, compiled as this file's: the warning must point at it.
        scope: dict[str, Any] = {}
        exec(compile(f"import {module} as imported", __file__, "exec"), scope)
    return scope["imported"], list(caught)


@pytest.mark.parametrize(("module", "name"), _CASES, ids=[f"{m}.{n}" for m, n in _CASES])
def test_every_name_of_0_1_0_imports_from_its_0_1_0_path(module: str, name: str) -> None:
    imported, caught = _import_fresh(module)
    with warnings.catch_warnings(record=True) as looked_up:
        warnings.simplefilter("always")
        value = getattr(imported, name)
    warned = [w for w in caught + looked_up if issubclass(w.category, DeprecationWarning)]
    moved = module in _graveyard.MOVED_MODULES or (module, name) in _graveyard.MOVED_NAMES
    assert len(warned) == (1 if moved else 0), [str(w.message) for w in warned]
    if warned:
        assert issubclass(warned[0].category, _graveyard.DdpkitDeprecationWarning)
        assert "removed in ddpkit 0.3" in str(warned[0].message)
        assert warned[0].filename == __file__, "the warning points at the importing line"
    if name in _LEFT_THE_TOP:
        assert value is getattr(importlib.import_module(_LEFT_THE_TOP[name]), name)
    else:
        assert value is getattr(ddpkit, name)


@pytest.mark.parametrize("name", sorted({n for _, n in _CASES} - set(_LEFT_THE_TOP)))
def test_every_name_of_0_1_0_is_still_at_the_top(name: str) -> None:
    assert name in ddpkit.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(ddpkit, name) is not None


@pytest.mark.parametrize("name", sorted(_LEFT_THE_TOP))
def test_names_that_left_the_top_still_resolve_there_with_a_warning(name: str) -> None:
    with pytest.warns(_graveyard.DdpkitDeprecationWarning, match=f"ddpkit.{name} is deprecated"):
        value = getattr(ddpkit, name)
    assert value is getattr(importlib.import_module(_LEFT_THE_TOP[name]), name)


@pytest.mark.parametrize("module", sorted(_graveyard.MOVED_MODULES))
def test_every_moved_module_imports_with_one_warning_naming_its_new_home(module: str) -> None:
    imported, caught = _import_fresh(module)
    warned = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(warned) == 1, [str(w.message) for w in warned]
    home = _graveyard.MOVED_MODULES[module][0]
    assert f"module {module} is deprecated" in str(warned[0].message)
    assert home in str(warned[0].message)
    public = [n for n in dir(importlib.import_module(home)) if not n.startswith("_")]
    assert public, home
    assert getattr(imported, public[0]) is getattr(importlib.import_module(home), public[0])
    with pytest.raises(AttributeError, match="no_such_name"):
        imported.no_such_name  # noqa: B018


@pytest.mark.parametrize(("module", "name"), sorted(_graveyard.MOVED_NAMES), ids=lambda v: str(v))
def test_every_moved_name_resolves_with_a_warning(module: str, name: str) -> None:
    new_module, new_name = _graveyard.MOVED_NAMES[(module, name)]
    with pytest.warns(
        _graveyard.DdpkitDeprecationWarning, match=rf"{module}\.{name} is deprecated"
    ):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(new_module), new_name)


def test_changelog_lists_every_moved_path() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    missing = [m for m in _graveyard.MOVED_MODULES if f"`{m}`" not in changelog]
    missing += [f"{m}.{n}" for m, n in _graveyard.MOVED_NAMES if f"`{m}.{n}`" not in changelog]
    assert missing == [], "CHANGELOG.md does not list these moves"


def test_the_former_keyword_arguments_warn_through_the_one_channel() -> None:
    with pytest.warns(_graveyard.DdpkitDeprecationWarning, match=r"CheckpointManager\(network="):
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
