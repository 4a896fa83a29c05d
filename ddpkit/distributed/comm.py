"""Small process-group helpers that work with and without ``torch.distributed``.

Every helper here is safe to call in a plain single-process script: without a
process group ``get_world_size()`` is 1, ``barrier()`` returns at once and the
reductions return their input. Inside a process group they call the real
collectives, so **every rank must call a collective helper, in the same order,
or the job deadlocks**.
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist

from ddpkit.distributed.devices import collective_device
from ddpkit.distributed.launchers import detect_launcher

__all__ = [
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_dist_initialized",
    "is_main_process",
]

_T = TypeVar("_T")

PATIENT_TIMEOUT = timedelta(hours=2)
"""How long ``all_gather_object(patient=True)`` waits: for a slow store, not a hung peer."""
_PATIENT: dict[int, Any] = {}
_HOLDERS_LEFT: list[bool] = []  # garbage_holds_groups() was called in this process


def is_dist_initialized() -> bool:
    """Return True when a default ``torch.distributed`` process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Return this process's global rank, or 0 without a process group."""
    return dist.get_rank() if is_dist_initialized() else 0


def get_world_size() -> int:
    """Return the number of processes in the job, or 1 without a process group."""
    return dist.get_world_size() if is_dist_initialized() else 1


def get_local_rank() -> int:
    """Return this process's rank on its own machine, as its launcher set it; 0 otherwise.

    Without a process group this is 0. With one, it is the local rank the
    launcher that started the process gave it (torchrun's ``LOCAL_RANK``,
    ``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``; ``ddpkit.spawn`` and
    ``run_distributed`` set torchrun's), and 0 for a job started without a
    launcher. :attr:`ddpkit.DistInfo.local_rank` is always right: prefer it.
    """
    if not is_dist_initialized():
        return 0
    try:
        launch = detect_launcher()
    except ValueError:  # malformed variables: init_distributed reported them already
        return 0
    return launch.local_rank if launch is not None else 0


def is_main_process() -> bool:
    """Return True on global rank 0 (and in a process without a process group)."""
    return get_rank() == 0


def barrier() -> None:
    """Wait until every rank reaches this point; a no-op without a process group.

    All ranks must call this, or it deadlocks.
    """
    if not is_dist_initialized():
        return
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        # Without device_ids NCCL guesses the device from the rank and warns.
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


@overload
def all_reduce_sum(value: torch.Tensor) -> torch.Tensor: ...
@overload
def all_reduce_sum(value: int) -> int: ...
@overload
def all_reduce_sum(value: float) -> float: ...


def all_reduce_sum(value: torch.Tensor | int | float) -> torch.Tensor | int | float:
    """Return the sum of ``value`` over all ranks; the value itself without a process group.

    A tensor comes back as a new tensor on the input's device and with its dtype
    (the input is not modified). An ``int`` comes back as an exact ``int``
    (summed in int64) and a ``float`` as a ``float`` (summed in float64).

    All ranks must call this, or it deadlocks.

    Args:
        value: a tensor of the same shape and dtype on every rank, or a number.

    Returns:
        The element-wise sum over ranks, of the same kind as ``value``.

    Raises:
        TypeError: ``value`` is neither a tensor nor a number.

    Example:
        >>> correct = all_reduce_sum(int((pred == target).sum()))
    """
    if isinstance(value, torch.Tensor):
        if not is_dist_initialized():
            return value.clone()
        work = value.detach().to(collective_device(), copy=True)
        dist.all_reduce(work, op=dist.ReduceOp.SUM)
        return work.to(value.device)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"all_reduce_sum takes a tensor, an int or a float, got {type(value).__name__}; "
            "convert it first (for example with int(...) or torch.as_tensor(...))"
        )
    if not is_dist_initialized():
        return value
    dtype = torch.int64 if isinstance(value, int) else torch.float64
    work = torch.tensor([value], dtype=dtype, device=collective_device())
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return int(work.item()) if isinstance(value, int) else float(work.item())


def all_gather_object(obj: _T, *, patient: bool = False) -> list[_T]:
    """Gather one picklable object from every rank into a list in rank order.

    Without a process group this is ``[obj]``. The objects travel pickled
    between the job's own processes; never feed it data from untrusted peers.

    All ranks must call this, or it deadlocks.

    Args:
        obj: any picklable object.
        patient: gather in a Gloo group of all ranks whose timeout is
            :data:`PATIENT_TIMEOUT`, not the process group's: for the ranks that
            wait while one of them talks to a slow store (made by the first such call).

    Returns:
        ``[obj_from_rank_0, obj_from_rank_1, ...]``.
    """
    if not is_dist_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=_patient_group() if patient else None)
    return gathered


def gather_object(obj: _T, dst: int, *, patient: bool = False) -> list[_T] | None:
    """Gather one picklable object from every rank on rank ``dst`` alone, in rank order.

    Like :func:`all_gather_object`, for objects too large for every rank to hold
    every rank's (PowerSGD's per-rank state). All ranks must call this, or it deadlocks.

    Returns:
        ``[obj_from_rank_0, ...]`` on ``dst``; None on the other ranks.
    """
    if not is_dist_initialized():
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size() if get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst, group=_patient_group() if patient else None)
    return gathered


def destroy_group() -> None:
    """Destroy the default process group, if there is one, and free what still held it.

    In a process that used PowerSGD, garbage holds the group after
    ``destroy_process_group`` (the hook's callbacks, a DDP model's reference
    cycles). Freed by a collection here, in this thread, the group shuts its Gloo
    threads down cleanly; left to the interpreter's exit, the teardown aborts the
    process ("terminate called without an active exception") and a queued result
    or log line is lost.
    """
    if is_dist_initialized():
        dist.destroy_process_group()
        if _HOLDERS_LEFT:  # a collection costs 0.1-0.2 s: only where such garbage is made
            gc.collect()


def garbage_holds_groups() -> None:
    """Say that this process made garbage that holds process groups (PowerSGD's hook)."""
    _HOLDERS_LEFT.append(True)


def _patient_group() -> Any:
    key = id(dist.group.WORLD)
    if key not in _PATIENT:
        _PATIENT[key] = dist.new_group(backend="gloo", timeout=PATIENT_TIMEOUT)
    return _PATIENT[key]
