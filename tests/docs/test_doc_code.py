"""The documentation's code runs: every python and shell block of README.md and docs/*.md.

Each markdown file's blocks run in one child process (tests/helpers/doc_runner.py)
in a small world of shape images, LMDB files and a checkpoint
(tests/helpers/doc_context.py), with the docs' big figures scaled down by the
substitutions of tests/helpers/doc_cases.py. A block that cannot run here (two
servers, a GPU, a download) carries ``<!-- doc-test: skip REASON -->``; a
signature display carries ``<!-- doc-test: signature -->`` and its parameter
names are checked against the code. An ``except ddpkit.X`` example must take
its except branch: the error it documents is really raised.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from doc_blocks import Block, all_blocks  # type: ignore[import-not-found]
from doc_cases import ARRANGE, NOT_RAISED, unused_substitutions  # type: ignore[import-not-found]
from warm import warm_popen, warm_run  # type: ignore[import-not-found]

HERE = Path(__file__).resolve().parents[1] / "helpers"
BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.kind in ("run", "file")]
SIGNATURES = [b for b in BLOCKS if b.kind == "signature"]
# One child per markdown file; the slowest (quickstart: two training runs under
# python and torchrun, two of the example) takes about a minute here.
FILE_TIMEOUT = 600.0


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(HERE))
    import doc_context  # type: ignore[import-not-found]

    root = tmp_path_factory.mktemp("doc-world")
    # Written in a child: build_lmdb and CheckpointManager start threads and
    # pools this test process has no use for.
    code = (
        f"import sys, pathlib; sys.path.insert(0, {str(HERE)!r}); import doc_context; "
        f"doc_context.make_world(pathlib.Path({str(root)!r}))"
    )
    made = warm_run([sys.executable, "-c", code], timeout=300)
    assert made.returncode == 0, f"making the doc world failed ({made.returncode})"
    del doc_context
    return root


_results: dict[str, dict[str, Any]] = {}


def _pythonpath() -> str:
    """The helpers first, then whatever the suite itself was given (a checkout under test)."""
    return os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)


def _run_file(doc: str, world: Path, tmp: Path) -> dict[str, Any]:
    if doc not in _results:
        out = tmp / (doc.replace("/", "_") + ".json")
        env = dict(os.environ, PYTHONPATH=_pythonpath())
        try:
            # Forked from the suite's preloaded server (tests/helpers/warm.py), in a session
            # of its own as a terminal's job; the page's shell blocks start fresh processes.
            process = warm_popen(
                [sys.executable, str(HERE / "doc_runner.py"), doc, str(world), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                stdout, stderr = process.communicate(FILE_TIMEOUT)
            finally:
                process.kill()
            tail = (stdout + stderr)[-4000:]
        except subprocess.TimeoutExpired:
            tail = f"the blocks of {doc} were still running after {FILE_TIMEOUT:.0f} s"
        results = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
        results["__tail__"] = tail
        _results[doc] = results
    return _results[doc]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where)
def test_doc_block_runs(
    block: Block, world: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = _run_file(block.doc, world, tmp_path_factory.mktemp("doc-results"))
    result = results.get(block.key)
    assert result is not None, (
        f"{block.where} ({block.key}) never finished; the runner's output:\n{results['__tail__']}"
    )
    detail = result.get("error") or result.get("output") or ""
    assert result["ok"], f"{block.where} ({block.key}) failed:\n{detail}"


def test_blocks_are_found_and_most_of_them_run() -> None:
    skipped = [b for b in BLOCKS if b.kind == "skip"]
    assert len(RUNNABLE) >= 25, "the extraction finds too few blocks"
    assert len(skipped) < len(RUNNABLE), [b.where for b in skipped]
    assert {b.lang for b in RUNNABLE} == {"python", "bash"}


def test_every_skip_says_why() -> None:
    for block in BLOCKS:
        if block.kind == "skip":
            assert len(block.reason) >= 10, f"{block.where}: skip without a reason"


def test_substitutions_and_arrangements_still_apply() -> None:
    assert unused_substitutions(BLOCKS) == []
    keys = {b.key for b in RUNNABLE}
    assert sorted(set(ARRANGE) - keys) == [], "arranged blocks that no longer exist"
    assert sorted(set(NOT_RAISED) - keys) == [], "NOT_RAISED names blocks that no longer exist"


def test_keys_are_unique() -> None:
    keys = [b.key for b in BLOCKS]
    assert len(keys) == len(set(keys))


_CALL = re.compile(r"^(?:ddpkit\.)?(\w+)\((.*)\)\s*(?:->.*)?$", re.DOTALL)


def _statements(code: str) -> list[str]:
    """The block's statements, a call spread over lines joined, comments dropped."""
    out, current, depth = [], "", 0
    for line in code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).rstrip()
        if not line or line.startswith("#"):
            continue
        current = f"{current} {line.strip()}" if current else line.strip()
        depth += line.count("(") - line.count(")")
        if depth <= 0:
            out.append(current)
            current, depth = "", 0
    return out


def _public_callable(name: str) -> Any:
    import ddpkit.testing

    return getattr(ddpkit, name, None) or getattr(ddpkit.testing, name, None)


@pytest.mark.parametrize("block", SIGNATURES, ids=lambda b: b.where)
def test_signature_displays_match_the_code(block: Block) -> None:
    checked = 0
    for statement in _statements(block.code):
        match = _CALL.match(statement)
        target = _public_callable(match.group(1)) if match else None
        if target is None:
            continue  # a usage line (criterion(logits, target)), not a signature
        definition = ast.parse(f"def f({match.group(2)}): ...").body[0]  # type: ignore[union-attr]
        assert isinstance(definition, ast.FunctionDef)
        a = definition.args
        shown = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        shown += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
        real = [p for p in inspect.signature(target).parameters if p != "self"]
        assert shown == real, f"{block.where}: {match.group(1)} shows {shown}, the code has {real}"  # type: ignore[union-attr]
        checked += 1
    assert checked, f"{block.where}: a signature block with no public function in it"


_BROKEN = """# A page of mistakes

## Fails

```python
raise RuntimeError("a mistake in the docs")
```

## Catches nothing

```python
try:
    ddpkit.get_rank()
except ddpkit.RendezvousError as e:
    print(e)
```

## Shell

```bash
ddpkit lmdb info no-such.lmdb
```

## Fine

```python
assert ddpkit.get_world_size() == 1
```
"""


def test_the_runner_reports_what_fails(world: Path, tmp_path: Path) -> None:
    page = tmp_path / "broken.md"
    page.write_text(_BROKEN, encoding="utf-8")
    out = tmp_path / "out.json"
    done = warm_run(
        [sys.executable, str(HERE / "doc_runner.py"), str(page), str(world), str(out)],
        env=dict(os.environ, PYTHONPATH=_pythonpath()),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text(encoding="utf-8"))
    assert {k: v["ok"] for k, v in results.items()} == {
        "broken.md#Fails": False,
        "broken.md#Catches nothing": False,
        "broken.md#Shell": False,
        "broken.md#Fine": True,
    }
    assert f'{page}", line 6' in results["broken.md#Fails"]["error"]  # the doc's own line
    assert "never ran" in results["broken.md#Catches nothing"]["error"]
    assert "no such LMDB database" in results["broken.md#Shell"]["output"]
