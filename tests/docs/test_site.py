"""``make docs``: the site builds with ``--strict``, and its reference holds every public name.

The reference pages are generated from the faces' lists of names (docs/_build/reference.py,
committed as docs/reference/) and rendered from the docstrings by mkdocstrings; a broken link
or anchor in any page, or a docstring mkdocstrings cannot read, fails the build.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit
import ddpkit.testing

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    assert "WARNING" not in built.stderr, built.stderr[-4000:]
    return out


def test_the_reference_holds_every_public_name_from_its_docstring(site: Path) -> None:
    pages = "".join(p.read_text(encoding="utf-8") for p in (site / "reference").rglob("*.html"))
    anchors = set(re.findall(r'id="ddpkit\.[\w.]*?\.(\w+)"', pages))
    public = set(ddpkit.__all__) - {"__version__"} | set(ddpkit.testing.__all__)
    missing = sorted(public - anchors)
    assert missing == [], "public names without a reference entry"


def test_the_guides_link_into_each_reference_page(site: Path) -> None:
    text = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md"))
    for part in ("distributed", "data", "training", "checkpoint", "testing"):
        assert re.search(rf"\]\(reference/{part}\.md[#)]", text), part
        assert (site / "reference" / part / "index.html").is_file(), part


def test_the_committed_reference_pages_are_what_the_generator_writes() -> None:
    sys.path.insert(0, str(ROOT / "docs" / "_build"))
    try:
        import reference  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "docs" / "_build"))
    for name, text in reference.pages().items():
        page = (ROOT / "docs" / "reference" / name).read_text(encoding="utf-8")
        assert page.endswith(text), f"docs/reference/{name}: run python docs/_build/reference.py"
