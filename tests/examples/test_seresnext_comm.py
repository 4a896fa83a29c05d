"""The example still learns with compressed gradients: handwritten digits, 2 processes, 3 hooks.

scikit-learn's 1,797 real 8 x 8 digit scans, scaled to 32 x 32, become an
LMDB; the example trains timm's small ``test_resnet`` on them from scratch
for 4 epochs on 2 CPU processes under torchrun (Gloo; workers forked from
the suite's preloaded server) with DDP's own all-reduce, bf16 and PowerSGD
(after one epoch of plain all-reduce, as the demo does). The bars: bf16
reaches the 90 % of the run without a hook, and PowerSGD comes within 2
points of that run.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from launched import LIMIT_S, launch, shown  # type: ignore[import-not-found]
from PIL import Image
from sklearn.datasets import load_digits  # type: ignore[import-untyped]
from warm import torchrun_command, torchrun_warm_env  # type: ignore[import-not-found]

import ddpkit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "seresnext_lmdb.py"
EPOCHS, BATCH = 4, 32


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    scans = load_digits()
    pixels = (scans.images * (255 / 16)).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(pixels))
    for split, part in (("train", order[:1400]), ("val", order[1400:])):
        for i in part:
            folder = root / "src" / split / str(scans.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(pixels[i]).resize((32, 32), Image.Resampling.BILINEAR)
            image.convert("RGB").save(folder / f"{i}.png")
        ddpkit.build_lmdb(root / "src" / split, root / f"{split}.lmdb", progress=False)
    return root


def _accuracy(data: Path, out: Path, *hook: str) -> tuple[float, str]:
    command = [*torchrun_command(2), str(SCRIPT), "--data", str(data), "--arch", "test_resnet",
               "--image-size", "32", "--min-crop", "0.7", "--epochs", str(EPOCHS),
               "-b", str(BATCH), "-j", "0", "--requires-grad", "--lr", "0.1",
               "--sched", "cosine", "--warmup-epochs", "1", "--checkpoints", str(out),
               "--dist-backend", "gloo", *hook]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    code, text = launch(command, torchrun_warm_env(env | {"OMP_NUM_THREADS": "1"}), ROOT)
    assert code == 0, shown(text)
    last = re.findall(rf"epoch {EPOCHS}/{EPOCHS}: .*?val_acc1 ([\d.]+)%", text)
    assert last, shown(text)
    return float(last[-1]), text


@pytest.mark.timeout(3 * LIMIT_S)
def test_bf16_and_powersgd_learn_digits_as_well(digits: Path, tmp_path: Path) -> None:
    plain, _ = _accuracy(digits, tmp_path / "none")
    bf16, text = _accuracy(digits, tmp_path / "bf16", "--comm-hook", "bf16")
    assert "(bf16)" in text
    steps = 1400 // BATCH  # one epoch of plain all-reduce first
    warm = ("--powersgd-warmup", str(steps))
    powersgd, text = _accuracy(digits, tmp_path / "powersgd", "--comm-hook", "powersgd", *warm)
    sent = [float(mb) for mb in re.findall(r"all-reduce ([\d.e-]+) MB/step \(powersgd\)", text)]
    print(f"val acc1 after {EPOCHS} epochs: none {plain}%, bf16 {bf16}%, powersgd {powersgd}%")
    assert len(sent) == EPOCHS, sent
    assert sent[-1] < sent[0] / 4, sent  # it compressed after its warm-up epoch
    records = [json.loads(line) for line in (tmp_path / "powersgd" / "metrics.jsonl").open()]
    epochs = [r for r in records if "epoch" in r and "comm_hook" in r]
    assert [r["comm_hook"] for r in epochs] == ["powersgd"] * EPOCHS
    assert epochs[-1]["comm_bytes_per_step"] == pytest.approx(sent[-1] * 1e6, rel=0.01)
    assert plain >= 90, plain
    assert bf16 >= 90, (plain, bf16)
    assert powersgd >= plain - 2, (plain, powersgd)
