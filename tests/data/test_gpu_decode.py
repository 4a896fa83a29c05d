"""decode="cuda" on the CPU: the byte batches, the crop boxes and the fallback, without a GPU.

Everything but the GPU decoder itself runs here: the workers' encoded samples,
their collation, the crop boxes drawn from the same seeds as the CPU path,
and the batch decode with TorchCodec's decoder on the CPU, which must give
exactly the CPU path's pixels (on a GPU, nvJPEG's differ by rounding: the
GPU battery compares those, ``make gpu-check``).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lmdb_fixtures import varied_images, write_db

import ddpkit
from ddpkit.data import gpu_decode
from ddpkit.data.gpu_decode import Encoded, EncodedBatch, collate

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")


@pytest.fixture(scope="module")
def varied_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RGB, grayscale and CMYK JPEGs, PNGs, a WebP and a BMP, three times over."""
    images = varied_images() * 3
    path = tmp_path_factory.mktemp("varied") / "varied.lmdb"
    return write_db(path, images, [i % 2 for i in range(len(images))], ["a", "b"])


@pytest.fixture
def cuda_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let decode="cuda" be built here: its batches then decode on the CPU, as on a GPU."""
    monkeypatch.setattr(gpu_decode, "require_cuda", lambda: None)


@needs_no_cuda
def test_decode_cuda_without_a_gpu_is_refused_naming_what_it_needs(varied_db: Path) -> None:
    with pytest.raises(ValueError, match=r"needs a CUDA device.*decode='tensor'"):
        ddpkit.LazyLMDBDataset(varied_db, ddpkit.train_transform(32), decode="cuda")


@needs_no_cuda
def test_the_examples_decode_cuda_flag_is_refused_without_a_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ddpkit.examples.seresnext_flags import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--demo", "--decode", "cuda"])
    assert exit_info.value.code == 2
    assert "--decode cuda" in capsys.readouterr().err


def test_decode_cuda_takes_only_crops_the_gpu_can_take(varied_db: Path, cuda_allowed: None) -> None:
    for transform in (None, ddpkit.train_transform(32, auto_augment="rand")):
        with pytest.raises(ValueError, match=r"decode='cuda' takes ddpkit\.train_transform"):
            ddpkit.LazyLMDBDataset(varied_db, transform, decode="cuda")


def _batches(db: Path, transform: Any, decode: str, train: bool) -> list[Any]:
    data = ddpkit.LazyLMDBDataset(db, transform, decode=decode)  # type: ignore[arg-type]
    loader = ddpkit.build_loader(data, batch_size=7, train=train, workers=0, seed=3)
    ddpkit.set_epoch(loader, 1)
    return list(loader)


@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_a_batch_decoded_at_once_is_the_cpu_paths_batch_pixel_for_pixel(
    varied_db: Path, cuda_allowed: None, train: bool
) -> None:
    # The same crop boxes from the same seeds: the workers draw them from the header's size.
    transform = ddpkit.train_transform(24) if train else ddpkit.val_transform(24, 28)
    cpu = _batches(varied_db, transform, "tensor", train)
    encoded = _batches(varied_db, transform, "cuda", train)
    assert len(cpu) == len(encoded) == 3
    for (images, targets), (batch, encoded_targets) in zip(cpu, encoded, strict=True):
        assert isinstance(batch, EncodedBatch)
        assert batch.shape == tuple(images.shape)
        decoded = batch.decode(torch.device("cpu"))
        assert torch.equal(decoded, images)
        assert torch.equal(encoded_targets, targets)


def test_what_the_gpu_decoder_cannot_read_is_decoded_on_the_cpu_and_counted(
    varied_db: Path, cuda_allowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = ddpkit.LazyLMDBDataset(varied_db, ddpkit.val_transform(24, 28), decode="cuda")
    samples = [data[i] for i in range(7)]  # JPEG x 3, PNG x 2, WebP, BMP
    assert [s[0].data is None for s in samples] == [False] * 3 + [True] * 4
    batch, _ = collate(samples)
    assert batch.cpu_decoded == 4  # by the workers
    refused = gpu_decode._decode_jpegs

    def refuse_the_second(items: list[Encoded], device: torch.device) -> list[Any]:
        out = refused(items, device)
        out[1] = None  # the GPU decoder refused this one: the CPU decodes it
        return out

    monkeypatch.setattr(gpu_decode, "_decode_jpegs", refuse_the_second)
    before = gpu_decode.cpu_decoded()
    images = batch.decode(torch.device("cpu"))
    assert batch.cpu_decoded == 5
    assert gpu_decode.cpu_decoded() - before == 5
    again = batch.decode(torch.device("cpu"))  # decoded twice: counted once, said the same
    assert torch.equal(again, images)
    assert batch.cpu_decoded == 5
    assert gpu_decode.cpu_decoded() - before == 5
    expected = torch.stack(
        [ddpkit.val_transform(24, 28)(ddpkit.LazyLMDBDataset(varied_db)[i][0]) for i in range(7)]
    )
    assert torch.equal(images, expected)


def test_an_encoded_sample_travels_to_the_training_process_whole() -> None:
    raw = varied_images()[0]
    item = gpu_decode.encode(raw).cropped((1, 2, 30, 40), True, 16)
    back = pickle.loads(pickle.dumps(item))
    assert torch.equal(back.data, item.data)
    assert (back.height, back.width, back.box, back.flip, back.size) == (
        72,
        96,
        (1, 2, 30, 40),
        True,
        16,
    )
    batch = EncodedBatch([back])
    assert batch.shape == (1, 3, 16, 16)


def test_a_header_claiming_too_many_pixels_is_refused_in_the_worker(varied_db: Path) -> None:
    with pytest.raises(ddpkit.ImageTooLargeError):
        gpu_decode.encode(varied_images()[0], max_pixels=100)


def test_fit_trains_on_encoded_batches_and_counts_the_cpu_decodes(
    varied_db: Path, cuda_allowed: None
) -> None:
    data = ddpkit.LazyLMDBDataset(varied_db, ddpkit.train_transform(16), decode="cuda")
    loader = ddpkit.build_loader(data, batch_size=7, train=True, workers=0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 2))
    history = ddpkit.fit(
        model,
        loader,
        torch.optim.SGD(model.parameters(), lr=0.01),
        criterion=torch.nn.CrossEntropyLoss(),
        epochs=1,
        report=ddpkit.ReportConfig(progress=False),
    )
    assert history.last["cpu_decoded"] == 12  # PNG x 2, WebP, BMP in each of 3 batches


def test_a_batchs_bytes_cross_in_one_buffer(varied_db: Path, cuda_allowed: None) -> None:
    data = ddpkit.LazyLMDBDataset(varied_db, ddpkit.val_transform(24, 28), decode="cuda")
    batch, _ = collate([data[i] for i in (0, 1, 2, 7)])  # four JPEGs
    storages = {item.data.untyped_storage().data_ptr() for item in batch.items}
    assert len(storages) == 1
    apart = EncodedBatch([data[i][0] for i in (0, 1, 2, 7)])  # each its own tensor
    assert torch.equal(batch.decode(torch.device("cpu")), apart.decode(torch.device("cpu")))


def test_a_jpeg_no_decoder_reads_is_named_with_its_record(
    tmp_path: Path, cuda_allowed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = varied_images()[0]
    cut = whole[: len(whole) // 3]  # the header is whole, the data are not
    db = write_db(tmp_path / "cut.lmdb", [whole, cut], [0, 1], ["a", "b"])
    data = ddpkit.LazyLMDBDataset(db, ddpkit.val_transform(24, 28), decode="cuda")
    batch, _ = collate([data[0], data[1]])
    monkeypatch.setattr(gpu_decode, "_decode_jpegs", lambda items, device: [None] * len(items))
    with pytest.raises(ValueError, match=r"sample 1 \(record 1 of .*cut.lmdb\) does not decode"):
        batch.decode(torch.device("cpu"))
