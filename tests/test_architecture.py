"""The layout docs/architecture.md describes is the layout of the code.

Four packages with a public face each, and rules between them: ``distributed``
imports no other part, ``data`` only ``distributed``, ``checkpoint`` only
``distributed``, ``training`` any; the shared leaves at the top import no part,
and neither imports what composes the parts (the package, the command line, the
test harness). An import counts wherever it is (a function, ``if
TYPE_CHECKING:``), and so does a module's path written as a string (a preload
list); no two modules import each other.
Every module is listed in docs/architecture.md and states its one concern in
its first line; the tests mirror the modules; one module reads the launcher's
variables; no module reaches into another's private names; nothing is kept
short by ``# fmt: skip``.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ddpkit"
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")

PARTS = ("distributed", "data", "checkpoint", "training")
# What each part may import of the others.
ALLOWED = {
    "distributed": set(),
    "data": {"distributed"},
    "checkpoint": {"distributed"},
    "training": {"distributed", "data", "checkpoint"},
}
# The modules that stay at the top: the package, its entry points and small shared leaves.
TOP = {
    "ddpkit",
    "__main__",
    "_docs",
    "_graveyard",
    "_lazy",
    "_numbers",
    "_version",
    "cli",
    "command_line",
    "files",
    "position",
    "rng",
    "testing",
}
# The top-level modules that may import the parts: the command line and the test harness,
# and the graveyard, which imports a part's module when a name of an earlier release is read.
TOP_USERS = {"ddpkit", "__main__", "cli", "testing", "_graveyard"}
# The modules above the parts, which no part or shared leaf imports or names (the graveyard
# is not: every part may warn through its deprecation helper).
ABOVE_THE_PARTS = TOP_USERS - {"_graveyard"}
# Packages beside the parts that compose them all (the shipped example).
USERS = {"examples"}

# What launchers set; only ddpkit/distributed/launchers.py may read them from an environment.
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


def _part(module: str) -> str:
    """The part a module belongs to, or ``"top"``."""
    head = module.split(".", 1)[0]
    return head if head in PARTS or head in USERS else "top"


def _imported(node: ast.AST) -> set[str]:
    """The ddpkit modules an import statement loads (none for another statement)."""
    known = _modules()
    found: set[str] = set()
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpkit"):
        base = _short(node.module or "")
        # from ddpkit.distributed import comm: the module comm, not a name of the face
        submodules = {_short(f"{node.module}.{a.name}") for a in node.names} & set(known)
        found = submodules if len(submodules) == len(node.names) else {*submodules, base}
    elif isinstance(node, ast.Import):
        found = {_short(a.name) for a in node.names if a.name.split(".")[0] == "ddpkit"}
    return found & set(known)


def _short(module: str) -> str:
    """``ddpkit.data.loaders`` -> ``data.loaders`` (the names of :func:`_modules`)."""
    return module if module == "ddpkit" else module.removeprefix("ddpkit.")


def _imports(tree: ast.AST) -> set[str]:
    """The ddpkit modules a file imports, anywhere in it (functions, TYPE_CHECKING too)."""
    return set().union(*(_imported(node) for node in ast.walk(tree)))


_MODULE_PATH = re.compile(r"ddpkit(\.\w+)+")


def _named(tree: ast.AST) -> set[str]:
    """The ddpkit modules a file names in a string: a path in a preload list, say."""
    known = _modules()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and _MODULE_PATH.fullmatch(str(node.value)):
            # ddpkit.training.loop.fit names the module ddpkit.training.loop; a path
            # that is no module of ours (a logger's name, a former module) names none
            parts = _short(node.value).split(".")
            paths = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
            found |= {next(p for p in paths if p in known)} if parts[0] in known else set()
    return found


def _references(name: str) -> set[str]:
    """The ddpkit modules ``name`` imports or names: what the layer rules judge."""
    return (_imports(_tree(name)) | _named(_tree(name))) - {name}


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run on import: the body, and the bodies of its ``if`` and ``try``.

    ``if TYPE_CHECKING:`` among them: a type checker follows those imports as
    Python follows the others.
    """
    found: list[ast.stmt] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        found.append(node)
        if isinstance(node, ast.If):
            pending += [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            pending += [*node.body, *node.orelse, *node.finalbody]
            pending += [s for handler in node.handlers for s in handler.body]
    return found


def test_the_parts_are_packages_with_a_public_face() -> None:
    for part in PARTS:
        face = PACKAGE / part / "__init__.py"
        assert face.is_file(), f"ddpkit/{part}/ is not a package"
        tree = ast.parse(face.read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree) or ""
        assert len(doc.splitlines()) >= 5, f"ddpkit/{part}/__init__.py: no usage guide"
        # The public names: listed in the TYPE_CHECKING block, exported by ddpkit._lazy.
        source = ast.unparse(tree)
        assert "if TYPE_CHECKING:\n    from " in source, f"ddpkit/{part}/__init__.py lists no names"
        assert "__all__ = lazy_names(__name__, __file__)" in source, f"ddpkit/{part}: no __all__"


def test_only_a_handful_of_modules_stay_at_the_top() -> None:
    top = {name for name in _modules() if _part(name) == "top"}
    assert top <= TOP, f"modules at the top of ddpkit/ that belong in a part: {top - TOP}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_imports_follow_the_layer_rules(name: str) -> None:
    part = _part(name)
    if part in USERS:
        return
    referenced = _references(name)
    imported = {_part(m) for m in referenced} - {part, "top"}
    top = set(PARTS) if name in TOP_USERS else set()
    allowed = top if part == "top" else ALLOWED[part]
    assert imported <= allowed, f"{name} ({part}) imports or names {sorted(imported - allowed)}"
    if name not in TOP_USERS:
        above = sorted(referenced & ABOVE_THE_PARTS)
        assert above == [], f"{name} ({part}) imports or names {above}, which compose the parts"


def test_the_layer_rules_see_every_kind_of_reference() -> None:
    # Imports under TYPE_CHECKING and in functions, and module paths in strings.
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ddpkit.checkpoint.state import TrainingState\n"
        "def f():\n"
        "    import ddpkit.training.loop\n"
        "PRELOAD = ('torch', 'ddpkit.testing', 'ddpkit.data', 'ddpkit.training.loop.fit')\n"
        "LOGGER = 'ddpkit.no_module_of_ours'\n"
        '"""Text that mentions ddpkit.cli in a sentence is no reference."""\n'
    )
    assert _imports(tree) == {"checkpoint.state", "training.loop"}
    assert _named(tree) == {"testing", "data", "training.loop"}


