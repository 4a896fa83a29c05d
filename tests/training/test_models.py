"""load_pretrained and freeze_backbone on real timm and torchvision models."""

from __future__ import annotations

import collections
import logging
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from torch import nn

from ddpkit import (
    CheckpointError,
    PretrainedReport,
    freeze_backbone,
    load_pretrained,
    save_checkpoint,
)

ARCH = "legacy_seresnext26_32x4d"  # Cadene's layout: layer0..layer4, last_linear


def _imagenet_file(tmp_path: Path, prefix: str = "") -> tuple[Path, dict[str, torch.Tensor]]:
    """A 1000-class model's weights, as a published ImageNet file holds them."""
    torch.manual_seed(1)
    state = timm.create_model(ARCH, num_classes=1000).state_dict()
    path = tmp_path / "imagenet.pth"
    torch.save({prefix + k: v for k, v in state.items()}, path)
    return path, state


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod.", "module._orig_mod."])
def test_imagenet_weights_load_into_a_new_head(tmp_path: Path, prefix: str) -> None:
    path, published = _imagenet_file(tmp_path, prefix)
    torch.manual_seed(2)
    model = timm.create_model(ARCH, num_classes=10)
    fresh_head = model.last_linear.weight.detach().clone()

    report = load_pretrained(model, path)

    assert report.skipped == ["last_linear.weight", "last_linear.bias"]
    assert report.missing == []
    assert len(report.loaded) == len(published) - 2
    mine = model.state_dict()
    for name in report.loaded:
        assert torch.equal(mine[name], published[name]), name
    assert torch.equal(model.last_linear.weight, fresh_head)  # the new head is untouched
    assert model.last_linear.out_features == 10


@pytest.mark.timeout(60)
def test_ddpkit_checkpoint_and_state_dict_entries(tmp_path: Path) -> None:
    source = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    save_checkpoint({"model": source.state_dict(), "epoch": 3}, tmp_path / "latest.pth")
    torch.save({"state_dict": source.state_dict(), "arch": "mlp"}, tmp_path / "lightning.pth")
    for name in ("latest.pth", "lightning.pth"):
        target = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        report = load_pretrained(target, tmp_path / name)
        assert sorted(report.loaded) == sorted(source.state_dict())
        for key, value in source.state_dict().items():
            assert torch.equal(target.state_dict()[key], value)


