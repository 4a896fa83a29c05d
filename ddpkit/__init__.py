"""ddpkit: PyTorch DistributedDataParallel building blocks.

The public API is the names in ``__all__``; everything else is internal. The
names load on first use, so ``import ddpkit`` (and the ``ddpkit`` command)
starts without importing torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ddpkit._version import __version__

if TYPE_CHECKING:
    from ddpkit.checkpoint import CheckpointManager
    from ddpkit.comm import (
        all_gather_object,
        all_reduce_sum,
        barrier,
        get_local_rank,
        get_rank,
        get_world_size,
        is_main_process,
    )
    from ddpkit.control import HANG_EXIT_CODE, PREEMPTED_EXIT_CODE, Preempted
    from ddpkit.data import (
        IMAGENET_MEAN,
        IMAGENET_STD,
        BuildSummary,
        DistributedEvalSampler,
        ImageError,
        ImageTooLargeError,
        LazyLMDBDataset,
        LMDBFormatError,
        build_lmdb,
        build_loader,
        normalize_batch,
        set_epoch,
        train_transform,
        val_transform,
    )
    from ddpkit.data.mixing import mixup_cutmix
    from ddpkit.dist import init_distributed, shutdown
    from ddpkit.ema import model_ema
    from ddpkit.evaluation import evaluate
    from ddpkit.job import DistInfo
    from ddpkit.losses import FocalLoss
    from ddpkit.models import PretrainedReport, freeze_backbone, load_pretrained
    from ddpkit.network import NetworkConfigError, NetworkPlan, configure_network, plan_network
    from ddpkit.parallel import no_sync, unwrap_model, wrap_ddp
    from ddpkit.position import Position
    from ddpkit.processes import RankFailedError
    from ddpkit.rank0 import Rank0Error, rank0_first, rank0_only
    from ddpkit.rendezvous import RendezvousError
    from ddpkit.reporting import ReportConfig
    from ddpkit.schedules import linear_scaled_lr, warmup_schedule
    from ddpkit.serialization import CheckpointError, load_checkpoint, save_checkpoint
    from ddpkit.spawning import spawn
    from ddpkit.steps import TrainConfig, TrainingError
    from ddpkit.train import FaultConfig, History, fit

# Public name -> the module that defines it.
_EXPORTS = {
    "CheckpointManager": "ddpkit.checkpoint",
    "all_gather_object": "ddpkit.comm",
    "all_reduce_sum": "ddpkit.comm",
    "barrier": "ddpkit.comm",
    "get_local_rank": "ddpkit.comm",
    "get_rank": "ddpkit.comm",
    "get_world_size": "ddpkit.comm",
    "is_main_process": "ddpkit.comm",
    "HANG_EXIT_CODE": "ddpkit.control",
    "PREEMPTED_EXIT_CODE": "ddpkit.control",
    "Preempted": "ddpkit.control",
    "BuildSummary": "ddpkit.data",
    "DistributedEvalSampler": "ddpkit.data",
    "IMAGENET_MEAN": "ddpkit.data",
    "IMAGENET_STD": "ddpkit.data",
    "ImageError": "ddpkit.data",
    "ImageTooLargeError": "ddpkit.data",
    "LMDBFormatError": "ddpkit.data",
    "LazyLMDBDataset": "ddpkit.data",
    "build_lmdb": "ddpkit.data",
    "build_loader": "ddpkit.data",
    "normalize_batch": "ddpkit.data",
    "set_epoch": "ddpkit.data",
    "train_transform": "ddpkit.data",
    "val_transform": "ddpkit.data",
    "mixup_cutmix": "ddpkit.data.mixing",
    "model_ema": "ddpkit.ema",
    "linear_scaled_lr": "ddpkit.schedules",
    "warmup_schedule": "ddpkit.schedules",
    "init_distributed": "ddpkit.dist",
    "shutdown": "ddpkit.dist",
    "DistInfo": "ddpkit.job",
    "FocalLoss": "ddpkit.losses",
    "PretrainedReport": "ddpkit.models",
    "freeze_backbone": "ddpkit.models",
    "load_pretrained": "ddpkit.models",
    "NetworkConfigError": "ddpkit.network",
    "NetworkPlan": "ddpkit.network",
    "configure_network": "ddpkit.network",
    "plan_network": "ddpkit.network",
    "no_sync": "ddpkit.parallel",
    "unwrap_model": "ddpkit.parallel",
    "wrap_ddp": "ddpkit.parallel",
    "RankFailedError": "ddpkit.processes",
    "Rank0Error": "ddpkit.rank0",
    "rank0_first": "ddpkit.rank0",
    "rank0_only": "ddpkit.rank0",
    "RendezvousError": "ddpkit.rendezvous",
    "ReportConfig": "ddpkit.reporting",
    "CheckpointError": "ddpkit.serialization",
    "load_checkpoint": "ddpkit.serialization",
    "save_checkpoint": "ddpkit.serialization",
    "spawn": "ddpkit.spawning",
    "evaluate": "ddpkit.evaluation",
    "Position": "ddpkit.position",
    "TrainConfig": "ddpkit.steps",
    "TrainingError": "ddpkit.steps",
    "FaultConfig": "ddpkit.train",
    "History": "ddpkit.train",
    "fit": "ddpkit.train",
}

# Former public names: (module, name there, what to use instead). They still
# resolve, with a DeprecationWarning, until ddpkit 0.3.
_DEPRECATED = {
    "LaunchEnv": (
        "ddpkit.launchers",
        "LaunchEnv",
        "init_distributed() and its DistInfo (or ddpkit.launchers.LaunchEnv)",
    ),
    "detect_launcher": (
        "ddpkit.launchers",
        "detect_launcher",
        "init_distributed() and its DistInfo (or ddpkit.launchers.detect_launcher)",
    ),
    "RankZeroError": ("ddpkit.rank0", "Rank0Error", "ddpkit.Rank0Error"),
    "rank_zero_first": ("ddpkit.rank0", "rank0_first", "ddpkit.rank0_first"),
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
    "__version__",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "build_lmdb",
    "build_loader",
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
    if name in _DEPRECATED:
        module, attribute, instead = _DEPRECATED[name]
        warnings.warn(
            f"ddpkit.{name} is deprecated and will be removed in ddpkit 0.3; use {instead}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
