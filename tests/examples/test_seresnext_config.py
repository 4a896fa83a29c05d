"""The example's --config FILE: YAML or TOML as the flags' defaults, the command line wins."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from ddpkit.examples.seresnext_config import load_config, resolved, resume_changes

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
    record = resolved(args, args._sources)
    assert record["batch_size"] == {"value": 512, "source": "config"}
    assert record["lr"] == {"value": 0.3, "source": "command line"}
    assert record["epochs"] == {"value": 90, "source": "default"}
    assert "_sources" not in record


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
        ("epochs: 0\n", "epochs: 0: must be >= 1"),
        ("sched: linear\n", "'linear' is not one of 'step', 'cosine'"),
        ("model_ema: 3\n", "--model-ema is a switch: true or false"),
        ("lr: 0.1\nlr_base: 0.1\n", "sets --lr and --lr-base, which exclude each other"),
        ("- a\n", "holds a list, not a table"),
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
    assert "Traceback" not in err


def test_load_config_refuses_other_kinds_and_bad_syntax(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match=r"ends in \.yaml, \.yml or \.toml"):
        load_config(str(tmp_path / "c.json"))
    (tmp_path / "c.toml").write_text("lr = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(str(tmp_path / "c.toml"))
    with pytest.raises(ValueError, match="cannot be read"):
        load_config(str(tmp_path / "none.yaml"))


def test_resume_changes_sort_breaking_from_changing() -> None:
    def rec(**values: object) -> dict[str, dict[str, object]]:
        return {k: {"value": v, "source": "default"} for k, v in values.items()}

    saved = rec(batch_size=256, seed=0, lr=0.1, epochs=90, data="a")
    now = rec(batch_size=512, seed=0, lr=0.2, epochs=100, data="a")
    assert resume_changes(saved, now) == (["--batch-size 256 -> 512"], ["--lr 0.1 -> 0.2"])
    assert resume_changes(saved, rec(batch_size=512)) == (["--batch-size 256 -> 512"], [])
