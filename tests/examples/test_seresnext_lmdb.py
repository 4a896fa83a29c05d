"""ddpkit.examples.seresnext_lmdb: flags, mode choice, the demo with resume, and two nodes."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from warm import warm_popen, warm_run  # type: ignore[import-not-found]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "seresnext_lmdb.py"
# What a child of the test inherits: one thread per process, and no launcher
# variables from whatever started pytest.
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
)


example = importlib.import_module("ddpkit.examples.seresnext_lmdb")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(30)
def test_defaults_follow_the_recipe() -> None:
    args = example.parse_args(["--data", "d"])
    assert args.arch == "legacy_seresnext101_32x4d"
    assert (args.batch_size, args.epochs, args.image_size, args.world_size, args.rank) == (
        256,
        90,
        224,
        1,
        0,
    )
    assert args.dist_backend == "auto"
    assert not args.requires_grad
    assert not args.resume
    assert args.milestones == [30, 60]
    assert args.pretrained is None
    assert args.num_classes is None
    assert not args.freeze_backbone
    assert not args.evaluate
    assert (args.network, args.log_dir, args.keep_last) == (None, None, 3)


@pytest.mark.timeout(30)
def test_flags() -> None:
    args = example.parse_args(
        shlex.split(
            "--data d -b 512 -j 8 --wd 5e-4 --milestones 10 20 --amp bf16 --requires-grad "
            "--multiprocessing-distributed --world-size 2 --rank 1 "
            "--dist-url tcp://10.0.0.1:23456 --nprocs 4 --resume --network seresnext101"
        )
    )
    assert (args.batch_size, args.workers, args.weight_decay) == (512, 8, 5e-4)
    assert args.milestones == [10, 20]
    assert args.amp == "bf16"
    assert args.requires_grad
    assert (args.world_size, args.rank, args.nprocs) == (2, 1, 4)
    assert args.dist_url == "tcp://10.0.0.1:23456"
    assert args.resume
    assert example.parse_args(["--demo"]).out == "demo-out"
    with pytest.raises(SystemExit):
        example.parse_args([])  # neither --data nor --demo
    assert example.parse_args(["--data", "d", "--gpu", "1"]).gpu == 1


@pytest.mark.timeout(30)
def test_gpu_with_spawn_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        example.parse_args(["--data", "d", "--gpu", "0", "--multiprocessing-distributed"])
    assert "drop --gpu" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("argv", "explicit"),
    [
        ([], {}),
        (["--world-size", "2", "--rank", "1", "--dist-url", "tcp://h:1"],
         {"init_method": "tcp://h:1", "world_size": 2, "rank": 1}),
        (["--gpu", "1"], {"device": "cuda:1"}),
        (["--dist-backend", "gloo"], {"backend": "gloo"}),
    ],
)  # fmt: skip
def test_init_arguments(argv: list[str], explicit: dict[str, object]) -> None:
    # Only the recipe's own node arguments are passed; a launcher's variables are
    # init_distributed's to read, so the example never looks at the environment.
    args = example.parse_args(["--data", "d", *argv])
    expected = {"backend": "auto", "device": None, **explicit}
    assert example.init_arguments(args) == expected


def test_the_example_leaves_launchers_to_init_distributed() -> None:
    source = SCRIPT.read_text()
    assert "detect_launcher" not in source
    assert "os.environ" not in source


@pytest.mark.timeout(60)
def test_model_from_imagenet_weights_trains_only_the_head(tmp_path: Path) -> None:
    import timm
    import torch

    torch.manual_seed(0)
    imagenet = timm.create_model("legacy_seresnext26_32x4d", num_classes=1000)
    torch.save(imagenet.state_dict(), tmp_path / "imagenet.pth")
    argv = ["--data", "d", "--arch", "legacy_seresnext26_32x4d", "--pretrained"]
    args = example.parse_args([*argv, str(tmp_path / "imagenet.pth")])

    model = example.build_model(args, 5)

    assert model.last_linear.out_features == 5
    assert torch.equal(model.layer0.conv1.weight, imagenet.layer0.conv1.weight)
    assert torch.equal(model.layer4[1].bn3.running_var, imagenet.layer4[1].bn3.running_var)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["last_linear.weight", "last_linear.bias"]
    everything = example.build_model(example.parse_args([*argv[:4], "--requires-grad"]), 5)
    assert all(p.requires_grad for p in everything.parameters())

    frozen = example.parse_args([*argv, str(tmp_path / "imagenet.pth"), "--freeze-backbone"])
    head = [n for n, p in example.build_model(frozen, 5).named_parameters() if p.requires_grad]
    assert head == ["last_linear.weight", "last_linear.bias"]


@pytest.mark.timeout(30)
def test_without_pretrained_weights_every_layer_trains(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A head on random features learns next to nothing: no silent freeze.
    model = example.build_model(example.parse_args(["--data", "d", "--arch", "test_resnet"]), 3)
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(SystemExit):
        example.parse_args(["--data", "d", "--freeze-backbone"])
    assert "random without --pretrained" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.parse_args(["--data", "d", "--pretrained", "w.pth", "--freeze-backbone",
                            "--requires-grad"])  # fmt: skip
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_weight_files_are_named_after_the_arch(capsys: pytest.CaptureFixture[str]) -> None:
    def prefix(*argv: str) -> str:
        return str(example.weights_prefix(example.parse_args(["--data", "d", *argv])))

    assert prefix() == "legacy_seresnext101_32x4d"
    assert prefix("--arch", "resnet18") == "resnet18"
    assert prefix("--arch", "resnet18", "--network", "mine") == "mine"
    assert prefix("--arch", "hf-hub:timm/resnet50.a1_in1k") == "hf-hub-timm-resnet50.a1_in1k"
    with pytest.raises(SystemExit):
        example.parse_args(["--data", "d", "--network", "a/b"])
    assert "without '/'" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("workers", "nprocs", "each"),
    [(4, 8, 1), (1, 8, 1), (16, 8, 2), (17, 8, 3), (0, 8, 0), (3, 1, 3), (None, 8, None)],
)
def test_workers_per_node_are_shared_out_rounding_up(
    workers: int | None, nprocs: int, each: int | None
) -> None:
    assert example.workers_per_process(workers, nprocs) == each


@pytest.mark.timeout(30)
def test_the_global_batch_is_told_at_start_and_in_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = example.batch_line(256, 8, 32, 2)
    assert line.startswith("global batch 256 ")
    assert line.endswith("= 8 processes x 32 per process; 2 data workers per process")
    assert "not per node" in line
    assert example.batch_line(4, 1, 4, 1).endswith(
        "= 1 process x 4 per process; 1 data worker per process"
    )
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "the GLOBAL batch" in shown
    assert "NOT per node as in the PyTorch ImageNet example" in shown


@pytest.mark.timeout(30)
def test_spawn_without_a_gpu_asks_for_the_nprocs_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(example.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit):
        example.parse_args(["--data", "d", "--multiprocessing-distributed"])
    assert "pass --nprocs N" in capsys.readouterr().err
    args = example.parse_args(["--data", "d", "--multiprocessing-distributed", "--nprocs", "2"])
    assert args.nprocs == 2
    monkeypatch.setattr(example.torch.cuda, "device_count", lambda: 4)
    assert example.parse_args(["--data", "d", "--multiprocessing-distributed"]).nprocs is None


@pytest.mark.timeout(30)
def test_evaluate_and_log_flags() -> None:
    args = example.parse_args(["--data", "d", "-e", "--resume", "best.pth", "--log-dir", "logs",
                               "--keep-last", "5"])  # fmt: skip
    assert (args.evaluate, args.resume, args.log_dir, args.keep_last) == (
        True, "best.pth", "logs", 5)  # fmt: skip
    with pytest.raises(SystemExit):
        example.parse_args(["--demo", "--evaluate"])


@pytest.mark.timeout(240)
def test_demo_trains_then_resumes(tmp_path: Path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--demo", "--out", str(tmp_path), "--demo-epochs", "1",
           "--demo-per-class", "4", "--demo-classes", "2"]  # fmt: skip
    done = warm_run(cmd, env=_env(), capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest.pth").is_file()
    assert list(checkpoints.glob("demo-epoch1-acc*.pth"))  # epochs count from 1
    assert list(checkpoints.glob("demo-epoch2-acc*.pth"))
    assert not list(checkpoints.glob("demo-epoch0-*"))
    assert "resuming at epoch 2 step" in done.stdout
    assert "epoch 2/2: train_loss" in done.stdout
    assert "final val acc1" in done.stdout
    assert "after 2 epochs" in done.stdout
    # The curves cover both jobs: the resumed one continues the first one's record.
    from ddpkit.training.plotting import read_metrics

    assert (checkpoints / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["epoch"] for r in read_metrics(checkpoints)[1]] == [1, 2]


@pytest.mark.timeout(240)
def test_two_nodes_one_process_each(tmp_path: Path) -> None:
    import ddpkit
    from ddpkit.data.shapes import make_shapes_dataset

    train_dir, val_dir = make_shapes_dataset(
        tmp_path / "shapes", classes=3, train_per_class=4, val_per_class=2, size=32
    )
    ddpkit.build_lmdb(train_dir, tmp_path / "train.lmdb", progress=False)
    ddpkit.build_lmdb(val_dir, tmp_path / "val.lmdb", progress=False)
    url = f"tcp://127.0.0.1:{_free_port()}"
    common = [sys.executable, str(SCRIPT), "--data", str(tmp_path), "--arch",
              "legacy_seresnext26_32x4d", "--image-size", "32", "--epochs", "1", "-b", "4",
              "-j", "0", "--requires-grad", "--checkpoints", str(tmp_path / "ckpt"),
              "--world-size", "2", "--dist-url", url, "--dist-backend", "gloo"]  # fmt: skip
    nodes = [
        warm_popen(
            [*common, "--rank", str(r)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        errors = [node.communicate(timeout=200)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    assert "epoch 1/1: train_loss" in errors[0]
    assert "epoch 1/1" not in errors[1]  # rank 0 alone prints the epoch lines
    assert (tmp_path / "ckpt" / "latest.pth").is_file()


def _shapes_data(directory: Path, per_class: int) -> None:
    """train.lmdb and val.lmdb of 3 shape classes at 32 px in ``directory``."""
    import ddpkit
    from ddpkit.data.shapes import make_shapes_dataset

    dirs = make_shapes_dataset(
        directory / "shapes", classes=3, train_per_class=per_class, val_per_class=2, size=32
    )
    for split, source in zip(("train", "val"), dirs, strict=True):
        ddpkit.build_lmdb(source, directory / f"{split}.lmdb", progress=False)


@pytest.mark.timeout(240)
def test_evaluate_prints_the_accuracy_training_logged(tmp_path: Path) -> None:
    _shapes_data(tmp_path, 4)
    ckpt = tmp_path / "ckpt"
    # -j 1: a run whose loaders have workers must exit too, curves drawn or not.
    common = [sys.executable, str(SCRIPT), "--data", str(tmp_path), "--arch", "test_resnet",
              "--image-size", "32", "-b", "4", "-j", "1", "--checkpoints", str(ckpt)]  # fmt: skip

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return warm_run([*common, *argv], env=_env(), capture_output=True, text=True,
                              timeout=100)  # fmt: skip

    trained = run("--epochs", "1")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "global batch 4 (-b: all processes of all nodes, not per node) = 1 process x 4 " \
           "per process; 1 data worker per process" in trained.stderr  # fmt: skip
    assert list(ckpt.glob("test_resnet-epoch*-acc*.pth"))  # named after --arch
    # metrics.jsonl goes to the checkpoint directory by default
    logged = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    record = [r for r in logged if "val_acc1" in r][-1]

    assert "val_acc5" not in record  # 3 classes: top-5 is always 100 %
    expected = f"acc1 {record['val_acc1']:.3f} " \
               f"loss {record['val_loss']:.6g} samples {record['val_samples']:.0f}"  # fmt: skip
    for argv in ([], ["--resume", str(next(ckpt.glob("test_resnet-epoch*.pth")))]):
        evaluated = run("--evaluate", *argv)
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        assert expected in evaluated.stdout, (expected, evaluated.stdout)

    nothing = run("--evaluate", "--checkpoints", str(tmp_path / "empty"))
    assert nothing.returncode != 0
    assert "--evaluate: no checkpoint in" in nothing.stderr


def test_checkpoints_on_a_store_train_evaluate_elsewhere_and_refuse_a_missing_bucket(
    tmp_path: Path,
) -> None:
    """--checkpoints s3://...: moto's S3 server on 127.0.0.1, two machines' local sides."""
    from s3_fixtures import S3Server  # type: ignore[import-not-found]

    server = S3Server()
    try:
        _shapes_data(tmp_path, 4)
        url = f"s3://{server.bucket()}/exp1"
        common = [sys.executable, str(SCRIPT), "--data", str(tmp_path), "--arch", "test_resnet",
                  "--image-size", "32", "-b", "4", "-j", "0", "--checkpoints", url]  # fmt: skip

        def run(machine: str, *argv: str) -> subprocess.CompletedProcess[str]:
            env = {**_env(), **server.env(), "XDG_CACHE_HOME": str(tmp_path / machine)}
            return warm_run([*common, *argv], env=env, capture_output=True, text=True,
                            timeout=100)  # fmt: skip

        trained = run("first", "--epochs", "1")
        assert trained.returncode == 0, trained.stderr[-3000:]
        objects = [key.rsplit("/", 1)[1] for key in server.fs().find(url[5:])]
        assert {"latest.pth", "best.pth", "metrics.jsonl"} <= set(objects), objects
        assert not (Path.cwd() / "s3:").exists()  # never a local folder named after the URL
        side = tmp_path / "first" / "ddpkit" / "checkpoints" / url[5:]
        logged = [json.loads(line) for line in (side / "metrics.jsonl").read_text().splitlines()]
        record = [r for r in logged if "val_acc1" in r][-1]
        evaluated = run("second", "--evaluate")  # a machine that never held the run
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        assert f"acc1 {record['val_acc1']:.3f}" in evaluated.stdout, evaluated.stdout
        missing = run("third", "--epochs", "1", "--checkpoints", "s3://no-such-bucket-x/exp1")
        assert missing.returncode == 1, missing.stderr[-3000:]
        assert "bucket 'no-such-bucket-x' does not exist" in missing.stderr
        assert "Traceback" not in missing.stderr
        assert "epoch 1/1" not in missing.stderr + missing.stdout  # refused before training
    finally:
        server.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv",
    [
        ["--save-every-steps", "0"],
        ["--save-every-steps", "-1"],
        ["--save-every-steps", "2.5"],
        ["--save-every-minutes", "0"],
        ["--save-every-minutes", "nan"],
        ["--hang-timeout", "-5"],
        ["--hang-timeout", "inf"],
        ["--max-restarts", "-1", "--multiprocessing-distributed"],
        ["--max-restarts", "2"],  # without --multiprocessing-distributed
        ["--keep-last", "0"],
        ["-b", "0"],
        ["-j", "-1"],
        ["--nprocs", "0"],
        ["--aug-repeats", "0"],
        ["--balance", "inverse"],
        ["--auto-augment", "autoaugment"],
        ["--random-erase", "1.5"],
        ["--aug-magnitude", "11", "--auto-augment", "augmix"],
        ["--aug-magnitude", "31", "--auto-augment", "rand"],
    ],
)
def test_fault_flags_are_checked_before_anything_runs(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(["--data", "d", *argv])
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_fault_flags() -> None:
    args = example.parse_args(["--data", "d", "--save-every-steps", "500", "--save-every-minutes",
                               "10", "--hang-timeout", "600", "--save-on-each-node",
                               "--multiprocessing-distributed", "--nprocs", "2",
                               "--max-restarts", "3"])  # fmt: skip
    assert (args.save_every_steps, args.save_every_minutes, args.hang_timeout) == (500, 10.0, 600.0)
    assert (args.save_on_each_node, args.max_restarts, args.resume) == (True, 3, False)
    assert example.parse_args(["--data", "d", "--resume"]).resume is True
    assert example.parse_args(["--data", "d", "--resume", "x.pth"]).resume == "x.pth"


@pytest.mark.timeout(30)
def test_the_modern_recipe_flags() -> None:
    args = example.parse_args(["--data", "d"])
    assert (args.sched, args.warmup_epochs, args.model_ema, args.mixup, args.cutmix) == (
        "step",
        0.0,
        False,
        0.0,
        0.0,
    )  # the recipe's training unless asked
    assert args.lr_base is None
    assert args.clip_grad is None
    assert not args.compile
    args = example.parse_args(["--data", "d", "--sched", "cosine", "--warmup-epochs", "2.5",
                               "--lr-base", "0.2", "--model-ema", "--model-ema-decay", "0.999",
                               "--mixup", "0.8", "--cutmix", "1", "--clip-grad", "5",
                               "--compile"])  # fmt: skip
    assert (args.sched, args.warmup_epochs, args.lr_base, args.model_ema_decay) == (
        "cosine",
        2.5,
        0.2,
        0.999,
    )
    assert (args.mixup, args.cutmix, args.clip_grad, args.compile) == (0.8, 1.0, 5.0, True)
    for bad in (["--lr", "0.1", "--lr-base", "0.1"], ["--model-ema-decay", "1"],
                ["--warmup-epochs", "90"], ["--mixup", "-1"], ["--clip-grad", "0"],
                ["--sched", "linear"], ["--epochs", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            example.parse_args(["--data", "d", *bad])


@pytest.mark.timeout(240)
def test_the_modern_recipe_trains_resumes_and_reports(tmp_path: Path) -> None:
    import ddpkit

    _shapes_data(tmp_path, 8)
    ckpt = tmp_path / "ckpt"
    common = [sys.executable, str(SCRIPT), "--data", str(tmp_path), "--arch", "test_resnet",
              "--image-size", "32", "-b", "4", "-j", "0", "--checkpoints", str(ckpt),
              "--sched", "cosine", "--warmup-epochs", "1", "--lr-base", "0.4", "--model-ema",
              "--model-ema-decay", "0.9", "--mixup", "0.8", "--cutmix", "1.0",
              "--clip-grad", "2"]  # fmt: skip

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return warm_run([*common, *argv], env=_env(), capture_output=True, text=True,
                              timeout=150)  # fmt: skip

    first = run("--epochs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "val_ema_acc1" in first.stdout, first.stdout
    assert "worst class" in first.stdout, first.stdout
    again = run("--epochs", "3", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming at epoch 3 step 12" in again.stdout, again.stdout
    logged = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in logged if "epoch" in r]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    # --lr-base 0.4 per 256 images at -b 4: a peak of 0.00625, reached after the warm-up.
    assert records[0]["lr"] < 0.00625
    assert records[1]["lr"] < 0.00625
    assert records[2]["lr"] < records[1]["lr"]
    for r in records:
        assert len(r["val_recall"]) == 3
        assert len(r["val_confusion"]) == 3
        assert r["val_worst_class"] in ("blue_circle", "green_circle", "red_circle")
    state = ddpkit.load_checkpoint(ckpt / "latest.pth")
    assert state["ema"] is not None
    assert int(state["ema"]["n_averaged"]) == 18


def test_profile_steps_are_a_to_b_and_off_by_default() -> None:
    assert example.parse_args(["--data", "d"]).profile_steps is None
    args = example.parse_args(["--data", "d", "--profile-steps", "10:12", "--profile-ranks", "0"])
    assert (args.profile_steps, args.profile_ranks) == ((10, 12), [0])
    for bad in ("12:10", "10", "a:b"):
        with pytest.raises(SystemExit):
            example.parse_args(["--data", "d", "--profile-steps", bad])
