"""ddpkit: PyTorch DistributedDataParallel building blocks.

The public API is the names in ``__all__``; everything else is internal. The
names load on first use, so ``import ddpkit`` (and the ``ddpkit`` command)
starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ddpkit._version import __version__

if TYPE_CHECKING:
    from ddpkit._procs import RankFailedError
    from ddpkit.checkpoint import (
        CheckpointError,
        CheckpointManager,
        load_checkpoint,
        rank0_only,
        save_checkpoint,
    )
    from ddpkit.comm import (
        all_gather_object,
        all_reduce_sum,
        barrier,
        get_local_rank,
        get_rank,
        get_world_size,
        is_main_process,
    )
    from ddpkit.data import (
        IMAGENET_MEAN,
        IMAGENET_STD,
        BuildSummary,
        DistributedEvalSampler,
        ImageError,
        LazyLMDBDataset,
        LMDBFormatError,
        build_lmdb,
        build_loader,
        normalize_batch,
        set_epoch,
        train_transform,
        val_transform,
    )
    from ddpkit.dist import DistInfo, RendezvousError, init_distributed, shutdown
    from ddpkit.launch import spawn
    from ddpkit.launchers import LaunchEnv, detect_launcher
    from ddpkit.losses import FocalLoss
    from ddpkit.models import PretrainedReport, freeze_backbone, load_pretrained
    from ddpkit.network import NetworkConfigError, configure_network
    from ddpkit.parallel import no_sync, unwrap_model, wrap_ddp
    from ddpkit.train import History, TrainingError, evaluate, fit

# Public name -> the module that defines it.
_EXPORTS = {
    "RankFailedError": "ddpkit._procs",
    "all_gather_object": "ddpkit.comm",
    "all_reduce_sum": "ddpkit.comm",
    "barrier": "ddpkit.comm",
    "get_local_rank": "ddpkit.comm",
    "get_rank": "ddpkit.comm",
    "get_world_size": "ddpkit.comm",
    "is_main_process": "ddpkit.comm",
    "BuildSummary": "ddpkit.data",
    "DistributedEvalSampler": "ddpkit.data",
    "IMAGENET_MEAN": "ddpkit.data",
    "IMAGENET_STD": "ddpkit.data",
    "ImageError": "ddpkit.data",
    "LMDBFormatError": "ddpkit.data",
    "LazyLMDBDataset": "ddpkit.data",
    "build_lmdb": "ddpkit.data",
    "build_loader": "ddpkit.data",
    "normalize_batch": "ddpkit.data",
    "set_epoch": "ddpkit.data",
    "train_transform": "ddpkit.data",
    "val_transform": "ddpkit.data",
    "DistInfo": "ddpkit.dist",
    "RendezvousError": "ddpkit.dist",
    "init_distributed": "ddpkit.dist",
    "shutdown": "ddpkit.dist",
    "spawn": "ddpkit.launch",
    "LaunchEnv": "ddpkit.launchers",
    "detect_launcher": "ddpkit.launchers",
    "NetworkConfigError": "ddpkit.network",
    "configure_network": "ddpkit.network",
    "CheckpointError": "ddpkit.checkpoint",
    "CheckpointManager": "ddpkit.checkpoint",
    "load_checkpoint": "ddpkit.checkpoint",
    "rank0_only": "ddpkit.checkpoint",
    "save_checkpoint": "ddpkit.checkpoint",
    "FocalLoss": "ddpkit.losses",
    "PretrainedReport": "ddpkit.models",
    "freeze_backbone": "ddpkit.models",
    "load_pretrained": "ddpkit.models",
    "no_sync": "ddpkit.parallel",
    "unwrap_model": "ddpkit.parallel",
    "wrap_ddp": "ddpkit.parallel",
    "History": "ddpkit.train",
    "TrainingError": "ddpkit.train",
    "evaluate": "ddpkit.train",
    "fit": "ddpkit.train",
}

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BuildSummary",
    "CheckpointError",
    "CheckpointManager",
    "DistInfo",
    "DistributedEvalSampler",
    "FocalLoss",
    "History",
    "ImageError",
    "LMDBFormatError",
    "LaunchEnv",
    "LazyLMDBDataset",
    "NetworkConfigError",
    "PretrainedReport",
    "RankFailedError",
    "RendezvousError",
    "TrainingError",
    "__version__",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "build_lmdb",
    "build_loader",
    "configure_network",
    "detect_launcher",
    "evaluate",
    "fit",
    "freeze_backbone",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "load_checkpoint",
    "load_pretrained",
    "no_sync",
    "normalize_batch",
    "rank0_only",
    "save_checkpoint",
    "set_epoch",
    "shutdown",
    "spawn",
    "train_transform",
    "unwrap_model",
    "val_transform",
    "wrap_ddp",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
