"""Wrap a model for DistributedDataParallel, and see through the wrappers again.

``wrap_ddp`` is the one call between building a model and training it: with a
process group it converts BatchNorm to SyncBatchNorm (on CUDA), moves the
model to this rank's device and wraps it in ``DistributedDataParallel``;
without one it only moves the model, so the same script runs on a laptop and
on a cluster. ``sync_buffers`` gives every rank rank 0's buffers (BatchNorm
statistics), so the model each rank evaluates is the model rank 0 saves.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from ddpkit.distributed.compression import CommHook, backend_for, check_comm_hook
from ddpkit.distributed.devices import collective_device, model_device

__all__ = ["no_sync", "sync_buffers", "unwrap_model", "wrap_ddp"]

logger = logging.getLogger("ddpkit")

# wrap_ddp chooses these from `device`; taking them from ddp_kwargs as well
# would let the two disagree.
_DEVICE_KWARGS = ("device_ids", "output_device")


def wrap_ddp(
    model: nn.Module,
    sync_bn: bool = True,
    device: torch.device | str | None = None,
    comm_hook: str | None = None,
    powersgd_rank: int | None = None,
    powersgd_warmup: int | None = None,
    powersgd_error_feedback: bool | None = None,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Prepare ``model`` for training on this rank: SyncBatchNorm, device, DDP.

    With a process group (``torch.distributed.is_initialized()``):

    1. On CUDA and with ``sync_bn``, BatchNorm layers become
       ``nn.SyncBatchNorm``, which computes batch statistics over all ranks.
       On CPU they stay BatchNorm (SyncBatchNorm refuses CPU tensors), so each
       rank normalises with its own batch's statistics; this is logged.
    2. The model moves to ``device``.
    3. It is wrapped in ``DistributedDataParallel``, with
       ``device_ids=[device.index]`` on CUDA and none on CPU.
    4. ``comm_hook`` compresses the gradients each step sends: ``"bf16"`` or
       ``"fp16"`` all-reduce half the bytes, ``"powersgd"`` a low-rank
       approximation of each gradient matrix, with error feedback
       (PyTorch's DDP communication hooks). Each rank's PowerSGD state is
       saved in every checkpoint and restored to the same rank; the bytes a
       step sends are on the epoch line (docs/training.md, "Gradients over a
       slow link").

    Without a process group the model is only moved to ``device`` and returned
    unwrapped, so one script runs on one process and on many.

    Call it after loading pretrained weights and freezing layers, and before
    building the optimizer and calling ``torch.compile``. Every rank must
    call it: DDP broadcasts rank 0's weights to the others.

    Args:
        model: the model; BatchNorm conversion may replace its layers.
        sync_bn: convert BatchNorm to SyncBatchNorm when on CUDA with a process group.
        device: where the model runs. Default: ``cuda:<current device>`` with a
            NCCL process group, else CPU; without a process group
            ``cuda:<current device>`` when CUDA is available, else CPU.
        comm_hook: None (DDP's own fp32 all-reduce), ``"bf16"``, ``"fp16"`` or
            ``"powersgd"``. Checked on one process too; it runs with a process group.
        powersgd_rank: PowerSGD's matrix approximation rank (PyTorch's default 1).
        powersgd_warmup: the steps of plain all-reduce before PowerSGD compresses
            (PyTorch's ``start_powerSGD_iter``, default 1000; at least 2).
        powersgd_error_feedback: keep each rank's compression error and add it
            to the next step's gradient (PyTorch's default True).
        **ddp_kwargs: passed to ``DistributedDataParallel`` under its own
            names (``find_unused_parameters``, ``gradient_as_bucket_view``,
            ``static_graph``, ``broadcast_buffers``, ``bucket_cap_mb`` ...).
            Checked on one process too, so a misspelt name fails early.

    Returns:
        The ``DistributedDataParallel`` module with a process group, else the
        same ``model`` object, moved to ``device``.

    Raises:
        ValueError: ``model`` is already wrapped in DDP, has no parameter that
            requires grad, or ``ddp_kwargs`` names ``device_ids`` / ``output_device``;
            ``comm_hook`` is unknown, cannot run on this backend or these gradients, or a
            ``powersgd_*`` option is out of range or given without ``"powersgd"``.
        TypeError: ``ddp_kwargs`` holds a name ``DistributedDataParallel`` does not take.

    Example:
        >>> info = ddpkit.init_distributed()
        >>> model = wrap_ddp(timm.create_model("seresnext50_32x4d", num_classes=10))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """
    if _find_ddp(model, through_data_parallel=True) is not None:
        raise ValueError(
            "wrap_ddp: the model is already wrapped in DistributedDataParallel; pass the "
            "unwrapped model (ddpkit.unwrap_model(model)) or use the wrapped one as it is"
        )
    _check_ddp_kwargs(ddp_kwargs)
    # Checked on one process too: a model that cannot train under DDP should
    # fail on the laptop, not on the cluster.
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"wrap_ddp: {type(model).__name__} has no parameter with requires_grad=True, and "
            "DistributedDataParallel needs at least one trainable parameter; unfreeze at least "
            "the head (e.g. model.get_classifier().requires_grad_(True) for timm models)"
        )

    distributed = dist.is_available() and dist.is_initialized()
    given = {
        "powersgd_rank": powersgd_rank,
        "powersgd_warmup": powersgd_warmup,
        "powersgd_error_feedback": powersgd_error_feedback,
    }
    dev = model_device(device, distributed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    backend = backend_for(str(dist.get_backend()), dev) if distributed else None
    options = check_comm_hook(comm_hook, trainable, backend, given)
    if not distributed:
        return model.to(dev)

    if sync_bn and any(isinstance(m, _BatchNorm) for m in model.modules()):
        if dev.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
        else:
            logger.info(
                "wrap_ddp: keeping BatchNorm on %s: SyncBatchNorm needs CUDA; on CPU each rank "
                "keeps its own BatchNorm statistics",
                dev,
            )
    model = model.to(dev)
    if dev.type == "cuda":
        ddp = DistributedDataParallel(
            model, device_ids=[dev.index], output_device=dev.index, **ddp_kwargs
        )
    else:
        ddp = DistributedDataParallel(model, **ddp_kwargs)
    CommHook(ddp, comm_hook, options, str(backend))
    return ddp


def unwrap_model(model: nn.Module | Callable[..., Any]) -> nn.Module:
    """Return the model inside DDP, ``nn.DataParallel`` and ``torch.compile`` wrappers.

    Wrappers are peeled off repeatedly, so ``torch.compile(wrap_ddp(model))``
    gives back ``model``. Use it to save a ``state_dict`` without the
    ``module.`` / ``_orig_mod.`` key prefixes, or to reach the model's own
    attributes. A model without wrappers comes back as it is.

    Args:
        model: a module, wrapped or not. ``Callable`` in the annotation only
            because type checkers see ``torch.compile(module)`` as a function.

    Returns:
        The innermost module.

    Raises:
        TypeError: ``model`` is not a module (a compiled plain function, say).

    Example:
        >>> torch.save(unwrap_model(model).state_dict(), "weights.pt")
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unwrap_model takes an nn.Module, got {type(model).__name__}")
    module: nn.Module = model
    while True:
        if isinstance(module, DistributedDataParallel | nn.DataParallel):
            module = module.module
        elif (inner := _compiled_inner(module)) is not None:
            module = inner
        else:
            return module


@torch.no_grad()
def sync_buffers(model: nn.Module | Callable[..., Any], src: int = 0) -> None:
    """Give every rank rank ``src``'s buffers of ``model`` (BatchNorm statistics). A collective.

    DDP keeps the parameters equal on every rank and broadcasts rank 0's
    buffers before each training forward, but that forward then updates each
    rank's BatchNorm running statistics with its own batch (without SyncBN, or
    with ``broadcast_buffers=False`` always): after a training step every
    rank holds a slightly different model, and checkpoints save rank 0's. After
    this call every rank holds rank ``src``'s buffers, so what each rank
    evaluates is the model that is saved. The buffers travel in one broadcast
    per device and dtype. Without a process group, in a group of one, or for a
    model without buffers, nothing happens. All ranks must call it, or it
    deadlocks.

    Args:
        model: the model, wrapped (DDP, ``torch.compile``) or not.
        src: the rank whose buffers every rank takes.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for buffer in unwrap_model(model).buffers():
        groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
    wire = collective_device()
    # The same groups in the same order on every rank: the ranks' models have one structure.
    for (device, _), buffers in groups.items():
        flat = torch.cat([b.reshape(-1) for b in buffers]).to(wire)
        dist.broadcast(flat, src=src)
        flat = flat.to(device)
        offset = 0
        for buffer in buffers:
            buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()


