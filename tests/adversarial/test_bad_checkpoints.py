"""Damaged checkpoints, full disks and killed saves: caught, named, and nothing lost."""

from __future__ import annotations

import errno
import math
import random
import re
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from corpus import dead_pid, image_tree, leftover_name, small_disk, snapshot
from torch import nn

from ddpkit import CheckpointError, CheckpointManager, load_checkpoint, save_checkpoint
from ddpkit.checkpoint import TrainingState
from ddpkit.data import build_lmdb
from ddpkit.testing import run_distributed


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4096.0), "b": torch.ones(16)}


def _rot(path: Path, record_suffix: str) -> None:
    """Flip a byte inside one stored record of a checkpoint, as bit rot would."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record_suffix))
    # The local header: 30 bytes, then the name and an extra field whose lengths it
    # gives (torch pads the extra field to align tensors); the data follow.
    head = info.header_offset
    name_len, extra_len = struct.unpack_from("<HH", data, head + 26)
    start = head + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_bit_rot_in_a_tensor_is_caught_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    save_checkpoint(_state(), path)
    _rot(path, "data/0")
    with pytest.raises(CheckpointError, match=r"record '.*data/0' fails its CRC check"):
        load_checkpoint(path)


def test_resume_falls_back_when_latest_rotted(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path, keep_last=2, state=TrainingState(model, optimizer))
    manager.save(0, metrics={"acc1": 1.0})
    manager.save(1, metrics={"acc1": 2.0})
    _rot(tmp_path / "latest.pth", "data/0")
    with pytest.warns(RuntimeWarning, match="CRC"):
        start = CheckpointManager(tmp_path, state=TrainingState(model, optimizer)).resume()
    assert start == 1  # previous.pth: epoch 0


def _load_each(rank: int, world_size: int, paths: list[str]) -> list[str]:
    """What load_checkpoint says of each file (in a child: a loader could crash)."""
    out = []
    for path in paths:
        try:
            load_checkpoint(path)
            out.append("loaded")
        except CheckpointError as exc:
            out.append(str(exc))
    return out


def test_truncations_and_damage_are_named_and_never_advise_unsafe_loading(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    save_checkpoint({**_state(), "meta": {"epoch": 3, "names": ["a", "b"]}}, path)
    data = path.read_bytes()
    damaged = []
    for k, size in enumerate(
        [1, 100, len(data) // 3, len(data) // 2, len(data) - 22, len(data) - 1]
    ):
        damaged.append(tmp_path / f"cut{k}.pth")
        damaged[-1].write_bytes(data[:size])
    with zipfile.ZipFile(path) as archive:  # a pickle garbled, its CRC made to match
        names = {i.filename: archive.read(i.filename) for i in archive.infolist()}
    pickled = next(n for n in names if n.endswith("data.pkl"))
    names[pickled] = names[pickled][:20] + b"\x8f\x8f\x8f" + names[pickled][23:]
    garbled = tmp_path / "garbled.pth"
    with zipfile.ZipFile(garbled, "w", zipfile.ZIP_STORED) as archive:
        for name, body in names.items():
            archive.writestr(name, body)
    damaged.append(garbled)
    said = run_distributed(_load_each, 1, args=([str(p) for p in damaged],), init=None, timeout=120)
    for path_, message in zip(damaged, said[0], strict=True):
        assert message != "loaded", path_
        assert str(path_) in message
        assert "weights_only=False" not in message
        assert "use an older checkpoint" in message


def test_a_full_disk_is_named_and_the_previous_file_kept(tmp_path: Path) -> None:
    with small_disk(tmp_path, "1m") as disk:
        if disk is None:
            pytest.skip("cannot mount a small tmpfs here (needs root on Linux)")
        path = disk / "ckpt.pth"
        save_checkpoint({"w": torch.ones(16)}, path)
        before = path.read_bytes()
        with pytest.raises(OSError, match="No space left on") as info:
            save_checkpoint({"w": torch.ones(1 << 20)}, path)  # 4 MiB on a 1 MiB disk
        assert info.value.errno == errno.ENOSPC
        assert "about 4.1 MiB needed" in str(info.value)  # 4 MiB and the file format, rounded up
        assert "free" in str(info.value)
        assert path.read_bytes() == before
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt.pth"]  # no temporary left


def test_a_full_disk_stops_a_build_cleanly(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs", per_class=40)
    with small_disk(tmp_path, "64k") as disk:
        if disk is None:
            pytest.skip("cannot mount a small tmpfs here (needs root on Linux)")
        with pytest.raises(OSError, match="No space left on") as info:
            build_lmdb(tree, disk / "db", progress=False)
        assert info.value.errno == errno.ENOSPC
        assert "needed" in str(info.value)
        assert list(disk.iterdir()) == []  # neither a database nor a temporary


def test_leftovers_of_killed_saves_are_removed_by_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "latest.pth"
    stale = leftover_name(path, "tmp", dead_pid(), hidden=True)
    stale.write_bytes(b"x" * 4096)
    other_host = tmp_path / ".latest.pth.tmp-elsewhere-1-0123abcd"
    other_host.write_bytes(b"y")
    save_checkpoint(_state(), path)
    assert not stale.exists()
    assert other_host.exists()  # another node's save in progress, maybe: not ours to remove
    keep = snapshot(tmp_path)
    save_checkpoint(_state(), path)  # a second save finds nothing more to remove
    assert snapshot(tmp_path).keys() == keep.keys()


def test_a_damaged_compression_field_is_a_checkpoint_error(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path, state=TrainingState(model, optimizer))
    manager.save(0)
    manager.save(1)
    latest = tmp_path / "latest.pth"
    data = bytearray(latest.read_bytes())
    central = data.index(b"PK\x01\x02")  # the first central directory entry
    struct.pack_into("<H", data, central + 10, 8)  # says deflate; the data are stored
    latest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(latest)
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert CheckpointManager(tmp_path, state=TrainingState(model, optimizer)).resume() == 1


def test_other_failures_are_not_called_a_full_disk(tmp_path: Path) -> None:
    from ddpkit.checkpoint.serialization import replace_atomic

    def refused(tmp: Path) -> None:
        raise PermissionError(13, "Permission denied", str(tmp))

    with pytest.raises(PermissionError):
        replace_atomic(tmp_path / "ckpt.pth", refused, needed=10**15)


def test_shared_storages_count_once_in_the_room_a_save_needs() -> None:
    from ddpkit.checkpoint.serialization import payload_bytes

    weight = torch.zeros(1000)
    views = {f"v{i}": weight[i : i + 1] for i in range(100)}
    assert payload_bytes({"a": weight, "tied": weight, **views}) < 2 * weight.nbytes


def _random_tree(root: Path, count: int, low: int, high: int, seed: int) -> Path:
    """``count`` files of ``low..high`` random bytes after a JPEG signature, in two classes."""
    rng = random.Random(seed)
    for i in range(count):
        path = root / f"c{i % 2}" / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\xff\xd8\xff" + rng.randbytes(rng.randint(low, high) - 3))
    return root


def _needed(message: str) -> int:
    number, unit = re.search(r"about ([\d.]+) (MiB|KiB) needed", message).groups()  # type: ignore[union-attr]
    return math.ceil(float(number) * (2**20 if unit == "MiB" else 2**10))


def test_the_room_a_full_disk_build_asks_for_is_enough(tmp_path: Path) -> None:
    # 5 KiB images take two 4 KiB pages each: the image bytes alone are far too few.
    tree = _random_tree(tmp_path / "imgs", 600, 4500, 5500, seed=3)
    with small_disk(tmp_path, "512k") as disk:
        if disk is None:
            pytest.skip("cannot mount a small tmpfs here (needs root on Linux)")
        with pytest.raises(OSError, match="No space left on") as info:
            build_lmdb(tree, disk / "db", check="none", progress=False)
    needed = _needed(str(info.value))
    images = sum(p.stat().st_size for p in tree.rglob("*.jpg"))
    assert needed > images * 1.4  # counts LMDB's pages, not only the image bytes
    with small_disk(tmp_path, f"{needed // 1024 + 1}k") as disk:
        assert disk is not None
        build_lmdb(tree, disk / "db", check="none", progress=False)  # that much is enough
        actual = (disk / "db" / "data.mdb").stat().st_size
    assert needed <= actual * 1.25


@pytest.mark.parametrize(
    ("count", "low", "high"),
    [(40, 300, 1500), (300, 1500, 2100), (400, 3000, 9000), (1500, 100, 30000)],
)
def test_the_size_estimate_covers_a_real_build(
    tmp_path: Path, count: int, low: int, high: int
) -> None:
    from ddpkit.data.lmdb_pages import PageEstimate

    tree = _random_tree(tmp_path / "imgs", count, low, high, seed=count)
    build_lmdb(tree, tmp_path / "db", check="none", progress=False)
    actual = (tmp_path / "db" / "data.mdb").stat().st_size
    files = sorted(tree.rglob("*.jpg"), key=lambda p: (p.parent.name, p.name))
    estimate = PageEstimate(4096)
    for k, path in enumerate(files, 1):
        estimate.add(path.stat().st_size)
        estimate.commits += k % 1000 == 0
    names = sum(len(f"{p.parent.name}/{p.name}") for p in files)
    needed = estimate.bytes() + estimate.record(64 * count + 4096 + names)
    assert actual <= needed <= actual * 1.1 + 128 * 1024