@pytest.mark.timeout(60)
def test_expected_extra_refuses_another_run_s_weights_before_loading(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = nn.Linear(4, 2)
    run = {"--arch": "mlp", "--image-size": 32}
    save_checkpoint({"model": source.state_dict(), "extra": run}, tmp_path / "latest.pth")
    torch.save(source.state_dict(), tmp_path / "best.pth")  # a weight file: its run's beside it
    for name in ("latest.pth", "best.pth"):
        target = nn.Linear(4, 2)
        before = target.weight.clone()
        with pytest.raises(CheckpointError, match=r"trained with --image-size 32; this run has "):
            load_pretrained(target, tmp_path / name, expected_extra={**run, "--image-size": 64})
        assert torch.equal(target.weight, before)  # refused before loading
        load_pretrained(target, tmp_path / name, expected_extra=run)
        assert torch.equal(target.weight, source.weight)
    (tmp_path / "alone").mkdir()
    torch.save(source.state_dict(), tmp_path / "alone" / "best.pth")  # no record anywhere
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        load_pretrained(nn.Linear(4, 2), tmp_path / "alone" / "best.pth", expected_extra=run)
    assert "has no record of --arch, --image-size" in caplog.text


@pytest.mark.timeout(60)
def test_missing_tensors_keep_their_initialisation_unless_strict(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = nn.Sequential(nn.Linear(4, 3))
    torch.save(source.state_dict(), tmp_path / "w.pth")
    target = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    second = target[1].weight.detach().clone()

    report = load_pretrained(target, tmp_path / "w.pth")
    assert report.missing == ["1.weight", "1.bias"]
    assert torch.equal(target[1].weight, second)
    assert torch.equal(target[0].weight, source[0].weight)

    deeper = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        load_pretrained(deeper, tmp_path / "w.pth")
    assert "only 2 of the model's 6 tensors" in caplog.text

    with pytest.raises(ValueError, match=r"strict=True.*leaves 2 of the model's tensors unset"):
        load_pretrained(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), tmp_path / "w.pth",
                        strict=True)  # fmt: skip


@pytest.mark.timeout(60)
def test_report_repr_counts_long_lists_and_names_short_ones(tmp_path: Path) -> None:
    torch.save(torchvision.models.resnet18(num_classes=1000).state_dict(), tmp_path / "r18.pth")
    report = load_pretrained(torchvision.models.resnet18(num_classes=5), tmp_path / "r18.pth")
    assert len(report.loaded) == 120  # the attributes stay full lists
    assert (
        repr(report) == "PretrainedReport(loaded=120, skipped=['fc.weight', 'fc.bias'], missing=0)"
    )
    five, six = [f"t{i}" for i in range(5)], [f"t{i}" for i in range(6)]
    assert repr(PretrainedReport(loaded=six, skipped=[], missing=five)) == (
        "PretrainedReport(loaded=6, skipped=0, missing=['t0', 't1', 't2', 't3', 't4'])"
    )


@pytest.mark.timeout(60)
def test_weights_of_another_architecture_are_refused(tmp_path: Path) -> None:
    torch.save(torchvision.models.resnet18(num_classes=5).state_dict(), tmp_path / "r18.pth")
    model = timm.create_model(ARCH, num_classes=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="another architecture") as info:
        load_pretrained(model, tmp_path / "r18.pth")
    assert "conv1.weight" in str(info.value)  # names what the file holds
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.timeout(60)
def test_files_without_tensors_or_unsafe_or_absent(tmp_path: Path) -> None:
    torch.save({"epoch": 1, "note": "no weights"}, tmp_path / "empty.pth")
    with pytest.raises(ValueError, match="holds no tensors"):
        load_pretrained(nn.Linear(2, 2), tmp_path / "empty.pth")
    # A pickled class instance: loading it would run code, so weights_only refuses.
    torch.save({"weight": collections.UserDict(a=1)}, tmp_path / "unsafe.pth")
    with pytest.raises(CheckpointError, match="weights_only"):
        load_pretrained(nn.Linear(2, 2), tmp_path / "unsafe.pth")
    with pytest.raises(FileNotFoundError):
        load_pretrained(nn.Linear(2, 2), tmp_path / "absent.pth")
    (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        load_pretrained(nn.Linear(2, 2), tmp_path / "garbage.pth")


@pytest.mark.timeout(60)
def test_freeze_backbone_leaves_the_head_trainable() -> None:
    model = timm.create_model(ARCH, num_classes=7)
    assert freeze_backbone(model) == ["last_linear.weight", "last_linear.bias"]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen
    assert all(
        n.startswith(("layer0.", "layer1.", "layer2.", "layer3.", "layer4.")) for n in frozen
    )

    resnet = torchvision.models.resnet18(num_classes=3)  # no get_classifier: its fc
    assert freeze_backbone(resnet) == ["fc.weight", "fc.bias"]
    loss = resnet(torch.randn(2, 3, 32, 32)).sum()
    loss.backward()
    assert resnet.conv1.weight.grad is None
    assert resnet.fc.weight.grad is not None


@pytest.mark.timeout(30)
def test_freeze_backbone_needs_a_classifier() -> None:
    with pytest.raises(ValueError, match="no get_classifier"):
        freeze_backbone(nn.Sequential(nn.Linear(2, 2)))
    headless = timm.create_model("resnet18", num_classes=0)
    with pytest.raises(ValueError, match="num_classes > 0"):
        freeze_backbone(headless)
