"""ddpkit: PyTorch DistributedDataParallel building blocks.

The public API is the names in ``__all__``; everything else is internal. The
names load on first use, so ``import ddpkit`` (and the ``ddpkit`` command)
starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ddpkit import _graveyard
from ddpkit._version import __version__

_graveyard.install()  # the modules of earlier releases still import, with a warning

if TYPE_CHECKING:
    from ddpkit.checkpoint import (
        CheckpointError,
        CheckpointManager,
        load_checkpoint,
        save_checkpoint,
    )
    from ddpkit.data import (
        IMAGENET_MEAN,
        IMAGENET_STD,
        BuildSummary,
        DistributedEvalSampler,
        ImageError,
        ImageTooLargeError,
        LazyLMDBDataset,
        LMDBFormatError,
        WeightedDistributedSampler,
        build_lmdb,
        build_loader,
        class_weights,
        mixup_cutmix,
        normalize_batch,
        set_epoch,
        train_transform,
        val_transform,
    )
    from ddpkit.distributed import (
        HANG_EXIT_CODE,
        PREEMPTED_EXIT_CODE,
        DistInfo,
        NetworkConfigError,
        NetworkPlan,
        Preempted,
        Rank0Error,
        RankFailedError,
        RendezvousError,
        all_gather_object,
        all_reduce_sum,
        barrier,
        configure_network,
        get_local_rank,
        get_rank,
        get_world_size,
        init_distributed,
        is_main_process,
        no_sync,
        plan_network,
        rank0_first,
        rank0_only,
        shutdown,
        spawn,
        unwrap_model,
        wrap_ddp,
    )
    from ddpkit.position import (
        Position,
    )
    from ddpkit.training import (
        FaultConfig,
        FocalLoss,
        History,
        PretrainedReport,
        ReportConfig,
        TrainConfig,
        TrainingError,
        evaluate,
        fit,
        freeze_backbone,
        linear_scaled_lr,
        load_pretrained,
        model_ema,
        warmup_schedule,
    )

# Public name -> the package (or module) whose public face holds it.
_EXPORTS = {
    "CheckpointError": "ddpkit.checkpoint",
    "CheckpointManager": "ddpkit.checkpoint",
    "load_checkpoint": "ddpkit.checkpoint",
    "save_checkpoint": "ddpkit.checkpoint",
    "IMAGENET_MEAN": "ddpkit.data",
    "IMAGENET_STD": "ddpkit.data",
    "BuildSummary": "ddpkit.data",
    "DistributedEvalSampler": "ddpkit.data",
    "ImageError": "ddpkit.data",
    "ImageTooLargeError": "ddpkit.data",
    "LMDBFormatError": "ddpkit.data",
    "LazyLMDBDataset": "ddpkit.data",
    "build_lmdb": "ddpkit.data",
    "build_loader": "ddpkit.data",
    "WeightedDistributedSampler": "ddpkit.data",
    "class_weights": "ddpkit.data",
    "mixup_cutmix": "ddpkit.data",
    "normalize_batch": "ddpkit.data",
    "set_epoch": "ddpkit.data",
    "train_transform": "ddpkit.data",
    "val_transform": "ddpkit.data",
    "HANG_EXIT_CODE": "ddpkit.distributed",
    "PREEMPTED_EXIT_CODE": "ddpkit.distributed",
    "DistInfo": "ddpkit.distributed",
    "NetworkConfigError": "ddpkit.distributed",
    "NetworkPlan": "ddpkit.distributed",
    "Preempted": "ddpkit.distributed",
    "Rank0Error": "ddpkit.distributed",
    "RankFailedError": "ddpkit.distributed",
    "RendezvousError": "ddpkit.distributed",
    "all_gather_object": "ddpkit.distributed",
    "all_reduce_sum": "ddpkit.distributed",
    "barrier": "ddpkit.distributed",
    "configure_network": "ddpkit.distributed",
    "get_local_rank": "ddpkit.distributed",
    "get_rank": "ddpkit.distributed",
    "get_world_size": "ddpkit.distributed",
    "init_distributed": "ddpkit.distributed",
    "is_main_process": "ddpkit.distributed",
    "no_sync": "ddpkit.distributed",
    "plan_network": "ddpkit.distributed",
    "rank0_first": "ddpkit.distributed",
    "rank0_only": "ddpkit.distributed",
    "shutdown": "ddpkit.distributed",
    "spawn": "ddpkit.distributed",
    "unwrap_model": "ddpkit.distributed",
    "wrap_ddp": "ddpkit.distributed",
    "Position": "ddpkit.position",
    "FaultConfig": "ddpkit.training",
    "FocalLoss": "ddpkit.training",
    "History": "ddpkit.training",
    "PretrainedReport": "ddpkit.training",
    "ReportConfig": "ddpkit.training",
    "TrainConfig": "ddpkit.training",
    "TrainingError": "ddpkit.training",
    "evaluate": "ddpkit.training",
    "fit": "ddpkit.training",
    "freeze_backbone": "ddpkit.training",
    "linear_scaled_lr": "ddpkit.training",
    "load_pretrained": "ddpkit.training",
    "model_ema": "ddpkit.training",
    "warmup_schedule": "ddpkit.training",
}

__all__ = [
    "HANG_EXIT_CODE",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PREEMPTED_EXIT_CODE",
    "BuildSummary",
    "CheckpointError",
    "CheckpointManager",
    "DistInfo",
    "DistributedEvalSampler",
    "FaultConfig",
    "FocalLoss",
    "History",
    "ImageError",
    "ImageTooLargeError",
    "LMDBFormatError",
    "LazyLMDBDataset",
    "NetworkConfigError",
    "NetworkPlan",
    "Position",
    "Preempted",
    "PretrainedReport",
    "Rank0Error",
    "RankFailedError",
    "RendezvousError",
    "ReportConfig",
    "TrainConfig",
    "TrainingError",
    "WeightedDistributedSampler",
    "__version__",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "build_lmdb",
    "build_loader",
    "class_weights",
    "configure_network",
    "evaluate",
    "fit",
    "freeze_backbone",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "linear_scaled_lr",
    "load_checkpoint",
    "load_pretrained",
    "mixup_cutmix",
    "model_ema",
    "no_sync",
    "normalize_batch",
    "plan_network",
    "rank0_first",
    "rank0_only",
    "save_checkpoint",
    "set_epoch",
    "shutdown",
    "spawn",
    "train_transform",
    "unwrap_model",
    "val_transform",
    "warmup_schedule",
    "wrap_ddp",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    return _graveyard.moved_name("ddpkit", name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
