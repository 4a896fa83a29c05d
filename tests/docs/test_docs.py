"""The documentation stays in step with the code.

The reference generated from the docstrings (docs/_build/reference.py, rendered
by ``make docs``) has an entry for every public name; every command of the
``ddpkit`` CLI is described in a guide; every relative link in README.md and
docs/*.md points to a file that exists.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from ddpkit.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]

# The public parts: each has its own reference page, and its face's __all__ lists its names.
PARTS = ("distributed", "data", "training", "checkpoint", "testing")
FACES = ("ddpkit", *(f"ddpkit.{part}" for part in PARTS))

# [text](target) and [text]: target, skipping images' alt text the same way.
_INLINE_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_DIRECTIVE = re.compile(r"^::: (\S+)\s*$", re.MULTILINE)


def _reference_pages() -> dict[str, str]:
    """What docs/_build/reference.py writes: each reference page's file name and text."""
    build = str(ROOT / "docs" / "_build")
    sys.path.insert(0, build)
    try:
        import reference  # type: ignore[import-not-found]
    finally:
        sys.path.remove(build)
    return reference.pages()  # type: ignore[no-any-return]


def _resolve(path: str) -> object:
    """The object a ``::: path`` directive renders."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            found = getattr(found, name)
        return found
    raise ImportError(path)


@functools.cache
def _rendered() -> frozenset[tuple[str, int]]:
    """(name, id of the object) of every entry of the reference pages.

    A directive names one object, or a module that mkdocstrings renders whole:
    then every name of the module's ``__all__``.
    """
    entries = set()
    for text in _reference_pages().values():
        for path in _DIRECTIVE.findall(text):
            found = _resolve(path)
            if isinstance(found, ModuleType):
                entries.update((n, id(getattr(found, n))) for n in found.__all__)
            else:
                entries.add((path.rsplit(".", 1)[1], id(found)))
    return frozenset(entries)


def test_there_is_a_reference_page_for_each_part() -> None:
    # and one for the top level's own names (Position, CommandLine ...)
    assert sorted(_reference_pages()) == sorted(f"{part}.md" for part in (*PARTS, "ddpkit"))


@pytest.mark.parametrize("face", FACES)
def test_the_reference_has_an_entry_for_every_public_name(face: str) -> None:
    module = importlib.import_module(face)
    rendered = _rendered()
    missing = [
        name
        for name in module.__all__
        if name != "__version__" and (name, id(getattr(module, name))) not in rendered
    ]
    assert missing == [], f"in {face}.__all__ but without an entry in docs/reference/"


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> Iterator[str]:
    """Every command the parser takes, sub-commands spelt out: "ddpkit lmdb build" ..."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield " ".join(words)
    for group in groups:
        for name, sub in group.choices.items():
            yield from _commands(sub, (*words, name))


CLI_COMMANDS = sorted(_commands(build_parser(), ("ddpkit",)))


def test_the_cli_commands_are_found() -> None:
    assert {"ddpkit lmdb build", "ddpkit lmdb verify", "ddpkit doctor"} <= set(CLI_COMMANDS)


def _guides() -> str:
    return " ".join(
        " ".join(path.read_text(encoding="utf-8").split()) for path in _markdown_files()
    )


@pytest.mark.parametrize("command", CLI_COMMANDS)
def test_every_cli_command_is_described_in_a_guide_and_has_help(command: str) -> None:
    assert command in _guides(), f"no page of README.md or docs/*.md describes {command}"
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command.split()[1:], "--help"])
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