def test_no_import_cycles_between_modules() -> None:
    # The imports that run on import, and TYPE_CHECKING's, which a type checker runs
    # alike; an import inside a function runs later, on purpose.
    graph: dict[str, set[str]] = {}
    for name in _modules():
        edges = set().union(*(_imported(n) for n in _module_level(_tree(name))))
        graph[name] = edges - {name}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_no_two_modules_import_each_other() -> None:
    # Wherever the import is: one under TYPE_CHECKING or in a function hides the pair
    # from Python, not from the reader; two modules that need each other are one concern.
    imports = {name: _imports(_tree(name)) - {name} for name in _modules()}
    pairs = sorted(
        f"{a} <-> {b}" for a, needs in imports.items() for b in needs if a < b and a in imports[b]
    )
    assert pairs == []


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
    assert sorted(files - _listed_files()) == [], "not described in docs/architecture.md"
    assert sorted(_listed_files() - files) == [], "described but not there"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_each_module_states_its_concern(name: str) -> None:
    path = _modules()[name]
    if path.stat().st_size == 0 or name == "_version":
        return
    docstring = ast.get_docstring(_tree(name))
    assert docstring, f"{name} has no module docstring"
    first = docstring.splitlines()[0]
    assert first.endswith("."), f"{name}: the first line states the concern in a sentence"
    assert len(first) >= 20, f"{name}: {first!r} says too little"


def test_no_formatting_is_switched_off() -> None:
    skipped = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert skipped == [], "the formatter decides the layout of every line"


def test_each_module_has_its_test_file() -> None:
    missing = []
    for name, path in _modules().items():
        if path.name.startswith("_") or name == "ddpkit":
            continue
        parts = path.relative_to(PACKAGE).parts
        test = ROOT / "tests" / Path(*parts[:-1]) / f"test_{parts[-1]}"
        if not test.is_file():
            missing.append(test.relative_to(ROOT).as_posix())
    assert missing == [], "the test of ddpkit/x/y.py lives at tests/x/test_y.py"


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
    assert readers["distributed.launchers"], "the check no longer sees launchers.py's reads"
    assert {n: r for n, r in readers.items() if r and n != "distributed.launchers"} == {}


def test_no_module_imports_private_names_of_another() -> None:
    private_modules = {m.rsplit(".", 1)[-1] for m in _modules() if m.rsplit(".", 1)[-1][:1] == "_"}
    private = []
    for name in _modules():
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpkit"):
                private += [
                    f"{name}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and a.name not in private_modules | {"__version__"}
                ]
    assert private == []


def _defined(tree: ast.Module) -> tuple[set[str], list[str]]:
    """The names a module's top level defines, and its ``__all__``."""
    defined: set[str] = set()
    listed: list[str] = []

    def add(target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            defined.add(target.id)
        elif isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                add(element)

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            add(node.target)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                add(target)
                if isinstance(target, ast.Name) and target.id == "__all__":
                    listed = list(ast.literal_eval(node.value))
    return defined, listed


def test_each_modules_all_names_only_what_it_defines() -> None:
    # A package's face lists its parts' names (ddpkit._lazy); a module lists its own, so each
    # public name has one home and one import path.
    foreign = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        defined, listed = _defined(ast.parse(path.read_text(encoding="utf-8")))
        foreign += [f"{path.relative_to(ROOT)}: {name}" for name in listed if name not in defined]
    assert foreign == []


def _private_calls() -> dict[str, set[str]]:
    """Each private torch name ddpkit's code reaches for, with the files that do."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for pattern in (
            r"distributed_c10d\.(_\w+)",
            r"torch\._C\.(_\w+)",
            r"from torch\._C import (_\w+)",
            r"torch\.(_foreach_\w+)",
            r"torch\.ops\.",
            r"\"(_get_sequence_number_for_group)\"",
            r"\"(_dump_\w+)\"",
        ):
            for match in re.finditer(pattern, text):
                name = match.group(1) if match.groups() else match.group(0)
                found.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_every_private_torch_interface_is_listed_with_why() -> None:
    table = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = table.split("## Private interfaces", 1)[1].split("\n## ", 1)[0]
    unlisted = sorted(name for name in _private_calls() if name not in section)
    assert unlisted == [], "private interfaces without a line in docs/architecture.md"


def test_the_private_torch_interfaces_ddpkit_uses_are_there() -> None:
    # A torch release that drops one must fail here, by name, not degrade in silence.
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    assert callable(dist.distributed_c10d._get_default_store)
    assert callable(dist.ProcessGroup._get_sequence_number_for_group)
    assert callable(c10d._dump_fr_trace)
    assert callable(c10d._dump_nccl_trace)
