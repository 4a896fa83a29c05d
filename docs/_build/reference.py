"""Write the reference pages, docs/reference/<part>.md: one per part of ddpkit, one entry per name.

``python docs/_build/reference.py`` (``make docs`` runs it first). Each part's face lists
its public names once (``ddpkit._lazy``); each page is generated from that list, and
mkdocstrings renders each entry from the docstring of the module that defines it.
``tests/docs/test_site.py`` fails when a committed page is not what this writes.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("distributed", "data", "training", "checkpoint")


def _entries(face: str) -> list[str]:
    """``module.name`` of each public name of ``face``, in the face's order."""
    from ddpkit._lazy import _public_names

    module = importlib.import_module(face)
    assert module.__file__ is not None
    with open(module.__file__, encoding="utf-8") as source:
        homes = _public_names(ast.parse(source.read()), face)
    return [f"{home}.{name}" for name, home in homes.items() if home is not None]


def pages() -> dict[str, str]:
    """Each reference page's file name and text."""
    parts = tuple(f"ddpkit.{part}." for part in PARTS)
    made = {}
    for part in PARTS:
        face = f"ddpkit.{part}"
        summary = (importlib.import_module(face).__doc__ or "").split("\n\n")[0]
        lines = [f"# `{face}`", "", summary, "", *(f"::: {entry}" for entry in _entries(face))]
        made[f"{part}.md"] = "\n".join(lines) + "\n"
    # The top level's own names (Position, CommandLine ...): a page of their own.
    own = [f"::: {e}" for e in _entries("ddpkit") if not e.startswith(parts)]
    top = "Names of the top level beside the four parts': a run's place and a script's flags."
    made["ddpkit.md"] = "\n".join(["# `ddpkit`", "", top, "", *own]) + "\n"
    made["testing.md"] = "# `ddpkit.testing`\n\n::: ddpkit.testing\n"
    return made


def main() -> None:
    out = ROOT / "docs" / "reference"
    out.mkdir(exist_ok=True)
    note = "<!-- Written by docs/_build/reference.py: run it, do not edit this page. -->\n"
    for name, text in pages().items():
        (out / name).write_text(note + text, encoding="utf-8")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
