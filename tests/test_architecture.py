"""The layout docs/architecture.md describes is the layout of the code.

Every module is listed there, states its one concern in its first line, stays
under 450 lines, and imports only from the floors below its own; one module
reads the launcher's variables; no module reaches into another's private names.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ddpkit"
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
MAX_LINES = 450

# What launchers set; only ddpkit/launchers.py may read them from an environment.
_LAUNCHER_NAMES = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
}
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "TORCHELASTIC_", "PMI_")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    name = ".".join(parts)
    return name if name == "ddpkit" else name.removeprefix("ddpkit.")


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def _tree(name: str) -> ast.Module:
    return ast.parse(_modules()[name].read_text(encoding="utf-8"))


def _imports(name: str) -> set[str]:
    """The ddpkit modules ``name`` imports, anywhere in the file (functions too)."""
    found: set[str] = set()
    known = _modules()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddpkit"):
            base = _module_name(ROOT / (node.module.replace(".", "/") + ".py"))
            if node.module == "ddpkit":  # from ddpkit import comm, devices ...
                found |= {a.name for a in node.names if a.name in known}
            else:
                found.add(base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("ddpkit.") for a in node.names if a.name != "ddpkit"}
    found.discard(name)
    return {f for f in found if f in known}


def _floors() -> dict[str, int]:
    section = ARCHITECTURE.split("## Who may import whom", 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    for number, names in re.findall(r"^\| (\d+) \| (.+?) \|$", section, re.MULTILINE):
        for module in re.findall(r"`([\w.]+)`", names):
            assert module not in floors, f"{module} is on two floors"
            floors[module] = int(number)
    return floors


def test_every_module_is_on_exactly_one_floor() -> None:
    floors = _floors()
    assert sorted(set(_modules()) - set(floors)) == [], "modules missing from the floors table"
    assert sorted(set(floors) - set(_modules())) == [], "floors table names no such module"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_imports_go_only_down(name: str) -> None:
    floors = _floors()
    upward = sorted(m for m in _imports(name) if floors[m] >= floors[name])
    assert upward == [], f"{name} (floor {floors[name]}) imports from its floor or above"


def _listed_files() -> set[str]:
    block = ARCHITECTURE.split("## Modules as built", 1)[1].split("```", 2)[1]
    listed, folder = set(), ""
    for line in block.splitlines():
        match = re.match(r"^( +)(\S+)", line)
        if match is None or not line.startswith("  "):
            continue
        indent, entry = len(match.group(1)), match.group(2)
        if indent == 2:
            folder = entry if entry.endswith("/") else ""
            if entry.endswith(".py"):
                listed.add(entry)
        elif indent == 4 and folder and entry.endswith(".py"):
            listed.add(folder + entry)
    return listed


def test_architecture_lists_every_file() -> None:
    files = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    files.discard("data/__init__.py")  # the data package is listed as its folder
    assert sorted(files - _listed_files()) == [], "not described in docs/architecture.md"
    assert sorted(_listed_files() - files) == [], "described but not there"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_each_module_is_short_and_states_its_concern(name: str) -> None:
    path = _modules()[name]
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"{path.name}: {len(lines)} lines; split it by concern"
    if path.stat().st_size == 0 or name == "_version":
        return
    docstring = ast.get_docstring(_tree(name))
    assert docstring, f"{name} has no module docstring"
    first = docstring.splitlines()[0]
    assert first.endswith("."), f"{name}: the first line states the concern in a sentence"
    assert len(first) >= 20, f"{name}: {first!r} says too little"


def _launcher_reads(tree: ast.AST) -> list[str]:
    def launcher(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if value in _LAUNCHER_NAMES or value.startswith(_LAUNCHER_PREFIXES):
                return value
        return None

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            reads.append(launcher(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("get", "getenv", "pop") and node.args:
                reads.append(launcher(node.args[0]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "getenv" and node.args:
                reads.append(launcher(node.args[0]))
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            reads.append(launcher(node.left))
    return [r for r in reads if r is not None]


def test_only_launchers_reads_launcher_variables() -> None:
    readers = {name: _launcher_reads(_tree(name)) for name in _modules()}
    assert readers["launchers"], "the check finds nothing: it no longer sees launchers.py's reads"
    assert {n: r for n, r in readers.items() if r and n != "launchers"} == {}


def test_no_module_imports_private_names_of_another() -> None:
    private = []
    for name in _modules():
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpkit"):
                private += [
                    f"{name}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and a.name != "__version__"
                ]
    assert private == []
