"""Sending a checkpoint's state from the one rank that holds it to all the others, in chunks.

When the machines of a job share no checkpoint directory, only the rank that
wrote the newest checkpoint can load it; :func:`broadcast_state` hands what it
loaded to every other rank over the process group. The structure travels
pickled without any tensor data; the tensors follow as flat byte buffers of at
most ``chunk_bytes``, one buffer reused for all of them, so no rank holds more
than the state itself and one chunk, however large the checkpoint.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.devices import as_device, collective_device

__all__ = ["broadcast_state"]

# Per chunk: (tensor index, first byte in the tensor, first byte in the chunk, length).
_Piece = tuple[int, int, int, int]


def broadcast_state(
    state: Any | None,
    src: int,
    *,
    device: torch.device | str | None = None,
    chunk_bytes: int = 64 * 2**20,
) -> Any:
    """Return rank ``src``'s ``state`` on every rank: its structure once, its tensors in chunks.

    Rank ``src`` passes the state (dicts, lists, tuples, strings, numbers, None,
    bytes and tensors, as a checkpoint holds); the others pass None (ignored).
    ``src`` gets its own object back; the others get an equal tree whose tensors
    are new, independent CPU tensors (an ``nn.Parameter`` arrives as a plain
    tensor; one tensor object that occurs twice arrives as one, twice).
    Receivers allocate each tensor once and fill it from the chunks; the sender
    copies one chunk's worth of bytes at a time (and makes a contiguous copy of
    a non-contiguous tensor). Without a process group, or in a group of one,
    ``state`` is returned as is. The structure travels pickled, as with
    ``broadcast_object_list``: use it between the ranks of one job only.

    All ranks must call this, or it deadlocks.

    Args:
        state: the tree to send, on rank ``src``; ignored on the other ranks.
        src: the rank that holds the state.
        device: where the chunk buffers live for the collectives; by default
            the current CUDA device under NCCL, else the CPU. Received tensors
            always end up on the CPU.
        chunk_bytes: the most bytes one collective carries (64 MiB by default).

    Returns:
        The state: ``state`` itself on ``src``, an equal tree elsewhere.

    Raises:
        ValueError: ``src`` is not a rank of the job or ``chunk_bytes`` is not a
            positive int.
        RuntimeError: ``src`` could not pickle the state (a sparse, quantized or
            meta tensor, an unpicklable object) or a receiver could not rebuild
            it (out of memory); raised on every rank, so none waits forever.

    Example:
        >>> state = load_checkpoint(path) if have_checkpoint else None
        >>> holder = max(all_gather_object((have_checkpoint, get_rank())))[1]
        >>> state = broadcast_state(state, src=holder)
        >>> model.load_state_dict(state["model"])
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(
            f"broadcast_state: src={src!r} is not a rank of this job of {world}; "
            f"pass the rank that holds the state, an int from 0 to {world - 1}"
        )
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(
            f"broadcast_state: chunk_bytes={chunk_bytes!r} must be a positive int "
            "(the most bytes one collective carries)"
        )
    if world == 1:
        return state
    dev = _buffer_device(device)
    sending = dist.get_rank() == src
    tensors: list[torch.Tensor] = []
    failure: Exception | None = None
    header: list[Any] = [(None, None)]
    if sending:
        try:
            file = io.BytesIO()
            _Pickler(file, tensors).dump(state)
            header[0] = (file.getvalue(), None)
        except Exception as exc:
            failure = exc
            header[0] = (None, f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(header, src=src, device=dev)
    structure, error = header[0]
    if error is not None:
        raise RuntimeError(
            f"broadcast_state: rank {src} could not send its state ({error}); it must be a "
            "tree of dicts, lists, tuples, plain values and dense tensors"
        ) from failure
    if not sending:
        try:
            state = _Unpickler(io.BytesIO(structure), tensors).load()
        except Exception as exc:
            failure = exc
    # Tell src and the others before the chunks start, or they would wait on this rank forever.
    failed = torch.tensor([dist.get_rank() + 1 if failure else 0], device=dev)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        reason = f"{type(failure).__name__}: {failure}" if failure else "see its log"
        raise RuntimeError(
            f"broadcast_state: rank {int(failed.item()) - 1} could not rebuild the state "
            f"that rank {src} sent ({reason})"
        ) from failure
    _stream(tensors, src, sending, chunk_bytes, dev)
    return state


def _buffer_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return collective_device()
    dev = as_device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


class _Pickler(pickle.Pickler):
    """Pickles a tree with each tensor a placeholder (index, dtype, shape), as torch.save does."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.indices: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> tuple[int, torch.dtype, tuple[int, ...]] | None:
        if not isinstance(obj, torch.Tensor):
            return None
        if obj.layout != torch.strided or obj.is_quantized or obj.is_meta:
            kind = "quantized" if obj.is_quantized else "meta" if obj.is_meta else obj.layout
            raise TypeError(f"a {kind} tensor of shape {tuple(obj.shape)} has no plain bytes")
        index = self.indices.setdefault(id(obj), len(self.tensors))
        if index == len(self.tensors):
            self.tensors.append(obj)
        return index, obj.dtype, tuple(obj.shape)


class _Unpickler(pickle.Unpickler):
    """Rebuilds the tree, allocating an empty CPU tensor for each placeholder."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: tuple[int, torch.dtype, tuple[int, ...]]) -> torch.Tensor:
        index, dtype, shape = pid
        if index == len(self.tensors):
            self.tensors.append(torch.empty(shape, dtype=dtype))
        return self.tensors[index]


def _chunks(sizes: list[int], chunk_bytes: int) -> Iterator[tuple[int, list[_Piece]]]:
    """The tensors' bytes laid end to end and cut every ``chunk_bytes``: (length, pieces)."""
    pieces: list[_Piece] = []
    fill = 0
    for index, size in enumerate(sizes):
        done = 0
        while done < size:
            n = min(size - done, chunk_bytes - fill)
            pieces.append((index, done, fill, n))
            done += n
            fill += n
            if fill == chunk_bytes:
                yield fill, pieces
                pieces, fill = [], 0
    if fill:
        yield fill, pieces


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's data as a flat uint8 tensor on its device; a copy only if not contiguous."""
    plain = tensor.detach().resolve_conj().resolve_neg().contiguous()
    return plain.reshape(-1).view(torch.uint8)  # reshape first: a 0-dim tensor cannot view


def _stream(
    tensors: list[torch.Tensor], src: int, sending: bool, chunk_bytes: int, device: torch.device
) -> None:
    """Broadcast the tensors' bytes from ``src`` into the receivers' tensors, chunk by chunk."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(sizes)
    if total == 0:
        return
    buffer = torch.empty(min(chunk_bytes, total), dtype=torch.uint8, device=device)
    held, flat = -1, buffer  # the sender's bytes of tensor `held`: at most one copy at a time
    for length, pieces in _chunks(sizes, chunk_bytes):
        chunk = buffer[:length]
        if sending:
            for index, start, at, n in pieces:
                if index != held:
                    held, flat = index, _as_bytes(tensors[index])
                chunk[at : at + n].copy_(flat[start : start + n])
        dist.broadcast(chunk, src)
        if not sending:
            for index, start, at, n in pieces:
                # A fresh CPU tensor is contiguous, so this is a view that writes into it.
                target = tensors[index].view(-1).view(torch.uint8)
                target[start : start + n].copy_(chunk[at : at + n])
