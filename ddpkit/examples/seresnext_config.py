"""The example's ``--config FILE``: a recipe in YAML or TOML as the flags' defaults.

A key is a flag's name without the dashes (``batch_size`` or ``batch-size``
for ``-b/--batch-size``); its value goes through the flag's own checks. The
command line wins over the file, the file over the built-in defaults, and
:func:`resolved` says for every flag which of the three gave its value. The
record goes into ``metrics.jsonl``'s run header, the trackers and every
checkpoint; :func:`resume_changes` compares a checkpoint's with this run's.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the same parser, from PyPI
    import tomli as tomllib

__all__ = [
    "BREAKS_RESUME",
    "CHANGES_RESUME",
    "apply_config",
    "load_config",
    "resolved",
    "resume_changes",
]

# A changed value here makes the rest of the run read other samples or another order
# than the uninterrupted run would: refused on --resume.
BREAKS_RESUME = ("batch_size", "seed", "data")
# A changed value here trains the rest of the run differently, which may be meant: a warning.
CHANGES_RESUME = (
    "min_crop",
    "mixup",
    "cutmix",
    "lr",
    "lr_base",
    "momentum",
    "weight_decay",
    "sched",
    "milestones",
    "warmup_epochs",
    "amp",
    "clip_grad",
    "model_ema",
    "model_ema_decay",
)
# Flags a file cannot set: they name the file, or say what to do with a run, not how to train.
_NOT_IN_FILE = ("help", "config")


def load_config(path: str) -> dict[str, Any]:
    """The flat table of ``path``: YAML (``.yaml``, ``.yml``) or TOML (``.toml``).

    Raises:
        ValueError: the file cannot be read or parsed, or is not one table of
            keys (the message names the file and what is wrong).
    """
    file = Path(path)
    kind = file.suffix.lower()
    if kind not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"{path}: a config file ends in .yaml, .yml or .toml, not {kind!r}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read ({exc})") from None
    try:
        if kind == ".toml":
            table = tomllib.loads(text)
        else:
            import yaml  # type: ignore[import-untyped]

            table = yaml.safe_load(text)
    except Exception as exc:  # yaml.YAMLError, tomllib.TOMLDecodeError
        raise ValueError(f"{path}: not valid {kind[1:].upper()}: {exc}") from None
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ValueError(f"{path}: holds a {type(table).__name__}, not a table of flag: value")
    return table


def apply_config(parser: argparse.ArgumentParser, path: str) -> dict[str, str]:
    """Make the values of the file at ``path`` the defaults of ``parser``'s flags.

    Each value is checked as the flag checks its own (its type, range and
    choices). Returns the destinations the file set. Errors go through
    ``parser.error``: one line, exit status 2, no traceback.
    """
    try:
        table = load_config(path)
    except ValueError as exc:
        parser.error(f"--config {exc}")
    actions = {
        a.dest: a for a in parser._actions if a.dest not in _NOT_IN_FILE and a.option_strings
    }
    values: dict[str, Any] = {}
    for key, value in table.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None:
            flags = [o for a in actions.values() for o in a.option_strings if o.startswith("--")]
            close = difflib.get_close_matches("--" + str(key).replace("_", "-"), flags, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            parser.error(
                f"--config {path}: unknown key {key!r}: no flag --{key}{hint} "
                "(a key is a flag's name without the dashes)"
            )
        values[dest] = _value(parser, action, value, f"--config {path}: {key}")
    parser.set_defaults(**values)
    return dict.fromkeys(values, "config")


def _value(parser: argparse.ArgumentParser, action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` as the flag of ``action`` would have parsed it, or ``parser.error``."""
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            parser.error(f"{where}: {action.option_strings[-1]} is a switch: true or false")
        return value
    if isinstance(value, dict) or (isinstance(value, list) and action.nargs not in ("*", "+")):
        parser.error(f"{where}: {action.option_strings[-1]} takes one value, got {value!r}")
    items = value if isinstance(value, list) else [value]
    parsed = []
    for item in items:
        converted: Any = item
        if action.type is not None and not isinstance(item, bool):
            try:
                converted = action.type(str(item))  # type: ignore[operator]
            except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                parser.error(f"{where}: {item!r}: {exc}")
        elif isinstance(item, bool) and action.type is not None:
            parser.error(f"{where}: {item!r} is not a number")
        if action.choices is not None and converted not in action.choices:
            choices = ", ".join(repr(c) for c in action.choices)
            parser.error(f"{where}: {converted!r} is not one of {choices}")
        parsed.append(converted)
    return parsed if isinstance(value, list) else parsed[0]


def given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations ``argv`` sets itself (argparse alone does not tell defaults apart)."""
    saved = {a.dest: a.default for a in parser._actions}
    table, parser._defaults = parser._defaults, {}  # set_defaults() writes here too
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        given, _ = parser.parse_known_args(list(argv))
    finally:
        parser._defaults = table
        for action in parser._actions:
            action.default = saved[action.dest]
    return set(vars(given))


def resolved(args: argparse.Namespace, sources: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Every flag's final value and where it came from: ``default``, ``config`` or ``command line``.

    Values are plain JSON values (lists, numbers, strings, None), so the
    record fits ``metrics.jsonl``, a tracker and a ``weights_only`` checkpoint.
    """
    out: dict[str, dict[str, Any]] = {}
    for dest, value in sorted(vars(args).items()):
        if dest.startswith("_"):
            continue
        plain: Any = value if isinstance(value, bool | int | float | str | type(None)) else None
        if isinstance(value, list | tuple):
            plain = [v if isinstance(v, bool | int | float | str) else str(v) for v in value]
        elif plain is None and value is not None:
            plain = str(value)
        out[dest] = {"value": plain, "source": sources.get(dest, "default")}
    return out


def resume_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(breaking, changing)``: the settings of :data:`BREAKS_RESUME` and :data:`CHANGES_RESUME`
    whose value differs between a checkpoint's record ``saved`` and this run's ``now``.

    Each is ``"--name <then> -> <now>"``. A setting either record lacks is not compared.
    """
    breaking: list[str] = []
    changing: list[str] = []
    for names, out in ((BREAKS_RESUME, breaking), (CHANGES_RESUME, changing)):
        for name in names:
            was, is_ = saved.get(name), now.get(name)
            if not isinstance(was, dict) or not isinstance(is_, dict):
                continue
            if was.get("value") != is_.get("value"):
                flag = "--" + name.replace("_", "-")
                out.append(f"{flag} {was.get('value')} -> {is_.get('value')}")
    return breaking, changing
