"""save_checkpoint / load_checkpoint: atomic files that load with weights_only=True."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ddpkit import CheckpointError, load_checkpoint, save_checkpoint


class _Custom:
    """A class that only a full unpickle can rebuild."""


def _trained() -> tuple[nn.Linear, torch.optim.SGD, torch.optim.lr_scheduler.StepLR]:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_round_trip_converts_numpy_scalars_in_a_copy(tmp_path: Path) -> None:
    model, optimizer, scheduler = _trained()
    metrics = {"acc1": np.float32(71.5), "count": np.int64(7), "ok": np.bool_(True)}
    obj = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "metrics": metrics,
        "meta": (torch.Size([2, 3]), torch.float16, torch.device("cpu"), None, "x", 2**70),
    }
    path = tmp_path / "ckpt.pth"
    save_checkpoint(obj, path)

    back = load_checkpoint(path)
    assert _leftovers(tmp_path) == ["ckpt.pth"]
    for key, value in model.state_dict().items():
        assert torch.equal(back["model"][key], value)
    momentum = back["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert back["scheduler"] == scheduler.state_dict()
    assert back["metrics"] == {"acc1": 71.5, "count": 7, "ok": True}
    assert [type(v) for v in back["metrics"].values()] == [float, int, bool]
    assert back["meta"] == obj["meta"]
    assert type(metrics["acc1"]) is np.float32  # the caller's object is untouched
    assert torch.load(path, weights_only=True)["meta"][0] == torch.Size([2, 3])


@pytest.mark.parametrize(
    ("bad", "where", "hint"),
    [
        ({"metrics": {"acc1": lambda: 1.0}}, "metrics.acc1", "function"),
        ({"extra": [1, _Custom()]}, "extra.1", "_Custom"),
        (
            {"optimizer": {"state": {3: {"momentum_buffer": np.zeros(2)}}}},
            "optimizer.state.3.momentum_buffer",
            "torch.from_numpy",
        ),
        ({"counts": collections.defaultdict(int)}, "counts", "defaultdict"),
        ({"k": {_Custom(): 1}}, "(the key)", "_Custom"),
    ],
)
def test_refuses_what_weights_only_cannot_load(
    tmp_path: Path, bad: dict[str, Any], where: str, hint: str
) -> None:
    path = tmp_path / "ckpt.pth"
    save_checkpoint({"step": 1}, path)
    with pytest.raises(TypeError, match=rf"{where}.*{hint}|{hint}.*{where}"):
        save_checkpoint(bad, path)
    assert _leftovers(tmp_path) == ["ckpt.pth"]
    assert load_checkpoint(path) == {"step": 1}


def test_failure_while_writing_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.pth"
    save_checkpoint({"step": 1}, path)

    def disk_full(obj: object, f: Any) -> None:
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert _leftovers(tmp_path) == ["ckpt.pth"]
    assert load_checkpoint(path) == {"step": 1}


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        save_checkpoint({"a": 1}, tmp_path / "nowhere" / "ckpt.pth")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="file"):
        save_checkpoint({"a": 1}, tmp_path / "file" / "ckpt.pth")


_CRASH_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from ddpkit import save_checkpoint
    save_checkpoint({"step": 1, "w": torch.ones(4)}, sys.argv[1])
    big = torch.ones(50_000_000)  # 200 MB: the write takes long enough to be killed
    print("first saved", flush=True)
    save_checkpoint({"step": 2, "big": big}, sys.argv[1])
    print("second saved", flush=True)
    """
)


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASH_SCRIPT, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "first saved"
        deadline, last_size = time.monotonic() + 60, 0
        while True:
            assert time.monotonic() < deadline, "the second save never started writing"
            assert proc.poll() is None, "the second save finished before it could be killed"
            temps = list(tmp_path.glob(".ckpt.pth.tmp-*"))
            size = temps[0].stat().st_size if temps else 0
            if 0 < last_size < size:  # the temp file is there and growing
                break
            last_size = size
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    back = load_checkpoint(path)
    assert back["step"] == 1
    assert torch.equal(back["w"], torch.ones(4))


def test_load_reports_damaged_missing_and_unsafe_files(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    save_checkpoint({"w": torch.arange(1000.0)}, path)
    data = path.read_bytes()
    for size in (0, 10, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=r"ckpt\.pth is damaged.*older checkpoint"):
            load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match=r"absent\.pth"):
        load_checkpoint(tmp_path / "absent.pth")
    unsafe = tmp_path / "unsafe.pth"
    torch.save({"obj": _Custom()}, unsafe)
    with pytest.raises(CheckpointError, match=r"unsafe\.pth.*_Custom.*weights_only-safe"):
        load_checkpoint(unsafe)
    torch.save(torch.ones(2), unsafe)
    with pytest.raises(CheckpointError, match="not a dict"):
        load_checkpoint(unsafe)
