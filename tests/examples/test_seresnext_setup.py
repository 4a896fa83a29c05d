"""ddpkit.examples.seresnext_lmdb refuses early: a checkpoint of another model, a batch that
does not divide, a directory holding another run."""

from __future__ import annotations

import importlib
import os
import time
import warnings
from pathlib import Path

import pytest
from warm import torchrun_command, torchrun_warm_env, warm_run  # type: ignore[import-not-found]

import ddpkit

example = importlib.import_module("ddpkit.examples.seresnext_lmdb")
ROOT = Path(__file__).resolve().parents[2]
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-epoch test_resnet run at 32 px on 3 shape classes; returns its data directory."""
    from ddpkit.data.shapes import make_shapes_dataset

    root = tmp_path_factory.mktemp("run")
    dirs = make_shapes_dataset(root / "src", classes=3, train_per_class=4, val_per_class=2, size=32)
    for split, source in zip(("train", "val"), dirs, strict=True):
        ddpkit.build_lmdb(source, root / f"{split}.lmdb", progress=False)
    example.run(example.parse_args(_flags(root, "--epochs", "1")))
    return root


# Class-balanced draws, each twice, RandAugment and Random Erasing: the run every test here reuses.
SAMPLING = [
    "--balance",
    "class",
    "--aug-repeats",
    "2",
    "--auto-augment",
    "rand",
    "--random-erase",
    "0.25",
]


def _flags(root: Path, *extra: str) -> list[str]:
    return [
        *SAMPLING,
        "--data",
        str(root),
        "--arch",
        "test_resnet",
        "--image-size",
        "32",
        "-b",
        "4",
        "-j",
        "0",
        "--checkpoints",
        str(root / "ckpt"),
        *extra,
    ]


def test_every_checkpoint_records_the_model(trained: Path) -> None:
    for name in ("latest.pth",):
        extra = ddpkit.load_checkpoint(trained / "ckpt" / name)["extra"]
        model = {k: v for k, v in extra.items() if k.startswith("--")}
        assert model == {
            "--arch": "test_resnet", "--num-classes": 3, "--image-size": 32,
            "--balance": "class", "--aug-repeats": 2, "--auto-augment": "rand",
            "--aug-magnitude": 9, "--random-erase": 0.25, "--batch-size": 4, "--seed": 0,
            "--data": str(trained),
        }  # fmt: skip
        # and the resolved flags, each with where its value came from
        assert extra["config"]["batch_size"] == {"value": 4, "source": "command line"}
        assert extra["config"]["lr"] == {"value": 0.1, "source": "default"}
        # 12 images drawn class-balanced, each twice: 24 a epoch in batches of 4.
        assert ddpkit.load_checkpoint(trained / "ckpt" / name)["position"]["step"] == 6


def test_a_resume_with_other_draws_or_augmentations_is_refused(trained: Path) -> None:
    args = example.parse_args(_flags(trained, "--resume", "--epochs", "2", "--balance", "sqrt"))
    with pytest.raises(ddpkit.CheckpointError, match="trained with --balance class; this run"):
        example.run(args)


def test_a_resume_with_another_batch_or_seed_is_refused(trained: Path) -> None:
    for change, said in ((["-b", "2"], "--batch-size 4; this run has --batch-size 2"),
                         (["--seed", "3"], "--seed 0; this run has --seed 3")):  # fmt: skip
        args = example.parse_args(_flags(trained, "--resume", "--epochs", "2", *change))
        with pytest.raises(ddpkit.CheckpointError, match=f"trained with {said}"):
            example.run(args)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (["--arch", "test_efficientnet"], "trained with --arch test_resnet"),
        (["--image-size", "48"], "trained with --image-size 32"),
        (["--num-classes", "5"], "trained with --num-classes 3"),
    ],
)
@pytest.mark.parametrize("mode", ["evaluate newest", "evaluate best.pth", "resume"])
def test_another_model_is_refused_before_loading(
    trained: Path, change: list[str], said: str, mode: str
) -> None:
    flags = {
        "evaluate newest": ["--evaluate"],
        "evaluate best.pth": ["--evaluate", "--resume", str(trained / "ckpt" / "best.pth")],
        "resume": ["--resume", "--epochs", "2"],
    }[mode]
    args = example.parse_args(_flags(trained, *flags))
    for flag, value in zip(change[::2], change[1::2], strict=True):
        setattr(args, flag[2:].replace("-", "_"), int(value) if value.isdigit() else value)
    with pytest.raises(ddpkit.CheckpointError) as caught:
        example.run(args)
    message = str(caught.value)
    assert said in message
    assert "Missing key" not in message
    assert "Unexpected key" not in message
    assert "Pass " + said.split("with ")[1] in message
    latest = ddpkit.load_checkpoint(trained / "ckpt" / "latest.pth")
    assert latest["epoch"] == 0  # the refused resume trained and wrote nothing


def test_the_right_model_still_evaluates(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    best = str(trained / "ckpt" / "best.pth")
    metrics = example.run(example.parse_args(_flags(trained, "--evaluate", "--resume", best)))
    assert metrics["samples"] == 6
    assert f"evaluate {best}: acc1" in capsys.readouterr().out


def test_a_fresh_run_over_a_finished_one_is_refused(trained: Path) -> None:
    with pytest.raises(ddpkit.CheckpointError) as caught:
        example.run(example.parse_args(_flags(trained, "--epochs", "1")))
    assert "holds another run's checkpoints" in str(caught.value)
    assert "--overwrite" in str(caught.value)


@pytest.mark.parametrize(
    ("batch", "nprocs", "choices"),
    [("15", "2", "use -b 14 or -b 16"), ("1", "2", "use -b 2"), ("10", "4", "use -b 8 or -b 12")],
)
def test_a_batch_that_does_not_divide_is_refused_by_the_parser(
    batch: str, nprocs: str, choices: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        example.parse_args(
            ["--data", "d", "-b", batch, "--multiprocessing-distributed", "--nprocs", nprocs]
        )
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"-b {batch} is not divisible by {nprocs} processes" in err
    assert choices in err
    example.parse_args(
        ["--data", "d", "-b", "16", "--multiprocessing-distributed", "--nprocs", "2"]
    )


@pytest.mark.timeout(120)
def test_a_batch_that_does_not_divide_under_torchrun_fails_fast(tmp_path: Path) -> None:
    # The ranks learn the world size from torchrun: they stop before building anything.
    script = str(ROOT / "examples" / "seresnext_lmdb.py")
    command = torchrun_command(2, script, "--data", str(tmp_path), "--arch", "test_resnet",
                               "-b", "15", "--dist-backend", "gloo")  # fmt: skip
    began = time.monotonic()
    # torchrun's workers start from the suite's server (warm.torchrun_warm_env).
    env = torchrun_warm_env(_env())
    done = warm_run(command, env=env, capture_output=True, text=True, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert out.count("-b 15 is not divisible by 2 processes") == 1, out[-3000:]
    assert "use -b 14 or -b 16" in out
    assert "batch_size=7" not in out  # the loader's advice, in a flag the example lacks
    assert "train.lmdb" not in out  # no dataset was opened (there is none here)
    assert time.monotonic() - began < 90


def _write_run(
    directory: Path,
    kinds: list[tuple[str, dict[str, object]]],
    extra: dict[str, object] | None = None,
) -> None:
    """Checkpoints of one run in ``directory``, in order: ``("epoch" | "step" | "interrupted",
    resolved flags)``, each recording its flags as the example does."""
    from torch import nn

    from ddpkit.checkpoint import TrainingState
    from ddpkit.position import Position

    model = nn.Linear(2, 2)
    state = TrainingState(model, torch_sgd(model))
    manager = ddpkit.CheckpointManager(directory, state=state, extra=extra)
    for step, (kind, config) in enumerate(kinds, start=1):
        if kind == "epoch":
            manager.save(0, step=step, extra={"config": config})
        else:
            manager.save_step(Position(1, 1, 4, step, 1), kind=kind, extra={"config": config})


def torch_sgd(model: object) -> object:
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.1)  # type: ignore[attr-defined]


def _config(root: Path, *flags: str) -> dict[str, object]:
    return ddpkit.CommandLine.resolved(example.parse_args(_flags(root, *flags)))


@pytest.mark.parametrize("kind", ["step", "interrupted"])
@pytest.mark.parametrize("with_latest", [False, True], ids=["first-epoch", "later-epoch"])
def test_changed_settings_are_told_from_the_checkpoint_the_resume_takes(
    tmp_path: Path, kind: str, with_latest: bool
) -> None:
    from ddpkit.examples.seresnext_flags import warn_changed_settings

    lr1, lr2 = _config(tmp_path), _config(tmp_path, "--lr", "0.2")
    # Killed in the first epoch (no latest.pth yet) or a later one, whose latest.pth was
    # written with the settings this run now asks for: the newer file decides.
    _write_run(tmp_path / "ckpt", [*([("epoch", lr2)] if with_latest else []), (kind, lr1)])
    manager = ddpkit.CheckpointManager(tmp_path / "ckpt")
    with pytest.warns(RuntimeWarning, match=r"--lr 0.1 -> 0.2\); the rest of the run") as said:
        warn_changed_settings(manager, lr2)
    newest = f"step-{2 if with_latest else 1:09d}.pth" if kind == "step" else "interrupted.pth"
    assert newest in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_changed_settings(manager, lr1)  # the settings it was saved with: nothing to say


def _resume_on_own_disk(rank: int, world_size: int, root: str) -> str:
    from torch import nn

    from ddpkit.checkpoint import TrainingState

    model = nn.Linear(2, 2)  # only rank 0's disk holds the step checkpoint
    manager = ddpkit.CheckpointManager(
        Path(root) / f"rank{rank}", state=TrainingState(model, torch_sgd(model)),
        extra={"--seed": 7},
    )  # fmt: skip
    try:
        manager.resume()
    except ddpkit.CheckpointError as exc:
        return str(exc)
    return "accepted"


def test_a_changed_seed_is_refused_from_a_checkpoint_only_another_node_holds(
    tmp_path: Path,
) -> None:
    from ddpkit.testing import run_distributed

    _write_run(tmp_path / "rank0", [("step", {})], extra={"--seed": 0})
    said = run_distributed(_resume_on_own_disk, 2, args=(str(tmp_path),), timeout=60)
    assert all("trained with --seed 0; this run has --seed 7" in s for s in said), said


def test_the_examples_use_public_ddpkit_names_only() -> None:
    # A recipe a user copies imports what ddpkit documents: the package and its names.
    import ast

    import ddpkit.examples

    public = set(ddpkit.__all__)
    for path in sorted(Path(ddpkit.examples.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpkit"):
                assert node.module == "ddpkit" or node.module.startswith("ddpkit.examples"), (
                    f"{path.name}: from {node.module} import ..."
                )
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "ddpkit"
            ):
                assert node.attr in public, f"{path.name}: ddpkit.{node.attr} is not public"


def test_the_demo_runs_with_the_example_s_own_flags_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing hidden in the namespace: every setting the demo passes on is a flag.
    flags = set(vars(example.parse_args(["--data", str(tmp_path)])))
    seen: list[set[str]] = []

    def run(args: object, schedule_epochs: int | None = None) -> dict[str, float]:
        seen.append(set(vars(args)))
        return {"val_acc1": 0.0}

    monkeypatch.setattr(example, "run", run)
    # The data the demo would build first: not what this test is about.
    monkeypatch.setattr(ddpkit, "make_shapes_dataset", lambda out, **_: (out / "t", out / "v"))
    monkeypatch.setattr(ddpkit, "build_lmdb", lambda *_, **__: None)
    args = example.parse_args(["--demo", "--out", str(tmp_path), "--demo-per-class", "2"])
    example.demo(args)
    assert len(seen) == 2
    assert all(keys <= flags for keys in seen), [sorted(keys - flags) for keys in seen]
