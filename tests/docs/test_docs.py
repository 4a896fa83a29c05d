"""The documentation stays in step with the code.

docs/api.md documents every public name, and nothing else, with the parameters
the code has; every relative link in README.md and docs/*.md points to a file
that exists.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import ddpkit
from ddpkit.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"

# ddpkit.testing is public but not re-exported from ddpkit.
TESTING_NAMES = {"run_distributed", "DistributedTestError"}
CLI_COMMANDS = {
    "ddpkit lmdb build",
    "ddpkit lmdb info",
    "ddpkit lmdb verify",
    "ddpkit doctor",
    "ddpkit plot",
}

_HEADING = re.compile(r"^### (.+?)\s*$", re.MULTILINE)
# [text](target) and [text]: target, skipping images' alt text the same way.
_INLINE_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _api_headings() -> list[str]:
    text = _FENCE.sub("", API.read_text(encoding="utf-8"))
    return [h.strip().strip("`").strip() for h in _HEADING.findall(text)]


def test_api_md_documents_exactly_the_public_names() -> None:
    headings = _api_headings()
    names = {h for h in headings if h.isidentifier()}
    expected = (set(ddpkit.__all__) - {"__version__"}) | TESTING_NAMES
    assert sorted(names - expected) == [], "documented in docs/api.md but not public"
    assert sorted(expected - names) == [], "public but missing from docs/api.md"
    assert len(names) == len([h for h in headings if h.isidentifier()]), "a name appears twice"


def test_testing_names_exist() -> None:
    import ddpkit.testing

    for name in TESTING_NAMES:
        assert hasattr(ddpkit.testing, name), name


def test_api_md_documents_the_cli_commands() -> None:
    commands = {h for h in _api_headings() if not h.isidentifier()}
    assert commands == CLI_COMMANDS
    parser = build_parser()
    for command in CLI_COMMANDS:
        args = command.split()[1:]
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([*args, "--help"])
        assert exit_info.value.code == 0, command


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    targets = _INLINE_LINK.findall(text) + _REF_LINK.findall(text)
    return [
        t
        for t in targets
        if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t)  # http:, https:, mailto: ...
        and not t.startswith("#")
    ]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files(path: Path) -> None:
    missing = []
    for target in _relative_links(path):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if file_part and not (path.parent / file_part).exists():
            missing.append(target)
    assert missing == [], f"{path.relative_to(ROOT)} links to missing files"


def _documented_parameters(name: str) -> list[str] | None:
    """The parameter names in the first code block under ``### `name` ``, or None."""
    text = API.read_text(encoding="utf-8")
    section = text.split(f"### `{name}`", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, f"{name}: no code block"
    tree = ast.parse(block.group(1))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            return [n for n in names if n != "self"]
    fields = [n.target.id for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)]
    return [n for n in fields if isinstance(n, str)] or None  # type: ignore[attr-defined]


def _public(name: str) -> object:
    import ddpkit.testing

    return getattr(ddpkit, name, None) or getattr(ddpkit.testing, name)


def _is_exception(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseException)


PUBLIC = sorted(set(ddpkit.__all__) - {"__version__"} | TESTING_NAMES)
EXCEPTIONS = [n for n in PUBLIC if _is_exception(_public(n))]
CONSTANTS = [n for n in PUBLIC if not callable(_public(n))]
CALLABLES = [n for n in PUBLIC if n not in EXCEPTIONS and n not in CONSTANTS]


def test_every_public_name_is_checked_one_way() -> None:
    assert sorted(EXCEPTIONS + CONSTANTS + CALLABLES) == PUBLIC
    assert EXCEPTIONS
    assert CONSTANTS


@pytest.mark.parametrize("name", CALLABLES)
def test_api_md_signatures_match_the_code(name: str) -> None:
    documented = _documented_parameters(name)
    assert documented is not None, f"{name}: the code block shows no parameters"
    assert documented == list(inspect.signature(_public(name)).parameters), name  # type: ignore[arg-type]


def _first_block(name: str) -> str:
    section = API.read_text(encoding="utf-8").split(f"### `{name}`", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, f"{name}: no code block"
    return block.group(1)


@pytest.mark.parametrize("name", EXCEPTIONS)
def test_api_md_shows_each_exception_with_its_base(name: str) -> None:
    cls = _public(name)
    assert isinstance(cls, type)
    definition = ast.parse(_first_block(name)).body[0]
    assert isinstance(definition, ast.ClassDef), name
    assert definition.name == name
    bases = [ast.unparse(b) for b in definition.bases]
    assert bases == [cls.__bases__[0].__name__], name


@pytest.mark.parametrize("name", CONSTANTS)
def test_api_md_shows_each_constant_with_its_value(name: str) -> None:
    assignment = ast.parse(_first_block(name)).body[0]
    assert isinstance(assignment, ast.Assign), name
    assert ast.literal_eval(assignment.value) == _public(name)


def _anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")


def _used_anchors() -> set[str]:
    anchors = set()
    for path in (ROOT / "ddpkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "see":
                anchors.add(ast.literal_eval(node.args[0]))
    return anchors


def test_error_messages_point_to_sections_that_exist() -> None:
    guide = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    headings = {_anchor(h) for h in re.findall(r"^#{2,4} (.+)$", guide, re.MULTILINE)}
    used = _used_anchors()
    assert len(used) >= 5, "the check finds too few see() calls"
    assert sorted(used - headings) == []


def test_make_demo_writes_under_demo_out_only_and_the_quickstart_shows_its_curves() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    target = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "--demo --out demo-out" in target
    assert "docs/" not in target  # a tracked file is never overwritten by a run
    png = ROOT / "docs" / "demo-curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    quickstart = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    assert "](demo-curves.png)" in quickstart
    assert re.search(r"^epoch 8/8: train_loss .* data wait \d+%, [\d.]+ s$", quickstart, re.M)


def test_the_readme_says_what_the_quickstarts_demo_run_printed() -> None:
    quickstart = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    run = re.search(r"demo: final val acc1 ([\d.]+)% .* total wall time ([\d.]+) s", quickstart)
    assert run is not None
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    said = re.search(r"\((\d+)% in under (\d+) minutes on a 2-core CPU machine", readme)
    assert said is not None, "the README's demo figures"
    assert int(said.group(1)) == round(float(run.group(1)))
    assert float(run.group(2)) < 60 * int(said.group(2))
