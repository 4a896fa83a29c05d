"""The example's ``--config FILE``: a recipe in YAML or TOML as the flags' defaults.

A key is a flag's name without the dashes (``batch_size`` or ``batch-size``
for ``-b/--batch-size``); its value goes through the flag's own parsing, as
its text on the command line would (``milestones: 5`` is ``--milestones 5``,
``network: 7`` is ``--network 7``); ``null`` leaves a flag whose default is
None at it. A bad file or value is one line naming the file and the key, exit
status 2, before anything is built. The file must be a regular file of at most
:data:`MAX_BYTES` of UTF-8 text.

:func:`parse_with_config` parses a command line: it wins over the file, the
file over the built-in defaults, and ``args.sources`` says which of the three
gave each value; :func:`resolved` makes that the run's record, which goes into
``metrics.jsonl``'s run header, the trackers and every checkpoint, and
:func:`resume_changes` compares a checkpoint's with this run's. argparse keeps
its list of flags to itself, so the caller passes them (:class:`Flags`).
"""

from __future__ import annotations

import argparse
import codecs
import difflib
import os
import re
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the same parser, from PyPI
    import tomli as tomllib

__all__ = [
    "BREAKS_RESUME",
    "CHANGES_RESUME",
    "MAX_BYTES",
    "Flags",
    "apply_config",
    "load_config",
    "parse_with_config",
    "refuse",
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
    "grad_accum_steps",
    "clip_grad",
    "model_ema",
    "model_ema_decay",
)
# The largest config file read: a recipe is a few hundred bytes; more is the wrong file.
MAX_BYTES = 1 << 20
# Flags a file cannot set: they name the file, or say what to do with a run, not how to train.
_NOT_IN_FILE = ("help", "config")


@dataclass(frozen=True)
class Flags:
    """A command line's flags, as the config code needs them; argparse keeps its own list private.

    Attributes:
        parser: the parser of the command line: its defaults, ``--help``, its errors.
        actions: every flag but ``--help``, as ``add_argument`` returned it.
        exclusive: the destinations of each group of flags that exclude each other.
        bare: the same flags on a parser without defaults or ``--help`` whose errors
            raise ``argparse.ArgumentError``: what a command line, or one flag's
            text, gives by itself.
    """

    parser: argparse.ArgumentParser
    actions: tuple[argparse.Action, ...]
    exclusive: tuple[tuple[str, ...], ...]
    bare: argparse.ArgumentParser


