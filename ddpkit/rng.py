"""Random number generator state: capture and restore it, and seed it per sample.

:func:`capture_rng_state` / :func:`restore_rng_state` save the global RNGs in
a checkpoint; :func:`seeded` and :func:`sample_seed` give each sample's
augmentation RNGs seeded by ``(seed, epoch, index)``, which is what makes a
resumed run bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import torch

__all__ = [
    "capture_rng_state",
    "check_rng_state",
    "numpy_state",
    "restore_rng_state",
    "sample_seed",
    "seeded",
    "set_numpy_state",
]

_MASK64 = (1 << 64) - 1
_HostStates = tuple[Any, Any, torch.Tensor]


def capture_rng_state() -> dict[str, Any]:
    """Return the states of Python's, NumPy's, torch's and (in use) CUDA's global RNGs.

    The dict holds only tensors, numbers, strings and tuples, so it saves with
    :func:`save_checkpoint`. CUDA generators are captured once CUDA is
    initialised; before that they have no state of their own.

    Example:
        >>> state = capture_rng_state()
        >>> restore_rng_state(state)  # the next torch.rand() repeats
    """
    python, _, cpu = _host_states()
    cuda_in_use = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return {
        "python": python,
        "numpy": numpy_state(),
        "torch": cpu,
        "cuda": torch.cuda.get_rng_state_all() if cuda_in_use else [],
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the RNG states that :func:`capture_rng_state` returned.

    Args:
        state: its dict, possibly saved and loaded.

    Raises:
        ValueError: ``state`` is not such a dict (:func:`check_rng_state`);
            nothing is restored.

    Example:
        >>> restore_rng_state(load_checkpoint("run/latest.pth")["rng"][get_rank()])
    """
    check_rng_state(state)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") and torch.cuda.is_available():
        # On machines with fewer GPUs than the saving ones, restore the generators that exist.
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)


def numpy_state(generator: np.random.RandomState | None = None) -> tuple[Any, ...]:
    """NumPy's global RNG state, or ``generator``'s, in a form ``weights_only`` loads.

    ``(kind, key, pos, has_gauss, cached_gaussian)`` with the key as an int64
    tensor: ``weights_only`` cannot read NumPy arrays, and int64 holds the
    uint32 key exactly. :func:`set_numpy_state` puts it back.
    """
    saved = np.random.get_state() if generator is None else generator.get_state()
    kind, keys, pos, has_gauss, cached = cast(tuple[Any, ...], saved)
    key = torch.from_numpy(keys.astype(np.int64))
    return (str(kind), key, int(pos), int(has_gauss), float(cached))


def set_numpy_state(saved: tuple[Any, ...], generator: np.random.RandomState | None = None) -> None:
    """Put back a state of :func:`numpy_state` into NumPy's global RNG, or ``generator``."""
    kind, keys, pos, has_gauss, cached = saved
    state = (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    if generator is None:
        np.random.set_state(state)
    else:
        generator.set_state(state)


def check_rng_state(state: Any) -> None:
    """Check that ``state`` has the shape :func:`capture_rng_state` gives, before restoring any.

    Raises:
        ValueError: it is not a dict, lacks a part, or a part has another
            shape or type; the message names the part and what it holds.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"the RNG state is {_shown(state)}, not capture_rng_state()'s dict")
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(f"the RNG state lacks {sorted(missing)}; pass capture_rng_state()'s dict")
    python = state["python"]
    if not (
        isinstance(python, tuple | list)
        and len(python) == 3
        and isinstance(python[1], tuple | list)
        and all(type(v) is int for v in python[1])
    ):
        raise ValueError(
            f"the RNG state's 'python' part is {_shown(python)}, not "
            "random.getstate()'s (version, internal state, gauss)"
        )
    numpy = state["numpy"]
    if not (
        isinstance(numpy, tuple | list)
        and len(numpy) == 5
        and isinstance(numpy[0], str)
        and isinstance(numpy[1], torch.Tensor)
        and numpy[1].dim() == 1
        and not numpy[1].is_floating_point()
        and type(numpy[2]) is int
        and type(numpy[3]) is int
        and isinstance(numpy[4], float | int)
    ):
        raise ValueError(
            f"the RNG state's 'numpy' part is {_shown(numpy)}, not (kind, key "
            "tensor, position, has_gauss, cached)"
        )
    cpu = state["torch"]
    if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8 and cpu.dim() == 1):
        raise ValueError(f"the RNG state's 'torch' part is {_shown(cpu)}, not a uint8 tensor")
    cuda = state.get("cuda", [])
    if not (
        isinstance(cuda, list | tuple)
        and all(isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda)
    ):
        raise ValueError(
            f"the RNG state's 'cuda' part is {_shown(cuda)}, not a list of uint8 tensors"
        )


def _shown(value: Any) -> str:
    """A short description of ``value`` for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def sample_seed(seed: int, epoch: int, index: int, draw: int | None = None) -> int:
    """A 63-bit seed for sample ``index`` of ``epoch`` in a run seeded with ``seed``.

    Each part is folded in through splitmix64's finaliser, a bijection on 64
    bits, so distinct ``(epoch, index)`` pairs of a run get unrelated seeds
    (a collision is as likely as between random 63-bit numbers). ``draw``
    tells apart the draws of one sample in one epoch (a weighted sampler's
    repeats, repeated augmentation's copies): each gets its own seed, and
    ``None`` gives the seed of a sample drawn once.
    """
    z = _mix64(seed & _MASK64)
    z = _mix64(z ^ (epoch & _MASK64))
    z = _mix64(z ^ (index & _MASK64))
    if draw is not None:
        z = _mix64(z ^ (draw & _MASK64) ^ 0xD1B54A32D192ED03)
    return z & ((1 << 63) - 1)


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@contextmanager
def seeded(seed: int, *, restore: bool = True) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's CPU RNGs with ``seed`` for the body.

    Args:
        seed: the seed (NumPy takes its low 32 bits).
        restore: put the previous states back afterwards (False in a
            DataLoader worker, whose RNGs belong to nothing else).
    """
    saved = _host_states() if restore else None
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.default_generator.manual_seed(seed)  # the CPU generator only, not CUDA's
    try:
        yield
    finally:
        if saved is not None:
            _set_host_states(saved)


def _host_states() -> _HostStates:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_host_states(states: _HostStates) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
