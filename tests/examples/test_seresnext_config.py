"""The example's --config FILE: YAML or TOML as the flags' defaults, the command line wins."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import ddpkit
from ddpkit import load_config

example = importlib.import_module("ddpkit.examples.seresnext_lmdb")


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("run.yaml", "batch_size: 512\nlr: 0.2\nmilestones: [10, 20]\nmodel_ema: true\n"),
        ("run.toml", "batch-size = 512\nlr = 0.2\nmilestones = [10, 20]\nmodel-ema = true\n"),
    ],
)
def test_a_file_sets_the_defaults_and_the_command_line_wins(
    tmp_path: Path, name: str, text: str
) -> None:
    (tmp_path / name).write_text(text)
    args = example.parse_args(["--data", "d", "--config", str(tmp_path / name), "--lr", "0.3"])
    assert (args.batch_size, args.lr, args.milestones, args.model_ema) == (512, 0.3, [10, 20], True)
    record = ddpkit.CommandLine.resolved(args)
    assert record["batch_size"] == {"value": 512, "source": "config"}
    assert record["lr"] == {"value": 0.3, "source": "command line"}
    assert record["epochs"] == {"value": 90, "source": "default"}
    assert "sources" not in record  # where the values came from, not a flag


def test_the_command_line_drops_the_files_exclusive_flag(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("lr_base: 0.1\n")
    args = example.parse_args(["--data", "d", "--config", str(tmp_path / "c.yaml"), "--lr", "1"])
    assert (args.lr, args.lr_base) == (1.0, None)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "batch_sise: 4\n",
            "unknown key 'batch_sise': no flag --batch_sise; did you mean --batch-size?",
        ),
        ("epochs: 0\n", "key 'epochs': 0: --epochs: must be >= 1"),
        ("epochs: 2.5\n", "key 'epochs': 2.5: --epochs: '2.5' is not a whole number"),
        ("sched: linear\n", "key 'sched': 'linear': --sched: invalid choice: 'linear'"),
        ("model_ema: 3\n", "key 'model_ema': 3: --model-ema is a switch: true or false"),
        ("lr: 0.1\nlr_base: 0.1\n", "sets --lr and --lr-base, which exclude each other"),
        ("- a\n", "holds a list, not a table"),
        ("milestones: [5, x]\n", "key 'milestones': [5, 'x']: --milestones: 'x' is not a whole"),
        ("milestones: {a: 1}\n", "key 'milestones': {'a': 1}: --milestones takes a value, not a"),
        ("profile_steps: [1, 5]\n", "--profile-steps takes one value (A:B), not a list"),
        ("profile_ranks: []\n", "--profile-ranks takes at least one value"),
        ("arch: true\n", "key 'arch': true: --arch takes a value, not true or false"),
        ("network: 2024-01-01\n", "--network takes NAME, not a date (quote text)"),
        ("epochs: null\n", "key 'epochs': null, and --epochs has no empty value (its default"),
        ("resume: null\n", "key 'resume': null, and --resume has no empty value"),
        ("wd: 0.1\nweight_decay: 0.1\n", "--wd/--weight-decay is set twice, also as 'wd'"),
        ("config: other.yaml\n", "key 'config': --config is for the command line only"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str
) -> None:
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(SystemExit) as exited:
        example.parse_args(["--data", "d", "--config", str(tmp_path / "c.yaml")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    assert len(err.splitlines()) == 1, err  # no usage: the line says what to change


def test_load_config_refuses_other_kinds_and_bad_syntax(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match=r"ends in \.yaml, \.yml or \.toml"):
        load_config(str(tmp_path / "c.json"))
    (tmp_path / "c.toml").write_text("lr = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(str(tmp_path / "c.toml"))
    with pytest.raises(ValueError, match=r"none\.yaml: not found; check the path"):
        load_config(str(tmp_path / "none.yaml"))


@pytest.mark.parametrize(
    ("text", "dest", "value"),
    [
        ("milestones: 5\n", "milestones", [5]),  # a list flag: one item
        ("milestones: []\n", "milestones", []),  # as --milestones alone
        ("profile_ranks: 3\n", "profile_ranks", [3]),
        ("network: 7\n", "network", "7"),  # a text flag: the number's text
        ("checkpoints: 5\n", "checkpoints", "5"),
        ("log_dir: 0.5\n", "log_dir", "0.5"),
        ("resume: 3\n", "resume", "3"),  # a PATH
        ("resume: true\n", "resume", True),  # --resume alone
        ("resume: false\n", "resume", False),
        ("profile_steps: 10:20\n", "profile_steps", (10, 20)),  # not YAML 1.1's 620
        ("lr: 1e-3\n", "lr", 0.001),
        ("lr: '0.2'\n", "lr", 0.2),  # text for a number flag: parsed as the flag parses it
        ("amp: null\n", "amp", None),  # the default
        ("amp: bf16\n", "amp", "bf16"),
        ("wd: 0.01\n", "weight_decay", 0.01),  # any long name of the flag
        ("log_with: [mlflow, wandb]\n", "log_with", ("mlflow", "wandb")),
        ("log_with: 'MLflow, wandb'\n", "log_with", ("mlflow", "wandb")),
        ("log_with: tensorboard,tensorboard\n", "log_with", ("tensorboard",)),
    ],
)
def test_a_value_is_what_its_text_on_the_command_line_gives(
    tmp_path: Path, text: str, dest: str, value: object
) -> None:
    (tmp_path / "c.yaml").write_text(text)
    args = example.parse_args(["--data", "d", "--config", str(tmp_path / "c.yaml")])
    assert getattr(args, dest) == value
    assert type(getattr(args, dest)) is type(value)


def test_toml_values_go_through_the_flags_too(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text(
        'milestones = 5\nnetwork = 7\nlog_with = ["mlflow", "wandb"]\nprofile_steps = "1:3"\n'
    )
    args = example.parse_args(["--data", "d", "--config", str(tmp_path / "c.toml")])
    assert (args.milestones, args.network, args.log_with) == ([5], "7", ("mlflow", "wandb"))
    assert args.profile_steps == (1, 3)


def test_null_or_a_default_switch_sets_nothing_that_excludes_another(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("lr: 0.2\nlr_base: null\nfreeze_backbone: false\n")
    path = str(tmp_path / "c.yaml")
    args = example.parse_args(["--data", "d", "--config", path, "--requires-grad"])
    assert (args.lr, args.lr_base, args.requires_grad, args.freeze_backbone) == (
        0.2,
        None,
        True,
        False,
    )
    assert "lr_base" not in args.sources  # null: the default, not the file's value
