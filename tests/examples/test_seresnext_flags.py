"""ddpkit.examples.seresnext_flags: the example's flags apart from its recipe, read through
argparse's public API only; what the command line gave, told from the file and the defaults."""

from __future__ import annotations

import argparse
import ast
import importlib
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint import TrainingState
from ddpkit.examples import seresnext_flags

example = importlib.import_module("ddpkit.examples.seresnext_lmdb")
EXAMPLES = Path(seresnext_flags.__file__).parent


def test_the_example_reads_top_down_as_the_recipe() -> None:
    source = (EXAMPLES / "seresnext_lmdb.py").read_text()
    tree = ast.parse(source)
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    train = functions[0]
    assert train.name == "train"  # imports, then the training function
    assert train.lineno < 80, train.lineno
    recipe = ast.get_source_segment(source, train) or ""
    steps = ["LazyLMDBDataset", "build_loader", "FocalLoss", "build_model", "wrap_ddp", "SGD",
             "warmup_schedule", "CheckpointManager", "fit("]  # fmt: skip
    assert [recipe.index(step) for step in steps] == sorted(recipe.index(s) for s in steps)
    assert "add_argument" not in source  # the flags live in seresnext_flags


def test_no_example_touches_a_private_attribute() -> None:
    for path in sorted(EXAMPLES.glob("*.py")):
        source = path.read_text()
        private = [
            f"{path.name}:{node.lineno}: .{node.attr}"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.endswith("__")
        ]
        assert private == [], private
        assert "_sources" not in source, path.name


def test_flags_hold_every_flag_and_group_of_the_parser() -> None:
    flags = ddpkit.CommandLine.define(seresnext_flags.FLAGS)
    # argparse's own lists, read here only to check the example's copy of them.
    own = [a for a in flags.parser._actions if a.dest != "help"]
    assert list(flags.actions) == own
    assert len(own) == 70
    groups = flags.parser._mutually_exclusive_groups
    assert list(flags.exclusive) == [tuple(a.dest for a in g._group_actions) for g in groups]
    assert flags.exclusive == (("requires_grad", "freeze_backbone"), ("lr", "lr_base"))
    # The bare parser: no defaults, so an empty command line sets nothing.
    assert vars(flags.bare.parse_known_args([])[0]) == {}
    with pytest.raises(argparse.ArgumentError, match="must be >= 1"):
        flags.bare.parse_known_args(["--epochs", "0"])


@pytest.mark.parametrize(
    "argv",
    [["--powersgd-rank", "2"], ["--comm-hook", "bf16", "--powersgd-warmup", "10"],
     ["--no-powersgd-error-feedback"]],
)  # fmt: skip
def test_powersgds_options_need_its_hook(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        example.parse_args(["--data", "d", *argv])
    assert exited.value.code == 2
    assert "sets PowerSGD's options: add --comm-hook powersgd" in capsys.readouterr().err
    args = example.parse_args(["--data", "d", "--comm-hook", "powersgd", *argv[-2:]])
    assert args.comm_hook == "powersgd"


def test_parsing_changes_no_default_of_the_parser(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("epochs: 3\n")
    flags = ddpkit.CommandLine.define(seresnext_flags.FLAGS)
    before = {a.dest: a.default for a in flags.actions}
    flags.parse(["--data", "d", "--lr", "0.2"])
    assert {a.dest: a.default for a in flags.actions} == before


def test_the_command_line_is_told_from_the_file_and_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("epochs: 3\nbatch_size: 64\nlr_base: 0.1\nmodel_ema: true\n")
    argv = [
        "--data",
        "d",
        "-b256",
        "--lr-b",
        "0.2",
        "--wd=0.01",
        "--config",
        str(tmp_path / "c.yaml"),
    ]
    args = example.parse_args(argv)
    assert (args.epochs, args.batch_size, args.lr_base, args.weight_decay) == (3, 256, 0.2, 0.01)
    assert args.sources == {
        "data": "command line",
        "batch_size": "command line",  # -b256: the short flag, its value attached
        "lr_base": "command line",  # --lr-b: an abbreviation
        "weight_decay": "command line",  # --wd=0.01
        "config": "command line",
        "epochs": "config",
        "model_ema": "config",
    }
    plain = example.parse_args(["--data", "d"])
    assert plain.sources == {"data": "command line"}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("milestones: -x\n", "key 'milestones': '-x': --milestones: '-x' is not a whole number"),
        ("milestones: [5, '--l']\n", "--milestones: '--l' is not a whole number"),
        ("log_with: ['-x']\n", "--log-with: unknown tracker '-x'"),
        ("network: -x\n", None),  # one value: --network=-x, taken as the command line takes it
    ],
)
def test_a_value_that_starts_with_a_dash_is_a_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str | None
) -> None:
    (tmp_path / "c.yaml").write_text(text)
    argv = ["--data", "d", "--config", str(tmp_path / "c.yaml")]
    if said is None:
        assert example.parse_args(argv).network == "-x"
        return
    with pytest.raises(SystemExit) as exited:
        example.parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    assert len(err.splitlines()) == 1, err


def test_evaluation_resumes_through_the_bound_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trained = nn.Linear(3, 2)
    saver = ddpkit.CheckpointManager(tmp_path, prefix="lin", state=TrainingState(trained))
    saver.save(0)
    args = argparse.Namespace(
        resume=False, checkpoints=str(tmp_path), network="lin", arch="lin", pretrained=None
    )
    fresh = nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no objects passed one by one
        source = example.load_for_evaluation(args, fresh)
    assert source.endswith("latest.pth")
    assert torch.equal(fresh.weight, trained.weight)


def test_help_names_the_command_that_was_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    module = types.SimpleNamespace(__spec__=types.SimpleNamespace(name="ddpkit.examples.x"))
    monkeypatch.setitem(sys.modules, "__main__", module)
    assert (
        ddpkit.CommandLine.define(seresnext_flags.FLAGS)
        .parser.format_usage()
        .startswith("usage: python -m ddpkit.examples.x ")
    )
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=None))
    monkeypatch.setattr(sys, "argv", ["examples/seresnext_lmdb.py"])
    assert (
        ddpkit.CommandLine.define(seresnext_flags.FLAGS)
        .parser.format_usage()
        .startswith("usage: seresnext_lmdb.py ")
    )
