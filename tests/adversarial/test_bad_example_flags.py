"""examples/seresnext_lmdb.py refuses every impossible number before any work, in argparse's form.

Kinds: every numeric flag at 0, -1 and beyond its range; the constraints between flags
(--rank and --world-size, --min-crop's upper end, Mixup/CutMix and the number of classes,
known once the training set's index is read). Each is ``error: argument --FLAG: ...``, exit
status 2, no traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from corpus import image_tree
from warm import warm_run  # type: ignore[import-not-found]

from ddpkit.data import build_lmdb
from ddpkit.examples import seresnext_lmdb as example

_BAD: list[tuple[list[str], str]] = [
    (["--image-size", "0"], "--image-size: must be >= 32"),
    (["--image-size", "-1"], "--image-size: must be >= 32"),
    (["--image-size", "16"], "--image-size: must be >= 32"),
    (["--min-crop", "0"], "--min-crop: must be > 0"),
    (["--min-crop", "-1"], "--min-crop: must be > 0"),
    (["--min-crop", "2"], "--min-crop: must be <= 1"),
    (["--min-crop", "nan"], "--min-crop: must be > 0"),
    (["--num-classes", "0"], "--num-classes: must be >= 1"),
    (["--num-classes", "-1"], "--num-classes: must be >= 1"),
    (["--num-classes", "1", "--mixup", "0.8"], "argument --mixup: mixes the targets"),
    (["--num-classes", "1", "--cutmix", "1.0"], "argument --cutmix: mixes the targets"),
    (["--momentum", "-1"], "--momentum: must be >= 0"),
    (["--wd", "-1"], "--wd/--weight-decay: must be >= 0"),
    (["--milestones", "0"], "--milestones: must be > 0"),
    (["--milestones", "30", "-1"], "--milestones: must be > 0"),
    (["--model-ema-decay", "0"], "--model-ema-decay: must be > 0"),
    (["--model-ema-decay", "1"], "--model-ema-decay must lie between 0 and 1"),
    (["--seed", "-1"], "--seed: must be >= 0"),
    (["--world-size", "0"], "--world-size: must be >= 1"),
    (["--rank", "-1"], "--rank: must be >= 0"),
    (["--world-size", "2", "--rank", "2"], "argument --rank: must be below --world-size 2"),
    (["--gpu", "-1"], "--gpu: must be >= 0"),
    (["--epochs", "0"], "--epochs: must be >= 1"),
    (["-b", "0"], "-b/--batch-size: must be >= 1"),
    (["-j", "-1"], "-j/--workers: must be >= 0"),
    (["--lr", "0"], "--lr: must be > 0"),
    (["--lr-base", "-1"], "--lr-base: must be > 0"),
    (["--warmup-epochs", "-1"], "--warmup-epochs: must be >= 0"),
    (["--mixup", "-1"], "--mixup: must be >= 0"),
    (["--cutmix", "-1"], "--cutmix: must be >= 0"),
    (["--clip-grad", "0"], "--clip-grad: must be > 0"),
    (["--keep-last", "0"], "--keep-last: must be >= 1"),
    (["--save-every-steps", "0"], "--save-every-steps: must be > 0"),
    (["--save-every-minutes", "0"], "--save-every-minutes: must be > 0"),
    (["--hang-timeout", "-1"], "--hang-timeout: must be > 0"),
    (["--max-restarts", "-1"], "--max-restarts: must be >= 0"),
    (["--nprocs", "0"], "--nprocs: must be >= 1"),
    (["--on-data-change", "skip"], "--on-data-change: invalid choice: 'skip'"),
]
_DEMO_BAD: list[tuple[list[str], str]] = [
    (["--demo-epochs", "0"], "--demo-epochs: must be >= 1"),
    (["--demo-classes", "1"], "--demo-classes: must be >= 2"),
    (["--demo-per-class", "0"], "--demo-per-class: must be >= 1"),
]


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["--data", "d", *a], s) for a, s in _BAD] + [(["--demo", *a], s) for a, s in _DEMO_BAD],
    ids=[" ".join(a) for a, _ in _BAD + _DEMO_BAD],
)
def test_every_numeric_flag_is_checked(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        example.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {said}" in err or said in err, err
    assert "usage:" in err


def test_the_defaults_and_good_values_pass() -> None:
    args = example.parse_args(
        [
            "--data",
            "d",
            "--min-crop",
            "1",
            "--image-size",
            "32",
            "--world-size",
            "2",
            "--rank",
            "1",
            "--mixup",
            "0.8",
            "--num-classes",
            "2",
            "--on-data-change",
            "next-epoch",
        ]
    )
    assert args.min_crop == 1.0
    assert args.on_data_change == "next-epoch"


def test_one_class_of_data_with_mixup_fails_before_any_training(tmp_path: Path) -> None:
    build_lmdb(
        image_tree(tmp_path / "imgs", per_class=3, classes=1),
        tmp_path / "train.lmdb",
        progress=False,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for flag, value in (("--mixup", "0.8"), ("--cutmix", "1.0")):
        cmd = [
            sys.executable,
            "-m",
            "ddpkit.examples.seresnext_lmdb",
            "--data",
            str(tmp_path),
            flag,
            value,
            "--checkpoints",
            str(tmp_path / "ck"),
        ]
        done = warm_run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 2, done.stderr
        assert f"error: argument {flag}: mixes the targets of two classes and the model has 1" in (
            done.stderr
        )
        assert "Traceback" not in done.stderr
        assert not (tmp_path / "ck").exists()  # nothing started
