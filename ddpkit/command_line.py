"""A script's command line: flags declared once in a table, ``--config FILE`` as their defaults.

:meth:`CommandLine.define` puts a table of flags (each its names and
``add_argument``'s keywords) on an argparse parser; :meth:`CommandLine.parse`
reads ``argv`` over a ``--config`` YAML or TOML file over the defaults: the file's
values stand in for the defaults (as ``set_defaults`` in timm's ``train.py``), and
the parser itself is never changed, so parsing twice gives two independent answers.
A key is a flag's long name without the dashes (``batch_size`` or ``batch-size``);
its value goes through the flag's own parsing, as its text on the command line
would (``milestones: 5`` is ``--milestones 5``); ``null`` keeps a default of None.
A bad file or value is one line naming the file and the key, exit status 2.
:meth:`CommandLine.resolved` is the run's record: every flag's value and source.
argparse keeps its list of flags private, so the table is kept beside the parser.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import itertools
import math
import os
import re
import reprlib
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

__all__ = ["MAX_BYTES", "CommandLine", "load_config"]

MAX_BYTES = 1 << 20  # the largest config file read: a recipe is a few hundred bytes
# A flag of the table: its names ("-b", "--batch-size") and add_argument's keywords, less
# "one_of": the name of a group of flags that exclude each other.
Flag = tuple[tuple[str, ...], Mapping[str, Any]]


@dataclass(frozen=True)
class CommandLine:
    """A parser of a table of flags, and what argparse keeps private of it.

    Attributes:
        parser: the parser of the command line: its defaults, ``--help``, its errors.
        actions: every flag but ``--help``, as ``add_argument`` returned it.
        exclusive: the destinations of each group of flags that exclude each other.
        bare: the same flags without defaults, whose errors raise ``argparse.ArgumentError``:
            what a command line, or one flag's text, gives by itself.
    """

    parser: argparse.ArgumentParser
    actions: tuple[argparse.Action, ...]
    exclusive: tuple[tuple[str, ...], ...]
    bare: argparse.ArgumentParser

    @staticmethod
    def flag(*names: str, **options: Any) -> Flag:
        """A row of a table of flags: ``flag("-b", "--batch-size", type=int, default=256)``."""
        return names, options

    @staticmethod
    def number(kind: type, least: float, strict: bool = False, most: float = math.inf) -> Any:
        """An argparse type: a finite ``kind`` (``int`` or ``float``) at least ``least`` (above
        it when ``strict``) and at most ``most``; a wrong text is ``argument -b: must be >= 1``."""

        def parse(text: str) -> Any:
            try:
                value = kind(text)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
            if not math.isfinite(value) or not (value > least if strict else value >= least):
                raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {least:g}")
            if value > most:
                raise argparse.ArgumentTypeError(f"must be <= {most:g}")
            return value

        return parse

    @classmethod
    def define(
        cls, flags: Sequence[Flag], description: str | None = None, epilog: str | None = None
    ) -> CommandLine:
        """``flags`` on a new parser (``--help`` in their order, ``epilog`` after them, both
        texts as written) and on a bare one; the usage names the command that was typed."""
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        prog = f"python -m {spec.name}" if spec is not None and spec.name else None
        parser = argparse.ArgumentParser(
            prog=prog,
            description=description,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        bare = _Raising(add_help=False, argument_default=argparse.SUPPRESS, exit_on_error=False)
        actions: list[argparse.Action] = []
        groups: dict[str, tuple[Any, list[str]]] = {}  # one_of: (argparse's group, its flags)
        for names, given in flags:
            if given.get("required") or not all(n.startswith("-") for n in names):
                raise ValueError(
                    f"CommandLine: {' '.join(names)} is a positional or required argument, which a "
                    "--config file cannot give: make it an option and check it after parse()"
                )
            options = copy.deepcopy({k: v for k, v in given.items() if k != "one_of"})
            default, help_ = options.get("default"), options.get("help")
            if default is not None and default is not False and help_ is not argparse.SUPPRESS:
                shown = "(default: %(default)s)"  # --help says each default, after the text
                options["help"] = f"{options['help']} {shown}" if options.get("help") else shown
            group = given.get("one_of")
            if group is not None and group not in groups:
                groups[group] = (parser.add_mutually_exclusive_group(), [])
            adder = groups[group][0] if group is not None else parser
            actions.append(adder.add_argument(*names, **options))
            if group is not None:
                groups[group][1].append(actions[-1].dest)
            bare.add_argument(*names, **{k: v for k, v in options.items() if k != "default"})
        exclusive = tuple(tuple(dests) for _, dests in groups.values())
        return cls(parser=parser, actions=tuple(actions), exclusive=exclusive, bare=bare)

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """``argv`` (default: ``sys.argv[1:]``) over ``--config FILE`` over the defaults;
        ``args.sources`` says which set each.

        ``sources`` maps each flag the file or ``argv`` set to ``"config"`` or
        ``"command line"``. A flag ``argv`` gives drops the file's value of a flag
        it excludes (``--lr`` over the file's ``lr_base``); a file setting two
        such flags is refused. Errors end the program with exit status 2.
        """
        argv = list(sys.argv[1:] if argv is None else argv)
        config = any("--config" in a.option_strings for a in self.actions)
        try:  # what argv sets, without defaults (a bad value: the parser's own error, below)
            given = vars(self.bare.parse_known_args(argv)[0])
        except argparse.ArgumentError:
            self.parser.parse_args(argv)
            raise
        path = given.get("config") if config else None
        values = _apply(self, path) if path is not None else {}
        # The file's values go in as if given (those argv gives are argv's alone: an append
        # flag starts again), so the parser itself is never changed.
        ahead = {dest: value for dest, value in values.items() if dest not in given}
        args = self.parser.parse_args(argv, namespace=argparse.Namespace(**ahead))
        for action in self.actions:  # a list default is the parser's own: each run its copy
            if isinstance(action.default, list) and getattr(args, action.dest) is action.default:
                setattr(args, action.dest, list(action.default))
        sources = dict.fromkeys(values, "config")
        switches = {a.dest for a in self.actions if a.nargs == 0}
        for dests in self.exclusive:  # a switch the file leaves off excludes nothing
            from_file = {
                d
                for d in set(dests) & set(values)
                if d not in switches or values[d] != self.parser.get_default(d)
            }
            if set(given) & set(dests):
                for dest in from_file - set(given):
                    setattr(args, dest, self.parser.get_default(dest))
                    del sources[dest]
            elif len(from_file) > 1:
                both = " and ".join(f"--{d.replace('_', '-')}" for d in sorted(from_file))
                _refuse(
                    self.parser, f"--config {path}: sets {both}, which exclude each other: keep one"
                )
        args.sources = {**sources, **dict.fromkeys(given, "command line")}
        return args

    @staticmethod
    def resolved(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
        """Every flag's value (plain JSON) and where it came from: ``default``, ``config`` or
        ``command line`` (``args.sources``): the run's record for its log and checkpoints."""

        def plain(value: Any) -> Any:
            if isinstance(value, list | tuple):
                return [v if isinstance(v, bool | int | float | str) else str(v) for v in value]
            if value is None or isinstance(value, bool | int | float | str):
                return value
            return str(value)

        sources = getattr(args, "sources", {})
        return {
            dest: {"value": plain(value), "source": sources.get(dest, "default")}
            for dest, value in sorted(vars(args).items())
            if dest != "sources"
        }


class _Raising(argparse.ArgumentParser):
    """A parser whose every error raises ``ArgumentError`` (``exit_on_error=False`` misses some)."""

    def error(self, message: str) -> NoReturn:
        raise argparse.ArgumentError(None, message)


def load_config(path: str) -> dict[str, Any]:
    """The table of the YAML (``.yaml``, ``.yml``) or TOML file at ``path``.

    Only a regular file of at most :data:`MAX_BYTES` of UTF-8 is read: a device,
    a FIFO or a socket is refused before it is opened, so nothing waits.

    Raises:
        ValueError: one line naming the file, what is wrong and the fix.
    """
    kind = Path(path).suffix.lower()
    if kind not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"{path}: a config file ends in .yaml, .yml or .toml, not {kind!r}")
    link = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    try:
        info = _regular(path, os.stat(path), link)
        # O_NONBLOCK: a FIFO put in the file's place since the look above does not wait.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        with os.fdopen(os.open(path, flags), "rb") as file:
            info = _regular(path, os.fstat(file.fileno()), link)
            data = file.read(MAX_BYTES + 1)
    except FileNotFoundError:
        what = f"is a link to {os.readlink(path)!r}, which does not exist" if link else "not found"
        raise ValueError(f"{path}: {what}; check the path") from None
    except PermissionError:
        raise ValueError(f"{path}{link}: cannot be read: permission denied; chmod u+r it") from None
    except OSError as exc:
        raise ValueError(f"{path}{link}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_BYTES:
        held = f"{info.st_size} bytes" if info.st_size > MAX_BYTES else "more"
        raise ValueError(
            f"{path}{link}: holds {held}, and a config file holds at most {MAX_BYTES >> 20} MiB "
            "of flag: value; is it the right file?"
        )
    data = data.removeprefix(b"\xef\xbb\xbf")  # a byte order mark
    if not data.strip():
        raise ValueError(f"{path}{link}: is empty; write flag: value lines, or drop --config")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{path}{link}: is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
            "save it as UTF-8"
        ) from None
    try:
        table = tomllib.loads(text) if kind == ".toml" else _yaml(text)
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to be a table of flag: value") from None
    except Exception as exc:  # yaml.YAMLError, tomllib.TOMLDecodeError, a bad date
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        said = f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else exc
        raise ValueError(
            f"{path}: not valid {kind[1:].upper()}: {' '.join(str(said).split())}"
        ) from None
    if not table:
        raise ValueError(f"{path}: holds no flag: value; write one per line, or drop --config")
    if not isinstance(table, dict):
        raise ValueError(f"{path}: holds a {type(table).__name__}, not a table of flag: value")
    return table