def parse_with_config(flags: Flags, argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` over ``--config FILE`` over the built-in defaults.

    The namespace holds every flag's value and ``sources``: the destinations the
    file or the command line set, each with ``"config"`` or ``"command line"``.
    A flag the command line gives drops the file's value of a flag it excludes
    (``--lr`` on the command line, ``lr_base`` in the file); a file that sets two
    such flags is refused. Errors end the program with exit status 2: argparse's
    own for the command line, one line naming the key for the file.
    """
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config")
    path = first.parse_known_args(argv)[0].config
    builtin = {a.dest: a.default for a in flags.actions}
    sources = apply_config(flags, path) if path is not None else {}
    args = flags.parser.parse_args(argv)
    # What argv sets itself: argparse alone does not tell a default from a given value.
    given = set(vars(flags.bare.parse_known_args(argv)[0]))
    switches = {a.dest for a in flags.actions if a.nargs == 0}
    for dests in flags.exclusive:
        # A switch the file leaves off (requires_grad: false) excludes nothing, as on the
        # command line, where it is not given.
        from_file = {
            d
            for d in set(dests) & set(sources)
            if d not in switches or flags.parser.get_default(d) != builtin[d]
        }
        if given & set(dests):  # --lr on the command line drops the file's --lr-base
            for dest in from_file - given:
                setattr(args, dest, builtin[dest])
                del sources[dest]
        elif len(from_file) > 1:
            both = " and ".join(f"--{d.replace('_', '-')}" for d in sorted(from_file))
            refuse(
                flags.parser, f"--config {path}: sets {both}, which exclude each other: keep one"
            )
    args.sources = {**sources, **dict.fromkeys(given, "command line")}
    return args


def load_config(path: str) -> dict[str, Any]:
    """The flat table of ``path``: YAML (``.yaml``, ``.yml``) or TOML (``.toml``).

    Only a regular file (after links) of at most :data:`MAX_BYTES` of UTF-8
    text is read: a device, a FIFO or a socket is refused before it is opened,
    so nothing waits or fills the memory.

    Raises:
        ValueError: the file is missing, not a regular file, too large,
            unreadable, not UTF-8, empty, not valid YAML or TOML, or not one
            table of keys (one line naming the file, what is wrong and the fix).
    """
    kind = Path(path).suffix.lower()
    if kind not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"{path}: a config file ends in .yaml, .yml or .toml, not {kind!r}")
    text = _read_text(path)
    try:
        if kind == ".toml":
            table = tomllib.loads(text)
        else:
            import yaml  # type: ignore[import-untyped]

            table = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader: no objects
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to be a table of flag: value") from None
    except Exception as exc:  # yaml.YAMLError, tomllib.TOMLDecodeError, a bad date
        raise ValueError(f"{path}: not valid {kind[1:].upper()}: {_syntax(exc)}") from None
    if table is None or table == {}:
        raise ValueError(f"{path}: holds no flag: value; write one per line, or drop --config")
    if not isinstance(table, dict):
        raise ValueError(f"{path}: holds a {type(table).__name__}, not a table of flag: value")
    return table


def apply_config(flags: Flags, path: str) -> dict[str, str]:
    """Make the values of the file at ``path`` the defaults of ``flags.parser``.

    Each value goes through its flag's own parsing, as the command line's text
    would (its ``type``, ``nargs``, ``choices`` and action): a number for a
    text flag is its text, a single value for a list flag one item, a switch
    ``true`` or ``false``, and ``null`` a flag's default where that is None.
    Returns the destinations the file set. An error is one line on stderr
    naming the file and the key, and exit status 2 (:func:`refuse`).
    """
    parser = flags.parser
    try:
        table = load_config(path)
    except ValueError as exc:
        refuse(parser, f"--config {exc}")
    actions = _file_actions(flags.actions)
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, value in table.items():
        name = str(key)
        action = actions.get(name.replace("-", "_"))
        if action is None and name.replace("-", "_") in _NOT_IN_FILE:
            refuse(
                parser,
                f"--config {path}: key {_shown(name)}: --{name} is for the command line only",
            )
        if action is None:
            known = sorted({o for a in actions.values() for o in a.option_strings if o[:2] == "--"})
            close = difflib.get_close_matches("--" + name.replace("_", "-"), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            refuse(
                parser,
                f"--config {path}: unknown key {_shown(name)}: no flag --{name}{hint} "
                "(a key is a flag's name without the dashes)",
            )
        where = f"--config {path}: key {_shown(name)}"
        flag = _flag(action)
        if action.dest in keys:
            refuse(parser, f"{where}: {flag} is set twice, also as {keys[action.dest]!r}: keep one")
        keys[action.dest] = name
        if value is None:
            if action.default is None:
                continue  # the flag's default, as if the key were not there
            refuse(
                parser,
                f"{where}: null, and {flag} has no empty value (its default is "
                f"{_shown(action.default)}): give a value or drop the key",
            )
        try:
            values[action.dest] = _value(flags.bare, action, value)
        except _Refused as exc:
            refuse(parser, f"{where}: {_shown(value)}: {exc}")
    parser.set_defaults(**values)
    return dict.fromkeys(values, "config")


def refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """End the program as argparse does, with ``message`` on one line of stderr: exit status 2.

    Unlike ``parser.error`` no usage is printed: the line says what to change in the file.
    """
    line = " ".join(message.split())
    if len(line) > _WIDTH:
        line = line[: _WIDTH - 3] + "..."
    parser.exit(2, f"{parser.prog}: error: {line}\n")


class _Refused(Exception):
    """A config value its flag does not take; the message says why."""


def _file_actions(flags: Sequence[argparse.Action]) -> dict[str, argparse.Action]:
    """The flags a file may set, by destination and by each long name (``wd``, ``weight_decay``)."""
    actions: dict[str, argparse.Action] = {}
    for action in flags:
        if not action.option_strings or action.dest in _NOT_IN_FILE:
            continue
        actions[action.dest] = action
        for option in action.option_strings:
            if option.startswith("--"):
                actions.setdefault(option[2:].replace("-", "_"), action)
    return actions


def _value(bare: argparse.ArgumentParser, action: argparse.Action, value: Any) -> Any:
    """``value`` as ``action``'s flag parses it from the command line, or :class:`_Refused`.

    ``bare`` parses the flag's text (:attr:`Flags.bare`).
    """
    flag = _flag(action)
    if action.nargs == 0:  # a switch: store_true, store_false, store_const
        if not isinstance(value, bool):
            raise _Refused(f"{flag} is a switch: true or false")
        if isinstance(action.const, bool):
            return value  # the destination's own value (store_false's too)
        return _act(bare, action, []) if value else action.default
    if isinstance(value, Mapping):
        raise _Refused(f"{flag} takes {_what(action)}, not a table")
    if isinstance(value, list | tuple):
        if action.nargs in (None, "?"):
            raise _Refused(f"{flag} takes one value ({_what(action)}), not a list")
        tokens = [_token(action, item) for item in value]
    elif isinstance(value, bool) and action.nargs == "?" and action.const is not None:
        if not value:
            if action.default not in (False, None):
                raise _Refused(f"{flag} takes {_what(action)}")
            return action.default  # off
        tokens = []  # the flag alone: its const
    else:
        tokens = [_token(action, value)]
    if action.nargs == "+" and not tokens:
        raise _Refused(f"{flag} takes at least one value")
    if isinstance(action.nargs, int) and len(tokens) != action.nargs:
        raise _Refused(f"{flag} takes {action.nargs} values, got {len(tokens)}")
    return _act(bare, action, tokens)


def _act(bare: argparse.ArgumentParser, action: argparse.Action, tokens: list[str]) -> Any:
    """Parse ``tokens`` as the text after ``action``'s flag: its type, choices and action."""
    flag = action.option_strings[-1]
    # --flag=TEXT: a value that starts with a dash stays a value. A list's items go alone
    # first, so a bad one is named as the flag names it, then the list as a whole.
    if len(tokens) == 1 and action.nargs in (None, "?"):
        lines = [[f"{flag}={tokens[0]}"]]
    else:
        each = [[f"{flag}={token}"] for token in tokens] if action.nargs in ("*", "+") else []
        lines = [*each, [flag, *tokens]]
    for line in lines:
        try:
            parsed, rest = bare.parse_known_args(line)
        except argparse.ArgumentError as exc:
            said = f"{exc.argument_name}: {exc.message}" if exc.argument_name else exc.message
            raise _Refused(said) from None
        if rest:  # an item a command line would take for another flag
            raise _Refused(f"{_flag(action)}: {rest[0]!r} is not a value of it")
    return getattr(parsed, action.dest)


def _token(action: argparse.Action, item: Any) -> str:
    """The command-line text of one config value: text as it is, a number as it is written."""
    if isinstance(item, bool):
        raise _Refused(f"{_flag(action)} takes {_what(action)}, not true or false (quote text)")
    if isinstance(item, str):
        return item
    if isinstance(item, int):
        return str(item)
    if isinstance(item, float):
        return repr(item)
    kind = "a table" if isinstance(item, Mapping) else f"a {type(item).__name__}"
    raise _Refused(f"{_flag(action)} takes {_what(action)}, not {kind} (quote text)")


def _flag(action: argparse.Action) -> str:
    return "/".join(action.option_strings)


def _what(action: argparse.Action) -> str:
    """What the flag takes, in its help's words: ``N``, ``{step,cosine}``, ``a value``."""
    if action.choices is not None:
        return "one of " + ", ".join(map(str, action.choices))
    metavar = action.metavar if isinstance(action.metavar, str) else None
    return metavar or "a value"


def _read_text(path: str) -> str:
    """The text of the regular file at ``path``, or a ``ValueError`` of one line."""
    link = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    try:
        _check_file(path, os.stat(path), link)
        # O_NONBLOCK: a FIFO put in the file's place since the look above does not wait.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        with os.fdopen(os.open(path, flags), "rb") as file:
            _check_file(path, os.fstat(file.fileno()), link)
            data = file.read(MAX_BYTES + 1)
    except FileNotFoundError:
        what = f"is a link to {os.readlink(path)!r}, which does not exist" if link else "not found"
        raise ValueError(f"{path}: {what}; check the path") from None
    except PermissionError:
        raise ValueError(f"{path}{link}: cannot be read: permission denied; chmod u+r it") from None
    except OSError as exc:
        raise ValueError(f"{path}{link}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_BYTES:
        raise ValueError(f"{path}{link}: {_too_big()}")
    data = data.removeprefix(codecs.BOM_UTF8)
    if not data.strip():
        raise ValueError(f"{path}{link}: is empty; write flag: value lines, or drop --config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{path}{link}: is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
            "save it as UTF-8"
        ) from None


def _check_file(path: str, info: os.stat_result, link: str) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path}{link}: is a directory; name the .yaml or .toml file in it")
    if not stat.S_ISREG(info.st_mode):
        kind = next((k for test, k in _SPECIAL if test(info.st_mode)), "special file")
        raise ValueError(
            f"{path}{link}: is a {kind}, not a regular file; write the flags to a file "
            "and pass that"
        )
    if info.st_size > MAX_BYTES:
        raise ValueError(f"{path}{link}: {_too_big(info.st_size)}")


def _too_big(size: int | None = None) -> str:
    held = f"{size} bytes" if size is not None else "more"
    return (
        f"holds {held}, and a config file holds at most {MAX_BYTES >> 20} MiB of flag: value; "
        "is it the right file?"
    )


def _syntax(exc: Exception) -> str:
    """A parser's complaint on one line, with where it is (YAML's own spans several)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _yaml_loader() -> type:
    """PyYAML's safe loader, less YAML 1.1's base-60 numbers: ``profile_steps: 10:20``
    stays the text ``"10:20"`` instead of the number 620."""
    import yaml

    class Loader(yaml.SafeLoader):  # type: ignore[misc]
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBER_TAGS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    for tag, pattern in _NUMBER_TAGS.items():
        Loader.add_implicit_resolver(tag, re.compile(pattern, re.X), list("-+0123456789."))
    return Loader


# PyYAML's int and float patterns without their sexagesimal (base-60) branches.
_NUMBER_TAGS = {
    "tag:yaml.org,2002:int": r"""^(?:[-+]?0b[0-1_]+
        |[-+]?0[0-7_]+
        |[-+]?(?:0|[1-9][0-9_]*)
        |[-+]?0x[0-9a-fA-F_]+)$""",
    "tag:yaml.org,2002:float": r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
        |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
}
_SPECIAL = (
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISSOCK, "socket"),
)
# One line of an error: values and keys are cut to this.
_WIDTH = 400


def _shown(value: object, width: int = 60) -> str:
    """``value`` as a message shows it: its ``repr`` (``true``, ``null`` as in the file), cut."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def resolved(args: argparse.Namespace, sources: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Every flag's final value and where it came from: ``default``, ``config`` or ``command line``.

    ``sources`` names the flags that did not keep their default (``args.sources``
    of :func:`parse_with_config`). Values are plain JSON values (lists, numbers,
    strings, None), so the record fits ``metrics.jsonl``, a tracker and a
    ``weights_only`` checkpoint.
    """
    out: dict[str, dict[str, Any]] = {}
    for dest, value in sorted(vars(args).items()):
        if dest == "sources":  # where the values came from, not a flag
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
