"""Public names that load on first use, each listed once: the ``__getattr__`` of ddpkit's faces.

``import ddpkit`` and ``import ddpkit.data`` import nothing heavy; a name's
module loads when the name is first read (PEP 562). So ``ddpkit plot`` reads a
run's metrics without importing torch, and ``ddpkit lmdb info`` without the
transforms' torchvision.

A face lists each public name once, as an import of its ``if TYPE_CHECKING:``
block: ``from ddpkit.data.loaders import build_loader as build_loader``. Type
checkers read that line; the redundant alias marks the name as re-exported
(mypy ``--strict``, the typing spec). At run time :func:`lazy_names` reads the
same lines back from the face's source and builds the face's ``__getattr__``,
``__dir__`` and ``__all__`` from them. ``from ddpkit.data import *`` in such a
block takes every name of that face (how the top level re-exports the parts),
and an aliased import outside the block (``__version__``) is public as well.

The face assigns what :func:`lazy_names` returns under ``if not TYPE_CHECKING:``:
mypy takes an ``__all__`` it cannot read as exporting nothing, which would hide
every name from ``from ddpkit.data import *`` and from users' ``from ddpkit import *``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from ddpkit import _graveyard


def lazy_names(
    package: str, file: str
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for the face ``package``, whose source is ``file``.

    ``__all__`` is the face's public names, sorted: those its ``TYPE_CHECKING``
    block imports and those it imports with a redundant alias. A name the face
    does not hold falls through to the names earlier releases had there
    (``_graveyard``), and past those is an ``AttributeError``.

    Raises:
        ImportError: a name is listed twice (within the face, or in two faces
            that a star import brings together).
    """
    with open(file, encoding="utf-8") as source:
        homes = _public_names(ast.parse(source.read(), file), package)
    where = {name: home for name, home in homes.items() if home is not None}

    def __getattr__(name: str) -> Any:
        home = where.get(name)
        if home is None:
            return _graveyard.moved_name(package, name)
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(homes)


def _public_names(tree: ast.Module, package: str) -> dict[str, str | None]:
    """Each public name of a face -> the module that holds it (None: the face binds it itself)."""
    listed: list[tuple[str, str | None]] = []
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom):  # bound at import: public if re-exported
            listed += [(a.name, None) for a in statement.names if a.asname == a.name]
        elif isinstance(statement, ast.If) and _is_type_checking(statement.test):
            for node in statement.body:
                if isinstance(node, ast.ImportFrom):
                    listed += _imported_names(node, package)
    homes: dict[str, str | None] = {}
    for name, home in listed:
        if name in homes:
            raise ImportError(
                f"{package} lists {name!r} twice (from {homes[name] or package} and "
                f"{home or package}); a public name has one home"
            )
        homes[name] = home
    return homes


def _imported_names(node: ast.ImportFrom, package: str) -> list[tuple[str, str]]:
    """(name, module) for each name ``from module import ...`` brings in; ``*``: a face's all."""
    module = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
    names: list[tuple[str, str]] = []
    for alias in node.names:
        if alias.name == "*":  # a part's face, imported now: it loads nothing heavy
            names += [(name, module) for name in importlib.import_module(module).__all__]
        else:
            names.append((alias.asname or alias.name, module))
    return names


def _is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` tests ``TYPE_CHECKING`` (or ``typing.TYPE_CHECKING``)."""
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