def _regular(path: str, info: os.stat_result, link: str) -> os.stat_result:
    """``info`` if it is a regular file's, else a ``ValueError`` naming what it is."""
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path}{link}: is a directory; name the .yaml or .toml file in it")
    if not stat.S_ISREG(info.st_mode):
        what = next((k for test, k in _SPECIAL if test(info.st_mode)), "special file")
        raise ValueError(
            f"{path}{link}: is a {what}, not a regular file; write the flags to a file and "
            "pass that"
        )
    return info


def _yaml(text: str) -> Any:
    """YAML through PyYAML's safe loader (no objects), less YAML 1.1's base-60 and octal
    numbers: ``profile_steps: 10:20`` stays the text ``"10:20"``, not 620."""
    import yaml  # type: ignore[import-untyped]

    class Loader(yaml.SafeLoader):  # type: ignore[misc]
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBERS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    for tag, pattern in _NUMBERS.items():
        Loader.add_implicit_resolver(tag, re.compile(pattern, re.X), list("-+0123456789."))
    return yaml.load(text, Loader=Loader)


# PyYAML's int and float patterns without their base-60, octal, hex and binary branches: a
# number is read as the command line reads its text.
_NUMBERS = {
    "tag:yaml.org,2002:int": r"^[-+]?(?:0|[1-9][0-9_]*)$",  # 0017 stays text, as argv's 0017
    "tag:yaml.org,2002:float": r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
        |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""",
}
_SPECIAL = (
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISSOCK, "socket"),
)


def _apply(flags: CommandLine, path: str) -> dict[str, Any]:
    """The file's values, by destination, each parsed as its flag's text would be."""
    parser, actions = flags.parser, _file_actions(flags.actions)
    try:
        table = load_config(path)
    except ValueError as exc:
        _refuse(parser, f"--config {exc}")
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for name, value in ((str(k), v) for k, v in table.items()):
        action, where = actions.get(name.replace("-", "_")), f"--config {path}: key {_shown(name)}"
        if action is None and name.replace("-", "_") in ("help", "config"):
            _refuse(parser, f"{where}: --{name} is for the command line only")
        if action is None:
            known = sorted({o for a in actions.values() for o in a.option_strings if o[:2] == "--"})
            close = difflib.get_close_matches("--" + name.replace("_", "-"), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            _refuse(
                parser,
                f"--config {path}: unknown key {_shown(name)}: no flag --{name}{hint} "
                "(a key is a flag's name without the dashes)",
            )
        flag = "/".join(action.option_strings)
        if action.dest in keys:
            _refuse(parser, f"{where}: {flag} is set twice, also as {keys[action.dest]!r}")
        keys[action.dest] = name
        if value is None and action.default is None:
            continue  # the flag's default, as if the key were not there
        if value is None:
            _refuse(
                parser,
                f"{where}: null, and {flag} has no empty value (its default is "
                f"{_shown(action.default)}): give a value or drop the key",
            )
        try:
            values[action.dest] = _value(flags.bare, action, value)
        except _Refused as exc:
            _refuse(parser, f"{where}: {_shown(value)}: {exc}")
    return values


class _Refused(Exception):
    """A config value its flag does not take; the message says why."""


def _file_actions(actions: Sequence[argparse.Action]) -> dict[str, argparse.Action]:
    """The flags a file may set, by destination and by each long name (``wd``, ``weight_decay``)."""
    found = {a.dest: a for a in actions if a.option_strings and a.dest != "config"}
    for action in list(found.values()):
        for option in (o for o in action.option_strings if o.startswith("--")):
            found.setdefault(option[2:].replace("-", "_"), action)
    return found


def _value(bare: argparse.ArgumentParser, action: argparse.Action, value: Any) -> Any:
    """``value`` as ``action``'s flag parses it from the command line, or :class:`_Refused`."""
    flag = "/".join(action.option_strings)
    if action.nargs == 0:  # a switch: store_true and store_false take the value as it is
        if not isinstance(value, bool):
            raise _Refused(f"{flag} is a switch: true or false")
        if isinstance(action.const, bool):
            return value
        return _act(bare, action, []) if value else action.default
    if isinstance(value, bool) and action.nargs == "?":  # --resume alone, or not
        if not value and action.default not in (False, None):
            raise _Refused(f"{flag} takes {_what(action)}")
        return _act(bare, action, []) if value else action.default
    if isinstance(value, Mapping):
        raise _Refused(f"{flag} takes {_what(action)}, not a table")
    if isinstance(value, list | tuple) and action.nargs in (None, "?"):
        raise _Refused(f"{flag} takes one value ({_what(action)}), not a list")
    tokens = [_token(action, v) for v in (value if isinstance(value, list) else [value])]
    if action.nargs == "+" and not tokens:
        raise _Refused(f"{flag} takes at least one value")
    if isinstance(action.nargs, int) and len(tokens) != action.nargs:
        raise _Refused(f"{flag} takes {action.nargs} values, got {len(tokens)}")
    return _act(bare, action, tokens)


def _act(bare: argparse.ArgumentParser, action: argparse.Action, tokens: list[str]) -> Any:
    """Parse ``tokens`` as the words after ``action``'s flag: its type, choices and action."""
    flag = action.option_strings[-1]
    # --flag=TEXT: a value that starts with a dash stays a value. A list's items go one
    # by one first, so a bad one is named as the flag names it, then the list as a whole.
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
            raise _Refused(f"{'/'.join(action.option_strings)}: {rest[0]!r} is not a value of it")
    return getattr(parsed, action.dest)


def _token(action: argparse.Action, item: Any) -> str:
    """The command-line text of one config value: text as it is, a number as it is written."""
    flag = "/".join(action.option_strings)
    if isinstance(item, bool):
        raise _Refused(f"{flag} takes {_what(action)}, not true or false (quote text)")
    if isinstance(item, str | int | float):
        return item if isinstance(item, str) else repr(item)
    kind = "a table" if isinstance(item, Mapping) else f"a {type(item).__name__}"
    raise _Refused(f"{flag} takes {_what(action)}, not {kind} (quote text)")


def _what(action: argparse.Action) -> str:
    """What the flag takes, in its help's words: ``N``, ``one of step, cosine``, ``a value``."""
    if action.choices is not None:  # at most ten of them: choices may be a long range
        shown = [str(c) for c in itertools.islice(action.choices, 11)]
        return "one of " + ", ".join(shown[:10]) + (", ..." if len(shown) > 10 else "")
    return action.metavar if isinstance(action.metavar, str) else "a value"


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """End as argparse does, exit status 2, with ``message`` on one line (no usage: the line
    says what to change in the file)."""
    line = " ".join(message.split())
    parser.exit(2, f"{parser.prog}: error: {line[:397] + '...' if len(line) > 400 else line}\n")


def _shown(value: object) -> str:
    """``value`` as the file writes it (``true``, ``null``), cut short (so never expanded whole:
    a few bytes of YAML anchors can stand for a list of billions)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return _SHORT.repr(value)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 6, 6, 60, 60
