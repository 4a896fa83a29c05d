"""The public API: each name listed once, every exported name resolves, importing stays light.

Each part's face lists its names once, in its ``if TYPE_CHECKING:`` block, and
the top level takes every face's (``ddpkit._lazy``); then the 0.1.0 names and
every moved path, served by the graveyard.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import ddpkit
from ddpkit import _graveyard
from ddpkit._lazy import lazy_names

ROOT = Path(__file__).resolve().parent.parent


FACES = ("ddpkit", "ddpkit.data", "ddpkit.distributed", "ddpkit.checkpoint", "ddpkit.training")
PARTS = FACES[1:]
# The top level's own names besides the parts': bound at import, or from a shared leaf.
TOP_ONLY = {"CommandLine", "Position", "__version__", "load_config"}


def _tree(face: str) -> ast.Module:
    spec = importlib.util.find_spec(face)
    assert spec is not None
    assert spec.origin is not None
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"))


def _listing(face: str) -> list[ast.ImportFrom]:
    """The imports of the face's ``if TYPE_CHECKING:`` block: its one list of its names."""
    guarded = [
        n
        for n in _tree(face).body
        if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    assert len(guarded) == 1, f"{face}: one TYPE_CHECKING block lists the names"
    assert all(isinstance(n, ast.ImportFrom) for n in guarded[0].body), face
    return [n for n in guarded[0].body if isinstance(n, ast.ImportFrom)]


def _static_names(face: str) -> dict[str, str]:
    """Name -> module, as type checkers read the listing (a star import: that face's names)."""
    names: dict[str, str] = {}
    for node in _listing(face):
        assert node.module is not None
        for alias in node.names:
            names |= _static_names(node.module) if alias.name == "*" else {alias.name: node.module}
    return names


@pytest.mark.parametrize("face", FACES)
def test_each_face_lists_its_names_once_in_the_form_type_checkers_read(face: str) -> None:
    tree = _tree(face)
    for node in _listing(face):
        for alias in node.names:
            # mypy --strict re-exports an import only with the redundant alias.
            assert alias.name == "*" or alias.asname == alias.name, (
                f"{face}: write `from {node.module} import {alias.name} as {alias.name}`"
            )
            if alias.name == "*":
                assert face == "ddpkit", f"{face}: only the top level takes whole faces"
                assert node.module in PARTS, node.module
    # One list: no __all__ written out, and none that type checkers see (an __all__ mypy
    # cannot read makes it export nothing; ddpkit._lazy).
    visible = [
        ast.unparse(n)
        for n in tree.body
        if isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign) and "__all__" in ast.unparse(n)
    ]
    assert visible == [], f"{face}: __all__ is built by ddpkit._lazy under `if not TYPE_CHECKING`"


@pytest.mark.parametrize("face", FACES)
def test_every_exported_name_resolves_to_the_module_type_checkers_see(face: str) -> None:
    module = importlib.import_module(face)
    static = _static_names(face)
    bound = TOP_ONLY - set(static) if face == "ddpkit" else set()
    assert set(module.__all__) == set(static) | bound, "__all__ and the listing differ"
    for name, home in static.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    assert module.__all__ == sorted(set(module.__all__)), "sorted, each name once"
    assert set(module.__all__) <= set(dir(module))


def test_the_top_level_holds_every_name_of_every_part() -> None:
    names = {face: set(importlib.import_module(face).__all__) for face in PARTS}
    counts = Counter(name for face in PARTS for name in names[face])
    twice = sorted(name for name, count in counts.items() if count > 1)
    assert twice == [], "names in two faces: the top level can hold only one of each"
    assert set(ddpkit.__all__) == set().union(*names.values()) | TOP_ONLY
    for face in PARTS:
        for name in names[face]:
            assert getattr(ddpkit, name) is getattr(importlib.import_module(face), name), name


# Names of the parts' faces that reached the top level in 0.2 (CHANGELOG).
_NEW_AT_THE_TOP = {
    "HangStopped": "ddpkit.distributed",
    "HangWatchdog": "ddpkit.distributed",
    "SignalStopped": "ddpkit.distributed",
    "SHAPE_CLASSES": "ddpkit.data",
    "VerifyReport": "ddpkit.data",
    "describe_lmdb": "ddpkit.data",
    "make_shapes_dataset": "ddpkit.data",
    "read_index": "ddpkit.data",
    "verify_lmdb": "ddpkit.data",
    "verify_report": "ddpkit.data",
    "TrainingState": "ddpkit.checkpoint",
}


@pytest.mark.parametrize(("name", "face"), sorted(_NEW_AT_THE_TOP.items()))
def test_the_names_new_at_the_top_are_their_faces_names(name: str, face: str) -> None:
    assert name in ddpkit.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(ddpkit, name) is getattr(importlib.import_module(face), name)


@pytest.mark.parametrize("face", FACES)
def test_star_import_gives_the_public_names(face: str) -> None:
    scope: dict[str, Any] = {}
    exec(f"from {face} import *", scope)
    assert set(scope) - {"__builtins__"} == set(importlib.import_module(face).__all__)


@pytest.mark.parametrize("face", FACES)
def test_importing_a_face_loads_no_torch(face: str) -> None:
    # The `ddpkit` command and a script's `from ddpkit.data import ...` line start fast;
    # a name's module loads when the name is first read. Listing the names loads none.
    code = (
        f"import sys, {face} as face; assert face.__all__ and dir(face)\n"
        "print(sorted(m for m in ('torch', 'lmdb') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]


def test_a_name_listed_twice_is_an_import_error(tmp_path: Path) -> None:
    twice = tmp_path / "twice.py"
    twice.write_text(
        "if TYPE_CHECKING:\n"
        "    from ddpkit.data.loaders import build_loader as build_loader\n"
        "    from ddpkit.data.loaders import build_loader as build_loader\n"
    )
    with pytest.raises(ImportError, match="'build_loader' twice"):
        lazy_names("twice", str(twice))
    # Two faces that held one name would clash at the top level the same way.
    twice.write_text(
        "if TYPE_CHECKING:\n    from ddpkit.data import *\n    from ddpkit.data import *\n"
    )
    with pytest.raises(ImportError, match=r"twice \(from ddpkit\.data and ddpkit\.data\)"):
        lazy_names("twice", str(twice))


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
