"""Run the code blocks of one markdown file: ``python doc_runner.py DOC TEMPLATE OUT.json``.

A child process of tests/docs/test_doc_code.py, so that what a block does to the
interpreter (a process group, signal handlers, environment variables, a
crash) stays out of the test run. A page is read top to bottom: its blocks
share one working directory, a copy of the template, so a file one block
writes is there for the next. Every block gets fresh names (``model``,
``train_loader`` ...) from doc_context, as each snippet is written to stand
on its own.

Each block's result goes to OUT.json as soon as it is known, so a block that
hangs past the parent's deadline still leaves the others' results.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import doc_context  # noqa: E402
from doc_blocks import ROOT, Block, parse  # noqa: E402
from doc_cases import ARRANGE, NOT_RAISED, substitute  # noqa: E402
from warm import share_server  # noqa: E402

SHELL_TIMEOUT = 240.0


class _Names(dict):  # type: ignore[type-arg]
    """The builders of doc_context.names(), resolved on first use."""

    def __init__(self, needs: set[str]) -> None:
        super().__init__()
        self.needs = needs
        self.builders = doc_context.names()

    def __missing__(self, name: str) -> Any:
        if name not in self.builders:
            raise KeyError(name)
        self[name] = value = self.builders[name](self)
        return value


def _free_names(tree: ast.AST) -> set[str]:
    stored: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            stored.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stored.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stored.update((a.asname or a.name).split(".")[0] for a in node.names)
    loaded = [
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    ]
    return {n for n in loaded if n not in stored and n not in dir(__builtins__)}


def _mark_handlers(tree: ast.Module) -> list[str]:
    """Make ``except ddpkit.X`` handlers record that they ran; return the X's."""
    names = []
    for node in tree.body:
        if not isinstance(node, ast.Try):
            continue
        for handler in node.handlers:
            if handler.type is None:
                continue
            name = ast.unparse(handler.type).rsplit(".", 1)[-1]
            names.append(name)
            record = ast.parse(f"__doc_caught__.append({name!r})").body[0]
            handler.body.insert(0, record)
    ast.fix_missing_locations(tree)
    return names


def _definitions_module(tree: ast.Module, name: str, where: Path) -> None:
    """Write the block's imports and definitions as module ``name``.

    A function a block defines and hands to ``spawn`` or ``run_distributed``
    is pickled by reference; the spawned process imports it from this file.
    """
    kept = [
        n
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
    ]
    source = "import ddpkit\nimport torch\n" + ast.unparse(ast.Module(kept, []))
    (where / f"{name}.py").write_text(source + "\n", encoding="utf-8")


class Runner:
    def __init__(self, doc: str, template: Path, out: Path) -> None:
        self.doc = doc
        self.template = template
        self.out = out
        self.results: dict[str, Any] = {}
        self.scratch = Path(tempfile.mkdtemp(prefix="ddpkit-doc-"))
        self.world: Path | None = None
        self.started = time.monotonic()
        self.env = dict(os.environ)

    def make_world(self) -> None:
        """A copy of the template in ``self.world``, the current directory."""
        self.world = self.scratch / "world"
        shutil.copytree(self.template, self.world, symlinks=True)
        sys.path.insert(0, str(self.world))
        os.chdir(self.world)

    def record(self, block: Block, **result: Any) -> None:
        seconds = round(time.monotonic() - self.started, 2)  # the block's, for the slowest list
        self.results[block.key] = {"where": block.where, "seconds": seconds, **result}
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1), encoding="utf-8")
        os.replace(tmp, self.out)

    def run(self) -> None:
        blocks = parse(ROOT / self.doc)
        self.make_world()
        for block in blocks:
            if block.kind in ("skip", "signature"):
                continue
            assert self.world is not None
            code = substitute(block)
            self.started = time.monotonic()
            arrange = ARRANGE.get(block.key)
            try:
                extra = arrange(self.world) if arrange else {}
            except Exception:
                self.record(block, ok=False, error="arranging failed:\n" + traceback.format_exc())
                continue
            if block.kind == "file":
                (self.world / block.file_name).write_text(code, encoding="utf-8")
                self.record(block, ok=True, written=block.file_name)
            elif block.lang == "bash":
                self.run_shell(block, code)
            else:
                self.run_python(block, code, extra or {})
            os.environ.clear()
            os.environ.update(self.env)
            os.chdir(self.world)

    def run_shell(self, block: Block, code: str) -> None:
        env = dict(self.env)
        # `python` runs forked from the suite's server (bin/python, warm.python_shim), and so
        # do torchrun's workers (`$PYTHON_EXEC -u SCRIPT`, see warm.torchrun_warm_env);
        # `ddpkit`, `torchrun` and the rest are the environment's own, started fresh.
        env["PATH"] = os.pathsep.join(
            [str(HERE / "bin"), str(Path(sys.executable).parent), env.get("PATH", "")]
        )
        env["PYTHON_EXEC"] = str(HERE / "bin" / "python")
        env["DDPKIT_TEST_PYTHON"] = sys.executable
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        try:
            done = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", code],
                cwd=self.world,
                env=env,
                capture_output=True,
                text=True,
                timeout=SHELL_TIMEOUT,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as e:
            self.record(
                block, ok=False, error=f"still running after {SHELL_TIMEOUT:.0f} s\n{e.stdout}"
            )
            return
        output = (done.stdout + done.stderr)[-6000:]
        self.record(block, ok=done.returncode == 0, rc=done.returncode, output=output)

    def run_python(self, block: Block, code: str, extra: dict[str, Any]) -> None:
        import ddpkit

        tree = ast.parse(code, filename=block.doc)
        ast.increment_lineno(tree, block.line)
        handled = _mark_handlers(tree)
        script = any(isinstance(n, ast.If) and "__name__" in ast.unparse(n.test) for n in tree.body)
        module_name = f"docblock_{block.line}"
        _definitions_module(tree, module_name, self.world)  # type: ignore[arg-type]
        names = _Names(_free_names(tree))
        names.update(extra)
        try:
            for name in sorted(names.needs):
                if name in names.builders:
                    names[name]
        except Exception:
            self.record(
                block, ok=False, error="building the names failed:\n" + traceback.format_exc()
            )
            return
        module = type(sys)(module_name)
        sys.modules[module_name] = module
        ns = module.__dict__
        ns.update(names)
        ns["__name__"] = "__main__" if script else module_name
        ns["__doc_caught__"] = caught = []
        error = None
        try:
            exec(compile(tree, block.doc, "exec"), ns)
            for name, value in list(ns.items()):
                if name.startswith("test_") and callable(value) and name in code:
                    value()  # a test the block defines, as pytest would run it
        except BaseException as e:
            reraised = type(e).__name__ in caught
            if not reraised:
                error = "".join(traceback.format_exception(e))
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(
                    sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
                )
            if ddpkit.get_world_size() > 1 or _initialized():
                ddpkit.shutdown()
        if error is None and handled and not caught:
            reason = NOT_RAISED.get(block.key)
            if reason is None:
                error = (
                    f"the example's `except {', '.join(handled)}` never ran: the code it "
                    "guards did not raise the error the docs say it raises"
                )
        self.record(block, ok=error is None, error=error, caught=caught)


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def main() -> None:
    doc, template, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    # A page's run_distributed(start_method="forkserver") and forkserver loaders start
    # from the suite's server (as its tests' ranks do), not from a fresh one per page.
    share_server()
    Runner(doc, template, out).run()


if __name__ == "__main__":
    main()
