"""Checkpoints that do not stall training: copy the state to host memory, write it in a thread.

The training loop blocks only while :func:`snapshot` copies the state's
tensors to host memory; a :class:`BackgroundWriter` then writes the files with
the usual guarantees (temporary file, fsync, rename, directory fsync). At most
one write is in flight: the next save, and the end of training, wait for it.
The next snapshot copies into the host tensors of the one before, once its
write is done: fresh host memory must be faulted in page by page, which takes
longer than the copy itself.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["BackgroundWriter", "snapshot"]

logger = logging.getLogger("ddpkit")


def snapshot(obj: Any, reuse: Any = None) -> Any:
    """A copy of ``obj`` whose tensors are on the CPU and share nothing with training.

    Dicts (ordered or not), lists and tuples are rebuilt; other leaves (numbers,
    strings) are immutable and kept. CUDA tensors are copied with one
    synchronisation at the end rather than one per tensor.

    Args:
        obj: the state to copy.
        reuse: an earlier snapshot that nothing reads any more (its write is
            done). Where it holds a CPU tensor of the same shape, dtype and
            strides at the same place, the new values are copied into that
            tensor instead of into newly allocated memory: the result is the
            same, and faster to make. ``reuse`` is overwritten.
    """
    on_cuda = False
    taken: set[int] = set()  # tensors of ``reuse`` already written to

    def copy(value: Any, old: Any) -> Any:
        nonlocal on_cuda
        if isinstance(value, torch.Tensor):
            value = value.detach()
            cuda = value.device.type == "cuda"
            on_cuda |= cuda
            if _fits(old, value, taken):
                return old.copy_(value, non_blocking=cuda)
            if value.device.type == "cpu":
                return value.clone()
            return value.to("cpu", non_blocking=cuda)
        if isinstance(value, OrderedDict):
            new = OrderedDict((k, copy(v, _get(old, k))) for k, v in value.items())
            if hasattr(value, "_metadata"):  # a state dict's per-module versions
                new._metadata = value._metadata  # type: ignore[attr-defined]
            return new
        if isinstance(value, dict):
            return {k: copy(v, _get(old, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [copy(v, _at(old, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(copy(v, _at(old, i)) for i, v in enumerate(value))
        return value

    result = copy(obj, reuse)
    if on_cuda:
        torch.cuda.synchronize()  # non_blocking copies must land before the thread reads them
    return result


def _fits(old: Any, value: torch.Tensor, taken: set[int]) -> bool:
    """Whether ``old``, a tensor of an earlier snapshot, can take ``value``'s copy as it is."""
    if type(old) is not torch.Tensor or type(value) is not torch.Tensor or id(old) in taken:
        return False
    same = bool(
        old.device.type == "cpu"
        and old.layout == value.layout == torch.strided
        and not (value.is_quantized or value.is_conj() or value.is_neg())
        and old.dtype == value.dtype
        and old.shape == value.shape
        and old.stride() == value.stride()
        and old.storage_offset() == 0
        and old.untyped_storage().nbytes() == old.numel() * old.element_size()
        and _dense(old)
    )
    if same:
        taken.add(id(old))
    return same


def _dense(t: torch.Tensor) -> bool:
    """No gaps and no overlap: what a copy of a dense tensor looks like."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _get(old: Any, key: Any) -> Any:
    return old.get(key) if isinstance(old, dict) else None


def _at(old: Any, index: int) -> Any:
    return old[index] if isinstance(old, list | tuple) and index < len(old) else None


class BackgroundWriter:
    """One write at a time, in the one thread of a ``ThreadPoolExecutor``; its error kept.

    The thread serves every write of the writer's life, started with the first:
    a thread that ends while the training thread forks DataLoader workers can
    leave the child stuck for ever in CPython's after-fork clean-up (3.11).
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future[Any] | None = None
        self._error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        """The failed write's exception, until :meth:`wait` raises it."""
        if self._job is not None and self._job.done():
            job, self._job = self._job, None
            self._error = job.exception()
        return self._error

    def join(self) -> None:
        """Wait for the write in flight without raising its error."""
        if self._job is not None:
            futures.wait([self._job])

    @property
    def busy(self) -> bool:
        """A write is in flight."""
        return self._job is not None and not self._job.done()

    def submit(self, write: Callable[[], Any]) -> None:
        """Wait for the write in flight, then start ``write`` in the background.

        Raises:
            BaseException: the previous write's error, if it failed and was not
                raised yet; ``write`` is then not started.
        """
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ddpkit-checkpoint-writer")
        self._job = self._pool.submit(_logged, write)

    def wait(self) -> None:
        """Wait for the write in flight; raise its error once if it failed."""
        self.join()
        error, self._error = self.error, None
        if error is not None:
            raise error


def _logged(write: Callable[[], Any]) -> None:
    try:
        write()
    except BaseException as exc:  # kept in the future for the training thread, which raises it
        logger.error("checkpoint write failed: %s: %s", type(exc).__name__, exc)
        raise
