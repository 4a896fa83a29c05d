"""Gradients over a slow link: bf16 / fp16 all-reduce and PowerSGD, counted, and saved per rank.

``wrap_ddp(model, comm_hook=...)`` registers PyTorch's own DDP communication
hooks (``torch.distributed.algorithms.ddp_comm_hooks``) through a
:class:`CommHook`, which adds what they lack for a job that stops and resumes:

- **the bytes**: each hook call adds what it hands to the all-reduce
  (:meth:`CommHook.bytes_per_step`), so the epoch line can say what a step sends;
- **PowerSGD's state, per rank**: its error feedback and P/Q memories differ
  on every rank (pytorch#75666), so :meth:`CommHook.state_dict` is this rank's
  and a checkpoint keeps every rank's;
- **the first step after a resume**: DDP's first step runs one bucket of every
  gradient and then rebuilds its buckets, while PowerSGD's memories are kept
  per bucket; that step runs PowerSGD on the saved buckets' parts of the
  gradients, so a resume continues bit-exactly;
- **one bucket at a time**: PowerSGD issues its second all-reduce from the first
  one's callback; under Gloo two buckets' calls then reach the ranks in other
  orders and the job aborts (pytorch#58467). Under Gloo each bucket's
  all-reduces end before the hook returns; under NCCL, whose futures complete
  when their work is queued, nothing waits.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.futures import Future

from ddpkit._docs import see
from ddpkit._numbers import as_int
from ddpkit.distributed.comm import garbage_holds_groups
from ddpkit.rng import numpy_state, set_numpy_state

__all__ = ["COMM_HOOKS", "CommHook", "backend_for", "check_comm_hook", "comm_hook_of"]

logger = logging.getLogger("ddpkit")

COMM_HOOKS = ("bf16", "fp16", "powersgd")
"""The names ``wrap_ddp(comm_hook=)`` and ``--comm-hook`` take (None: DDP's own fp32 all-reduce)."""

# PyTorch's defaults (PowerSGDState), under ddpkit's names.
POWERSGD_DEFAULTS = {"powersgd_rank": 1, "powersgd_warmup": 1000, "powersgd_error_feedback": True}
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_HOOKS: weakref.WeakKeyDictionary[nn.Module, CommHook] = weakref.WeakKeyDictionary()


def check_comm_hook(
    name: str | None, params: list[nn.Parameter], backend: str | None, options: Mapping[str, Any]
) -> dict[str, Any]:
    """Refuse a hook this job cannot run; return PowerSGD's options with their defaults.

    ``backend`` is the process group's (None: no group, so nothing runs yet);
    ``options`` the ``powersgd_*`` arguments given (None: not given).

    Raises:
        ValueError: an unknown name, an option of PowerSGD's without it or out of
            range, a backend that cannot all-reduce the hook's dtype, or
            gradients already 16-bit.
    """
    given = {k: v for k, v in options.items() if v is not None}
    if name is not None and name not in COMM_HOOKS:
        raise ValueError(
            f"comm_hook={name!r} is not a hook ddpkit knows: pass one of {list(COMM_HOOKS)}, "
            "or None for DDP's own fp32 all-reduce. " + see("gradient-compression-comm_hook")
        )
    if name != "powersgd" and given:
        raise ValueError(
            f"{', '.join(sorted(given))} set PowerSGD's options, and comm_hook is {name!r}: "
            "pass comm_hook='powersgd' (--comm-hook powersgd), or leave them out. "
            + see("gradient-compression-comm_hook")
        )
    chosen = {**POWERSGD_DEFAULTS, **given}
    if name == "powersgd":
        as_int("powersgd_rank", chosen["powersgd_rank"], low=1)
        feedback = chosen["powersgd_error_feedback"]
        if not isinstance(feedback, bool):
            raise ValueError(f"powersgd_error_feedback must be True or False, got {feedback!r}")
        # PyTorch's own rule: error feedback and warm start keep memories per bucket, and
        # DDP rebuilds its buckets after the first step.
        as_int("powersgd_warmup", chosen["powersgd_warmup"], low=2)
    if name in _HALF:
        wide = sorted({str(p.dtype) for p in params if p.element_size() <= 2})
        if wide:
            raise ValueError(
                f"comm_hook={name!r} halves fp32 gradients, and this model's are already "
                f"{', '.join(wide)}: they would travel as they are. Use no hook, or 'powersgd'. "
                + see("gradient-compression-comm_hook")
            )
        nccl = torch.cuda.nccl.version() if backend == "nccl" else None  # type: ignore[no-untyped-call]
        if name == "bf16" and nccl is not None and nccl < (2, 10):
            raise ValueError(
                f"comm_hook='bf16' needs NCCL 2.10 or newer to all-reduce bfloat16, and this "
                f"torch has NCCL {'.'.join(map(str, nccl))}: use 'fp16'. "
                + see("gradient-compression-comm_hook")
            )
    if name is not None and backend not in (None, "nccl", "gloo"):
        raise ValueError(
            f"comm_hook={name!r} runs on the NCCL and Gloo backends, and this process group's "
            f"is {backend!r}: use no hook there, or --dist-backend nccl / gloo. "
            + see("gradient-compression-comm_hook")
        )
    return chosen if name == "powersgd" else {}


def comm_hook_of(model: nn.Module | Callable[..., Any]) -> CommHook | None:
    """The :class:`CommHook` ``wrap_ddp`` gave ``model`` (through ``torch.compile``), else None."""
    module: Any = model
    while isinstance(module, nn.Module):
        if module in _HOOKS:
            return _HOOKS[module]
        module = getattr(module, "_orig_mod", None)  # a compiled model's original
    return None


class CommHook:
    """One DDP model's gradient synchronisation: which hook, what it sent, its state.

    Made by :func:`ddpkit.wrap_ddp` for every DDP model (``kind`` None: DDP's
    own all-reduce, which sends every trainable gradient in fp32 each step).

    Attributes:
        kind: None, ``"bf16"``, ``"fp16"`` or ``"powersgd"``.
        full_bytes: what one step all-reduces without a hook: every trainable gradient.
        sent: bytes this rank handed to all-reduces through the hook so far.
        steps: gradient synchronisations counted so far (one per optimizer step).
        state: PyTorch's ``PowerSGDState`` (``"powersgd"``), else None.
    """

    def __init__(
        self, ddp: nn.Module, kind: str | None, options: Mapping[str, Any], backend: str
    ) -> None:
        module = getattr(ddp, "module", ddp)
        params = list(module.parameters())
        self.kind = kind
        self.full_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        self.sent, self.steps = 0, 0
        self._index = {id(p): i for i, p in enumerate(params)}
        self._device = params[0].device if params else torch.device("cpu")
        self._numels = [p.numel() for p in params]
        # PowerSGD issues its second all-reduce from the first one's callback, which
        # Gloo runs in a worker thread: two buckets' calls would reach the ranks in other
        # orders (pytorch#58467). NCCL's futures complete when their work is queued.
        self._one_at_a_time = kind == "powersgd" and backend != "nccl"
        # The buckets the memories are keyed by (parameter indices by bucket index), and
        # the buckets of the step in progress.
        self.layout: list[list[int]] = []
        self._seen: list[list[int]] = []
        self.state: Any = None  # PowerSGDState, whose attributes are untyped
        if kind == "powersgd":
            garbage_holds_groups()  # its callbacks: comm.destroy_group collects them
            self.state = powersgd.PowerSGDState(
                None,
                matrix_approximation_rank=options["powersgd_rank"],
                start_powerSGD_iter=options["powersgd_warmup"],
                use_error_feedback=options["powersgd_error_feedback"],
            )
        _HOOKS[ddp] = self
        if kind is not None:
            register: Any = ddp.register_comm_hook
            register(self, lambda hook, bucket: hook.run(bucket))

    def bytes_per_step(self, since: tuple[int, int] = (0, 0)) -> float | None:
        """Bytes a step handed to all-reduces on this rank, on average since ``since``.

        ``since`` is a :meth:`counted` pair; without a hook, every gradient's bytes;
        None when no step was counted since.
        """
        if self.kind is None:
            return float(self.full_bytes)
        steps = self.steps - since[1]
        return (self.sent - since[0]) / steps if steps > 0 else None

    def counted(self) -> tuple[int, int]:
        """``(sent, steps)`` now, to measure an epoch by :meth:`bytes_per_step`."""
        return self.sent, self.steps

    def run(self, bucket: Any) -> Future[Any]:
        """The hook DDP calls for each bucket (in index order).

        Under Gloo a PowerSGD bucket's all-reduces end before the hook returns,
        so the next bucket's cannot interleave with them.
        """
        future = self._bucket(bucket)
        if self._one_at_a_time:
            future.wait()
        return future

    def _bucket(self, bucket: Any) -> Future[Any]:
        if bucket.is_last():
            self.steps += 1
        if self.kind in _HALF:
            self.sent += bucket.buffer().numel() * 2
            if self.kind == "bf16":
                return default_hooks.bf16_compress_hook(None, bucket)  # type: ignore[arg-type]
            return default_hooks.fp16_compress_hook(None, bucket)  # type: ignore[arg-type]
        params = [self._index[id(p)] for p in bucket.parameters()]
        index, layout = bucket.index(), self.layout
        moved = bool(layout) and (index >= len(layout) or params != layout[index])
        compresses = self.state.iter >= self.state.start_powerSGD_iter
        if moved and compresses and sorted(params) == sorted(i for p in layout for i in p):
            return self._in_saved_buckets(bucket)  # DDP's first step: one bucket of all
        if moved and self._remembers():
            logger.warning(
                "PowerSGD: DDP's gradient buckets are not the ones its memories were kept "
                "for; its error feedback and P/Q memories start afresh, so the run is not "
                "bit-exact with an unbroken one from here. %s",
                see("gradient-compression-comm_hook"),
            )
            self._forget()
        self._seen.append(params)
        if bucket.is_last():
            self.layout, self._seen = self._seen, []
        return self._powersgd(bucket)

    def _powersgd(self, bucket: Any) -> Future[Any]:
        state, buffer = self.state, bucket.buffer()
        if state.iter < state.start_powerSGD_iter:  # PowerSGD's warm-up: a plain all-reduce
            self.sent += buffer.numel() * buffer.element_size()
            return powersgd.powerSGD_hook(state, bucket)
        before = state.total_numel_after_compression  # PowerSGD counts P, Q and the rest
        future = powersgd.powerSGD_hook(state, bucket)
        self.sent += (state.total_numel_after_compression - before) * buffer.element_size()
        return future

    def _remembers(self) -> bool:
        state = self.state
        return bool(state.error_dict or state.p_memory_dict)

    def _in_saved_buckets(self, bucket: Any) -> Future[Any]:
        """PowerSGD on the saved buckets' parts of one bucket: DDP's first step after a resume.

        The parts run one after another, in the saved buckets' order, as they
        ran before the stop; then their results go back into ``bucket``.
        """
        indices = (self._index[id(p)] for p in bucket.parameters())
        grads = dict(zip(indices, bucket.gradients(), strict=True))
        count = len(self.layout)
        parts = [_Part(i, count, [grads[p] for p in ps]) for i, ps in enumerate(self.layout)]
        self._seen = []
        future: Future[Any] = Future()
        for part in parts:  # under NCCL a future is done once its work is queued
            future = self._powersgd(part)
            if self._one_at_a_time:
                future.wait()

        def copy_back(fut: Future[Any]) -> torch.Tensor:
            fut.value()  # a part's error
            for part in parts:
                part.copy_back()
            buffer: torch.Tensor = bucket.buffer()
            return buffer

        return future.then(copy_back)

    def _forget(self) -> None:
        state = self.state
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        self.layout, self._seen = [], []

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, ``weights_only``-loadable: the hook, and PowerSGD's memories."""
        saved: dict[str, Any] = {"kind": self.kind}
        state = self.state
        if state is None:
            return saved
        return saved | {
            "options": _options(state),
            "iter": state.iter,
            "rng": numpy_state(state.rng),
            "error": _to_cpu(state.error_dict),
            "p": _to_cpu(state.p_memory_dict),
            "q": _to_cpu(state.q_memory_dict),
            "layout": [list(part) for part in self.layout],
            "numel": [state.total_numel_before_compression, state.total_numel_after_compression],
            "next_stats_report": state.next_stats_report,
        }

    def load_state_dict(self, saved: Any) -> str | None:
        """Load this rank's saved state; return why it cannot be used (the state is then fresh).

        A state saved by another hook, or by PowerSGD with other options, is not loaded.
        """
        state = self.state
        if state is None:
            return None  # bf16, fp16 and DDP's own all-reduce keep nothing between steps
        kind = saved.get("kind") if isinstance(saved, dict) else None
        if kind != "powersgd":
            return f"it was saved with comm hook {kind or 'none'}, which keeps no PowerSGD state"
        if saved.get("options") != _options(state):
            mine = _options(state)
            return f"it was saved with PowerSGD {saved.get('options')}, and this run has {mine}"
        try:
            memories = {
                name: {int(k): v.to(self._device) for k, v in saved[name].items()}
                for name in ("error", "p", "q")
            }
            layout = [[int(i) for i in part] for part in saved["layout"]]
            sizes = [sum(self._numels[i] for i in part) for part in layout]
            for index, error in memories["error"].items():
                if not (0 <= index < len(sizes) and error.shape == (sizes[index],)):
                    raise ValueError(f"error feedback {index} does not fit its bucket")
            numbers = int(saved["iter"]), [int(n) for n in saved["numel"]]
            stats = int(saved["next_stats_report"])
            set_numpy_state(tuple(saved["rng"]), state.rng)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            return f"its PowerSGD state is malformed ({type(exc).__name__}: {exc})"
        state.iter, (before, after) = numbers
        state.total_numel_before_compression, state.total_numel_after_compression = before, after
        state.next_stats_report = stats
        for name, memory in zip(
            ("error", "p", "q"),
            (state.error_dict, state.p_memory_dict, state.q_memory_dict),
            strict=True,
        ):
            memory.clear()
            memory.update(memories[name])
        self.layout, self._seen = layout, []
        return None


class _Part:
    """One saved bucket's part of a bigger bucket, as PowerSGD reads a bucket."""

    def __init__(self, index: int, count: int, grads: list[torch.Tensor]) -> None:
        self._index, self._count, self._grads = index, count, grads
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._views: list[torch.Tensor] = []
        offset = 0
        for g in grads:
            self._views.append(self._buffer[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def copy_back(self) -> None:
        for grad, view in zip(self._grads, self._views, strict=True):
            grad.copy_(view)


def backend_for(backend: str, device: torch.device) -> str:
    """The backend of a group's collectives on ``device``: ``"cpu:gloo,cuda:nccl"`` has two."""
    if ":" not in backend:
        return backend
    by_device = dict(part.split(":", 1) for part in backend.split(","))
    return by_device.get(device.type, backend)


def _options(state: Any) -> dict[str, Any]:
    return {
        "powersgd_rank": state.matrix_approximation_rank,
        "powersgd_warmup": state.start_powerSGD_iter,
        "powersgd_error_feedback": state.use_error_feedback,
    }


def _to_cpu(memory: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {int(k): v.detach().cpu() for k, v in memory.items()}
