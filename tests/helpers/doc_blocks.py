"""The code blocks of README.md and docs/*.md, as the documentation tests run them.

A fenced ``python`` or ``bash`` block runs unless the line just above its fence
says otherwise, in an HTML comment a reader on GitHub does not see:

``<!-- doc-test: skip REASON -->``
    not run; REASON (two servers, a GPU, a download ...) is the skip reason.
``<!-- doc-test: signature -->``
    a signature display (``train_transform(size=224, *, ...)``): its
    parameter names are checked against the code instead.

A python block whose first line is ``# NAME.py`` is written to that file for
the shell blocks to run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = ("python", "bash")

_FENCE_OPEN = re.compile(r"^(```|~~~)(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*doc-test:\s*(skip|signature)\b\s*(.*?)\s*-->\s*$")
_HEADING = re.compile(r"^(#{1,4}) (.+?)\s*$")
_FILE_LINE = re.compile(r"^#\s*([\w.-]+\.py)\s*$")


@dataclass(frozen=True)
class Block:
    doc: str  # "docs/data.md", relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    section: str  # the nearest heading above, without #s and backticks
    key: str  # "data.md#Loaders/2": file name, section, and the block's ordinal in it when > 1
    kind: str  # "run", "skip", "signature", "file"
    reason: str = ""
    file_name: str = ""  # for kind "file": where the block is written

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path) -> list[Block]:
    """Every python and bash block of ``path``, in order."""
    doc = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    section = ""
    ordinal: dict[str, int] = {}
    i = 0
    while i < len(lines):
        heading = _HEADING.match(lines[i])
        if heading:
            section = heading.group(2).replace("`", "").strip()
            i += 1
            continue
        fence = _FENCE_OPEN.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence.group(1)):
            end += 1
        if end == len(lines):
            raise ValueError(f"{doc}:{i + 1}: a code block is never closed")
        lang = fence.group(2)
        code = "\n".join(lines[i + 1 : end]) + "\n"
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        if lang in RUNNABLE:
            ordinal[section] = ordinal.get(section, 0) + 1
            n = ordinal[section]
            key = f"{path.name}#{section}" + (f"/{n}" if n > 1 else "")
            kind, reason, file_name = "run", "", ""
            first = code.splitlines()[0] if code.strip() else ""
            if marker is not None:
                kind, reason = marker.group(1), marker.group(2)
            elif lang == "python" and _FILE_LINE.match(first):
                kind, file_name = "file", _FILE_LINE.match(first).group(1)  # type: ignore[union-attr]
            if kind == "skip" and not reason:
                raise ValueError(f"{doc}:{i + 1}: 'doc-test: skip' needs a reason")
            blocks.append(Block(doc, i + 1, lang, code, section, key, kind, reason, file_name))
        elif marker is not None:
            raise ValueError(f"{doc}:{i}: a doc-test marker above a {lang or 'plain'} block")
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in markdown_files() for block in parse(path)]
