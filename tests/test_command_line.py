"""ddpkit.command_line: a table of flags on a parser, ``--config`` files as their defaults, the
command line over the file over the defaults, and the record of where each value came from."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from ddpkit import CommandLine, load_config

_FLAGS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--config",), {"metavar": "FILE"}),
    (("-n", "--steps"), {"type": int, "default": 10}),
    (("--names",), {"nargs": "*", "default": ["a"]}),
    (("--fast",), {"action": "store_true", "one_of": "speed"}),
    (("--slow",), {"action": "store_true", "one_of": "speed"}),
    (("--rate",), {"type": float, "one_of": "rate", "default": 0.5}),
    (("--rate-per-item",), {"type": float, "one_of": "rate"}),
    (("--out",), {"help": "where it goes"}),
]


def _parse(argv: list[str]) -> argparse.Namespace:
    return CommandLine.define(_FLAGS, "a tool", "NOTES AFTER THE FLAGS").parse(argv)


def test_the_table_makes_the_parser_and_its_groups() -> None:
    line = CommandLine.define(_FLAGS, "a tool", "NOTES AFTER THE FLAGS")
    assert [a.dest for a in line.actions] == [
        "config", "steps", "names", "fast", "slow", "rate", "rate_per_item", "out",
    ]  # fmt: skip
    assert line.exclusive == (("fast", "slow"), ("rate", "rate_per_item"))
    assert vars(line.bare.parse_known_args([])[0]) == {}  # no defaults: argv alone
    with pytest.raises(argparse.ArgumentError):
        line.bare.parse_known_args(["--steps", "x"])
    assert "NOTES AFTER THE FLAGS" in line.parser.format_help()
    with pytest.raises(SystemExit):
        line.parser.parse_args(["--fast", "--slow"])  # argparse's own exclusion


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("c.yaml", "steps: 3\nnames: [x, y]\nfast: true\n"),
        ("c.toml", 'steps = 3\nnames = ["x", "y"]\nfast = true\n'),
    ],
)
def test_the_command_line_wins_over_the_file_over_the_defaults(
    tmp_path: Path, name: str, text: str
) -> None:
    (tmp_path / name).write_text(text)
    args = _parse(["--config", str(tmp_path / name), "-n", "5"])
    assert (args.steps, args.names, args.fast, args.out) == (5, ["x", "y"], True, None)
    assert args.sources == {
        "config": "command line", "steps": "command line", "names": "config", "fast": "config",
    }  # fmt: skip
    record = CommandLine.resolved(args)
    assert record["steps"] == {"value": 5, "source": "command line"}
    assert record["names"] == {"value": ["x", "y"], "source": "config"}
    assert record["out"] == {"value": None, "source": "default"}
    assert "sources" not in record


def test_a_flag_on_the_command_line_drops_the_file_s_flag_it_excludes(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("rate_per_item: 0.1\nslow: true\n")
    args = _parse(["--config", str(tmp_path / "c.yaml"), "--rate", "2", "--fast"])
    assert (args.rate, args.rate_per_item, args.fast, args.slow) == (2.0, None, True, False)
    assert set(args.sources) == {"config", "rate", "fast"}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("stpes: 3\n", "unknown key 'stpes': no flag --stpes; did you mean --steps?"),
        ("steps: x\n", "key 'steps': 'x': -n/--steps: invalid int value: 'x'"),
        ("steps: [1, 2]\n", "-n/--steps takes one value (a value), not a list"),
        ("fast: 1\n", "--fast is a switch: true or false"),
        (
            "rate: 1\nrate_per_item: 2\n",
            "sets --rate and --rate-per-item, which exclude each other",
        ),
        ("steps: null\n", "null, and -n/--steps has no empty value (its default is 10)"),
        ("config: x.yaml\n", "key 'config': --config is for the command line only"),
        ("- 1\n", "holds a list, not a table of flag: value"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str
) -> None:
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(SystemExit) as exited:
        _parse(["--config", str(tmp_path / "c.yaml")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    assert f"error: --config {tmp_path / 'c.yaml'}" in err
    assert len(err.splitlines()) == 1, err


def test_load_config_reads_only_a_table_of_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "ok.yml").write_text("a: 1\nwhen: '10:20'\nt: 10:20\n")
    assert load_config(str(tmp_path / "ok.yml")) == {"a": 1, "when": "10:20", "t": "10:20"}
    (tmp_path / "c.ini").write_text("a = 1\n")
    with pytest.raises(ValueError, match=r"ends in \.yaml, \.yml or \.toml"):
        load_config(str(tmp_path / "c.ini"))
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(ValueError, match=r"d\.yaml: is a directory"):
        load_config(str(tmp_path / "d.yaml"))


@pytest.mark.parametrize(
    ("kind", "bounds", "text", "said"),
    [
        (int, {"least": 1}, "0", "must be >= 1"),
        (int, {"least": 1}, "2.5", "'2.5' is not a whole number"),
        (float, {"least": 0, "strict": True}, "0", "must be > 0"),
        (float, {"least": 0}, "nan", "must be >= 0"),
        (float, {"least": 0}, "inf", "must be >= 0"),
        (float, {"least": 0, "most": 1}, "1.5", "must be <= 1"),
    ],
)
def test_a_number_flag_refuses_what_is_out_of_its_range(
    kind: type, bounds: dict[str, Any], text: str, said: str
) -> None:
    parse = CommandLine.number(kind, **bounds)
    with pytest.raises(argparse.ArgumentTypeError, match=said):
        parse(text)
    assert parse("1") == kind(1)


def test_parsing_twice_gives_two_independent_answers(tmp_path: Path) -> None:
    line = CommandLine.define(_FLAGS)
    (tmp_path / "a.yaml").write_text("rate: 2\nnames: [q]\n")
    (tmp_path / "b.yaml").write_text("steps: 3\n")
    first = line.parse(["--config", str(tmp_path / "a.yaml")])
    first.names.append("changed")  # a list an answer holds is its own
    second = line.parse(["--config", str(tmp_path / "b.yaml")])
    assert (second.rate, second.steps, second.names) == (0.5, 3, ["a"])
    plain = line.parse([])
    assert CommandLine.resolved(plain)["rate"] == {"value": 0.5, "source": "default"}
    assert [a.default for a in line.actions][1:3] == [10, ["a"]]  # the parser is untouched


def test_what_a_file_cannot_give_is_refused_when_the_table_is_made() -> None:
    for row in [(("--data",), {"required": True}), (("input",), {})]:
        with pytest.raises(ValueError, match="positional or required argument"):
            CommandLine.define([*_FLAGS, row])


def test_odd_flags_take_a_file_s_value_as_their_text(tmp_path: Path) -> None:
    table = [
        *_FLAGS,
        (("--pair",), {"nargs": 2, "type": int}),
        (("--no-cuda",), {"action": "store_false", "dest": "cuda"}),
        (("--port",), {"type": int, "choices": range(10**9), "metavar": "PORT"}),
        (("--tag",), {"action": "append"}),
    ]
    (tmp_path / "c.yaml").write_text("pair: [1, 2]\ncuda: false\nport: 8080\nsteps: 0017\ntag: a\n")
    args = CommandLine.define(table).parse(["--config", str(tmp_path / "c.yaml")])
    assert (args.pair, args.cuda, args.port, args.steps) == ([1, 2], False, 8080, 17)
    again = CommandLine.define(table).parse(["--config", str(tmp_path / "c.yaml"), "--tag", "b"])
    assert (args.tag, again.tag) == (["a"], ["b"])  # the command line's list, not appended


def test_a_value_of_a_billion_items_is_refused_without_being_written_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nested = "[&a0 [1,1,1,1,1,1,1,1,1]" + "".join(
        f", &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)
    )
    (tmp_path / "c.yaml").write_text(f"names: {nested}]\n")  # 9**9 items once expanded
    with pytest.raises(SystemExit):
        _parse(["--config", str(tmp_path / "c.yaml")])
    err = capsys.readouterr().err
    assert "key 'names'" in err
    assert len(err) < 500


def test_help_says_each_default() -> None:
    shown = " ".join(CommandLine.define(_FLAGS).parser.format_help().split())
    assert "-n STEPS, --steps STEPS (default: 10)" in shown
    assert "--out OUT where it goes" in shown  # no default: nothing added