def no_sync(
    model: nn.Module | Callable[..., Any], enabled: bool = True
) -> AbstractContextManager[Any]:
    """Skip DDP's gradient all-reduce for the backward passes inside the block.

    For gradient accumulation: run the non-final micro-batches under
    ``no_sync(model)`` so that gradients accumulate locally, and the final one
    outside it, where DDP all-reduces the accumulated sum once. On a model
    that is not DDP (one process), or with ``enabled=False``, it does nothing.

    Args:
        model: the module returned by :func:`wrap_ddp`, possibly ``torch.compile``-d
            (hence ``Callable`` in the annotation, as type checkers see it).
        enabled: False gives a context that does nothing, so the call can stay
            in the loop (``enabled=not last_micro_step``).

    Returns:
        ``DistributedDataParallel.no_sync()`` for a DDP model, else
        ``contextlib.nullcontext()``.

    ``ddpkit.StepGuard.forward`` uses it for every micro-batch of a window but the last.

    Example:
        >>> for i, (x, y) in enumerate(micro_batches):
        ...     with no_sync(model, enabled=i < len(micro_batches) - 1):
        ...         (criterion(model(x), y) / len(micro_batches)).backward()
    """
    ddp = None
    if enabled and isinstance(model, nn.Module):
        ddp = _find_ddp(model, through_data_parallel=False)
    if ddp is None:
        return contextlib.nullcontext()
    context: AbstractContextManager[Any] = ddp.no_sync()
    return context


def _compiled_inner(model: nn.Module) -> nn.Module | None:
    # torch.compile's OptimizedModule keeps the original as `_orig_mod`; checking
    # the attribute avoids importing torch._dynamo just for an isinstance test.
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def _find_ddp(model: nn.Module, *, through_data_parallel: bool) -> DistributedDataParallel | None:
    while True:
        if isinstance(model, DistributedDataParallel):
            return model
        if (inner := _compiled_inner(model)) is not None:
            model = inner
        elif through_data_parallel and isinstance(model, nn.DataParallel):
            model = model.module
        else:
            return None


def _check_ddp_kwargs(ddp_kwargs: dict[str, Any]) -> None:
    for name in _DEVICE_KWARGS:
        if name in ddp_kwargs:
            raise ValueError(
                f"wrap_ddp: pass device=... instead of {name}={ddp_kwargs[name]!r}; wrap_ddp "
                "sets device_ids and output_device from the device"
            )
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {
        "self",
        "module",
    }
    unknown = sorted(set(ddp_kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"wrap_ddp: DistributedDataParallel takes no argument(s) {unknown}; "
            f"it takes {sorted(accepted - set(_DEVICE_KWARGS))}"
        )
