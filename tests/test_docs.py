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

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"

# ddpkit.testing is public but not re-exported from ddpkit.
TESTING_NAMES = {"run_distributed", "DistributedTestError"}
CLI_COMMANDS = {"ddpkit lmdb build", "ddpkit lmdb info", "ddpkit lmdb verify", "ddpkit doctor"}

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


@pytest.mark.parametrize("name", sorted(set(ddpkit.__all__) - {"__version__"} | TESTING_NAMES))
def test_api_md_signatures_match_the_code(name: str) -> None:
    import ddpkit.testing

    obj = getattr(ddpkit, name, None) or getattr(ddpkit.testing, name)
    if not callable(obj) or (isinstance(obj, type) and issubclass(obj, BaseException)):
        return  # constants and exceptions document no parameters
    documented = _documented_parameters(name)
    assert documented is not None, f"{name}: the code block shows no parameters"
    assert documented == list(inspect.signature(obj).parameters), name
