"""A script's mistake is one line and status 1; a bug keeps its traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

import ddpkit
from ddpkit.distributed.exits import is_expected
from ddpkit.distributed.processes import RankFailedError
from ddpkit.examples import own_loop, seresnext_lmdb
from ddpkit.testing import run_distributed


def _raised(fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except BaseException as exc:
        return exc
    raise AssertionError("nothing raised")


def test_what_ddpkit_raises_on_purpose_is_expected_and_a_bug_is_not() -> None:
    missing = _raised(lambda: ddpkit.LazyLMDBDataset("/nonexistent/x.lmdb"))
    assert "no such LMDB database" in (is_expected(missing) or "")
    refused = _raised(lambda: ddpkit.FocalLoss(gamma=-1))  # a ValueError raised by ddpkit
    assert is_expected(refused) is not None
    assert is_expected(_raised(lambda: int("x"))) is None  # not ddpkit's: a traceback
    assert is_expected(_raised(lambda: ddpkit.FocalLoss.no_such)) is None  # a bug's error


def _checkpoint_refused(rank: int, world_size: int) -> None:
    from ddpkit.checkpoint.serialization import CheckpointError

    raise CheckpointError("latest.pth was trained with arch a")


def _a_bug(rank: int, world_size: int) -> None:
    raise KeyError(3)  # not raised by ddpkit: a traceback


def _a_bug_inside_ddpkit(rank: int, world_size: int) -> None:
    from ddpkit.data.resume import data_change

    data_change(None, None)  # type: ignore[arg-type]


def _refused_inside_ddpkit(rank: int, world_size: int) -> None:
    ddpkit.FocalLoss(gamma=-1)


def _rank_error(fn: object) -> RankFailedError:
    with pytest.raises(RankFailedError) as info:
        run_distributed(fn, 1, init=None, timeout=60)  # type: ignore[arg-type]
    return info.value


def test_a_ranks_error_is_judged_in_the_rank() -> None:
    line = is_expected(_rank_error(_checkpoint_refused))
    assert line == "rank 0: latest.pth was trained with arch a"
    assert (is_expected(_rank_error(_refused_inside_ddpkit)) or "").startswith("rank 0: ")
    assert is_expected(_rank_error(_a_bug)) is None
    assert is_expected(_rank_error(_a_bug_inside_ddpkit)) is None  # a bug inside ddpkit too
    assert is_expected(RankFailedError("killed", 0, "")) is None  # no report, nothing judged


@pytest.mark.parametrize(
    ("main", "extra"),
    [
        (own_loop.main, ["--arch", "test_resnet"]),
        (seresnext_lmdb.main, ["--arch", "test_resnet", "--epochs", "1"]),
    ],
    ids=["own_loop", "seresnext_lmdb"],
)
def test_the_examples_say_a_missing_data_path_in_one_line(
    main: object, extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--data", str(tmp_path / "missing"), "--checkpoints", str(tmp_path / "c"), *extra]
    with pytest.raises(SystemExit) as info:
        main(argv)  # type: ignore[operator]
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"error: {tmp_path / 'missing' / 'train.lmdb'}: no such LMDB database")
    with pytest.raises(FileNotFoundError):  # --debug: the error itself, traceback and all
        main([*argv, "--debug"])  # type: ignore[operator]


def test_an_unknown_model_names_where_the_names_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = ddpkit.make_shapes_dataset(
        tmp_path / "src", classes=2, train_per_class=4, val_per_class=1, size=16
    )
    for split, source in zip(("train", "val"), dirs, strict=True):
        ddpkit.build_lmdb(source, tmp_path / f"{split}.lmdb", progress=False)
    with pytest.raises(SystemExit):
        own_loop.main(["--data", str(tmp_path), "--arch", "no_such_net", "-b", "4"])
    err = capsys.readouterr().err
    assert err.startswith("error: --arch no_such_net: timm has no such model")
    assert "Traceback" not in err


def test_a_bugs_error_inside_ddpkit_keeps_its_traceback() -> None:
    # A TypeError Python raises for a bad call made inside ddpkit is a bug, not a mistake.
    from ddpkit.data.resume import data_change

    bug = _raised(lambda: data_change(None, None))  # type: ignore[arg-type]
    assert isinstance(bug, AttributeError | TypeError)
    assert is_expected(bug) is None
