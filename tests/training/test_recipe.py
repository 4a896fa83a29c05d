"""fit() with today's recipe: warm-up schedules, EMA, Mixup/CutMix, clipping, channels_last,
torch.compile, and gradient accumulation whose last step of an epoch is short."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from train_jobs import NoisyBlobs

from ddpkit import (
    CheckpointManager,
    FocalLoss,
    ReportConfig,
    TrainConfig,
    build_loader,
    fit,
    load_checkpoint,
    mixup_cutmix,
    model_ema,
    warmup_schedule,
)
from ddpkit.checkpoint import TrainingState

QUIET = ReportConfig(progress=False, verbose=False)


def _linear_data(n: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def test_a_short_last_accumulation_step_is_one_batch_of_its_samples() -> None:
    data = _linear_data(10)  # batches of 2: 5 micro-batches, steps of 4 and then 1
    model = _linear()
    loader = DataLoader(data, batch_size=2, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    config = TrainConfig(grad_accum=4, normalize=None)
    fit(model, loader, optimizer, criterion=nn.CrossEntropyLoss(), epochs=1, config=config,
        report=QUIET)  # fmt: skip
    # The same two steps as single large batches: 8 samples, then the last 2.
    reference = _linear()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    x, y = data.tensors
    for part in (slice(0, 8), slice(8, 10)):
        sgd.zero_grad()
        nn.functional.cross_entropy(reference(x[part]), y[part]).backward()
        sgd.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_gradient_clipping_in_fit_is_clip_grad_norm() -> None:
    data = _linear_data(8)
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    config = TrainConfig(clip_grad_norm=0.05, normalize=None)
    loader = DataLoader(data, batch_size=8)
    fit(model, loader, optimizer, criterion=nn.CrossEntropyLoss(), epochs=1, config=config,
        report=QUIET)  # fmt: skip
    reference = _linear()
    x, y = data.tensors
    nn.functional.cross_entropy(reference(x), y).backward()
    total = nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    assert total > 0.05  # the clip did something
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad  # type: ignore[operator]
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_a_warmup_schedule_steps_after_every_optimizer_step_in_fit() -> None:
    model = _linear()
    loader = DataLoader(_linear_data(12), batch_size=2)  # 6 steps an epoch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    scheduler = warmup_schedule(optimizer, epochs=3, steps_per_epoch=6, warmup_epochs=1)
    config = TrainConfig(normalize=None)
    history = fit(model, loader, optimizer, criterion=nn.CrossEntropyLoss(), epochs=3,
                  scheduler=scheduler, config=config, report=QUIET)  # fmt: skip
    # Each record holds the rate of its epoch's last step: steps 6, 12 and 18.
    used = []
    shadow = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.3)
    twin = warmup_schedule(shadow, epochs=3, steps_per_epoch=6, warmup_epochs=1)
    for _ in range(18):
        used.append(shadow.param_groups[0]["lr"])
        shadow.step()
        twin.step()
    assert [r["lr"] for r in history.records] == pytest.approx([used[5], used[11], used[17]])
    assert history.records[0]["lr"] == pytest.approx(0.3 * (0.01 + 0.99 * 5 / 6))  # warming up
    assert history.records[1]["lr"] < 0.3  # the cosine after the peak of step 7


def _blobs_loaders() -> tuple[Any, Any]:
    train = build_loader(NoisyBlobs(48), batch_size=8, train=True, workers=0)
    val = build_loader(NoisyBlobs(24, seed=1, augment=False), batch_size=8, train=False, workers=0)
    return train, val


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def test_the_average_is_evaluated_saved_and_restored_exactly(tmp_path: Path) -> None:
    def run(epochs: int, resume: bool) -> tuple[Any, nn.Module, Any]:
        model = _net()
        ema = model_ema(model, decay=0.9)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train, val = _blobs_loaders()
        manager = CheckpointManager(tmp_path / ("resumed" if resume or epochs == 1 else "whole"))
        history = fit(model, train, optimizer, criterion=nn.CrossEntropyLoss(), epochs=epochs,
                      val_loader=val, ema=ema, checkpoints=manager, resume=resume,
                      config=TrainConfig(normalize=None), report=QUIET)  # fmt: skip
        return history, model, ema

    whole, model, ema = run(3, resume=False)
    for record in whole.records:
        assert 0 <= record["val_ema_acc1"] <= 100
        assert record["val_ema_loss"] > 0
    # The first update copies the weights; later ones move the average part of the way.
    assert not torch.equal(ema.module[0].weight, model[0].weight)
    state = load_checkpoint(tmp_path / "whole" / "latest.pth")
    assert torch.equal(state["ema"]["module.0.weight"], ema.module[0].weight.detach())
    assert int(state["ema"]["n_averaged"]) == 18  # 6 steps x 3 epochs
    run(1, resume=False)
    _, model2, ema2 = run(3, resume=True)
    for a, b in zip(ema.state_dict().values(), ema2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_the_weight_file_holds_the_average_when_it_scores_higher(tmp_path: Path) -> None:
    model = _net()
    ema = model_ema(model)
    with torch.no_grad():
        ema.module[0].weight.add_(1.0)  # tell the two apart
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState(model, optimizer, ema=ema)
    manager = CheckpointManager(tmp_path, prefix="net", state=state)
    manager.save(0, metrics={"acc1": 50.0, "ema_acc1": 60.0})
    manager.save(1, metrics={"acc1": 70.0, "ema_acc1": 55.0})
    first = load_checkpoint(tmp_path / "net-epoch1-acc60.00.pth")
    assert torch.equal(first["0.weight"], ema.module[0].weight.detach())
    assert "n_averaged" not in first
    second = load_checkpoint(tmp_path / "net-epoch2-acc70.00.pth")
    assert torch.equal(second["0.weight"], model[0].weight.detach())
    assert manager.best_acc1 == 70.0
    # Resuming asks for the average the checkpoint holds; one saved without it is named.
    plain = CheckpointManager(tmp_path / "plain", state=TrainingState(model, optimizer))
    plain.save(0)
    averaged = TrainingState(model, optimizer, ema=model_ema(model))
    with pytest.raises(Exception, match="no model average"):
        CheckpointManager(tmp_path / "plain", state=averaged).resume()


def test_decay_out_of_range_is_refused() -> None:
    for decay in (0.0, 1.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            model_ema(_net(), decay=decay)


def test_mixup_and_cutmix_train_with_soft_focal_loss() -> None:
    torch.manual_seed(0)
    images = torch.randint(0, 256, (32, 3, 8, 8), dtype=torch.uint8)
    data = TensorDataset(images, torch.randint(0, 4, (32,)))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))
    seen: list[torch.Tensor] = []

    def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append(targets)
        return FocalLoss(gamma=2.0, smooth=0.1)(logits, targets)

    config = TrainConfig(batch_transform=mixup_cutmix(4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(model, DataLoader(data, batch_size=8), sgd, criterion=criterion, epochs=2,
                  config=config, report=QUIET)  # fmt: skip
    assert len(seen) == 8
    assert all(t.shape == (8, 4) and t.is_floating_point() for t in seen)
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in history.records)
    assert not any("train_acc" in key for key in history.records[0])  # no accuracy on mixed targets


def test_channels_last_batches_reach_the_model() -> None:
    formats: list[bool] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 2, 3)
            self.head = nn.Linear(2 * 6 * 6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            formats.append(x.is_contiguous(memory_format=torch.channels_last))
            return self.head(self.conv(x).flatten(1))

    data = TensorDataset(torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8),
                         torch.randint(0, 2, (8,)))  # fmt: skip
    model = Probe().to(memory_format=torch.channels_last)
    fit(model, DataLoader(data, batch_size=4), torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(), epochs=1, config=TrainConfig(channels_last=True),
        report=QUIET)  # fmt: skip
    assert formats == [True, True]


@pytest.mark.timeout(600)
def test_a_compiled_model_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    def run(directory: Path, epochs: int, resume: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        model = torch.compile(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = DataLoader(NoisyBlobs(32, augment=False), batch_size=8)
        fit(model, loader, optimizer, criterion=nn.CrossEntropyLoss(), epochs=epochs,  # type: ignore[arg-type]
            checkpoints=CheckpointManager(directory), resume=resume,
            config=TrainConfig(normalize=None), report=QUIET)  # fmt: skip
        return copy.deepcopy(net.state_dict())

    whole = run(tmp_path / "whole", 2, resume=False)
    saved = load_checkpoint(tmp_path / "whole" / "latest.pth")["model"]
    assert sorted(saved) == sorted(whole)  # no "_orig_mod." prefix in the file
    run(tmp_path / "resumed", 1, resume=False)
    resumed = run(tmp_path / "resumed", 2, resume=True)
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key


def test_a_validation_loader_without_a_length_is_fine() -> None:
    class Stream(torch.utils.data.IterableDataset[tuple[torch.Tensor, int]]):
        def __iter__(self) -> Any:
            data = _linear_data(6)
            return iter(zip(data.tensors[0], data.tensors[1].tolist(), strict=True))

    model = _linear()
    history = fit(model, DataLoader(_linear_data(8), batch_size=4),
                  torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
                  epochs=1, val_loader=DataLoader(Stream(), batch_size=4),
                  config=TrainConfig(normalize=None), report=QUIET)  # fmt: skip
    assert history.records[0]["val_samples"] == 6
