"""Crash-safe checkpoints that load with ``torch.load(weights_only=True)``, and rank-0 helpers.

Nothing ddpkit reads executes code: every file is read with ``weights_only=True``,
so :func:`save_checkpoint` refuses, before writing a byte, anything such a load
could not read back (numpy arrays, custom objects, functions ...) and names where
it sits (``"optimizer.state.3.momentum_buffer"``). Files are written under a
temporary name in the same directory, fsynced, then renamed over the old one:
a crash or a kill leaves the old file or the new one, never half of one.
:class:`CheckpointManager` keeps a training run's files; its docstring lists them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import pickle
import random
import re
import secrets
import shutil
import traceback
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast, overload

import numpy as np
import torch
from torch import nn

from ddpkit.comm import all_gather_object, barrier, get_rank, get_world_size, is_dist_initialized
from ddpkit.parallel import unwrap_model

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "RankZeroError",
    "capture_rng_state",
    "load_checkpoint",
    "rank0_only",
    "rank_zero_first",
    "restore_rng_state",
    "save_checkpoint",
]

logger = logging.getLogger("ddpkit")

_P = ParamSpec("_P")
_R = TypeVar("_R")
_FORMAT, _VERSION = "ddpkit-checkpoint", 1
# Exact types, not subclasses: a subclass (an IntEnum, a namedtuple, a defaultdict)
# pickles as its own class, which the weights_only unpickler refuses (torch 2.14).
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None))
_TORCH_LEAVES = (torch.Tensor, nn.Parameter, torch.Size, torch.dtype, torch.device, torch.layout)
_CONTAINERS = (dict, OrderedDict, Counter, list, tuple, set)
_NUMPY_SCALARS = ((np.bool_, bool), (np.integer, int), (np.floating, float))
_MapLocation = str | torch.device | None


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: damaged, unsafe to load, or saved for another job."""


class RankZeroError(RuntimeError):
    """Raised on the other ranks when rank 0 failed inside a ``rank0_only(sync=True)`` call.

    Attributes:
        exc_type: the qualified name of rank 0's exception type.
        exc_message: rank 0's exception message.
        remote_traceback: rank 0's formatted traceback.
    """

    def __init__(self, message: str, exc_type: str, exc_message: str, remote_traceback: str):
        super().__init__(message)
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback


def _sanitize(obj: Any, path: str, active: set[int]) -> Any:
    """Check ``obj``; return it with numpy scalars made numbers, copying only what changes."""
    kind = type(obj)
    if kind in _LEAVES or kind in _TORCH_LEAVES:
        return obj
    for np_type, py_type in _NUMPY_SCALARS:
        if isinstance(obj, np_type):
            return py_type(obj)
    where = path or "the checkpoint"
    if isinstance(obj, np.ndarray):
        raise TypeError(
            f"save_checkpoint: {where} is a numpy.ndarray (shape {obj.shape}, dtype {obj.dtype}), "
            "which torch.load(weights_only=True) cannot read back; store torch.from_numpy(value)"
        )
    if kind not in _CONTAINERS:
        hint = (
            "store value.as_subclass(torch.Tensor)"
            if isinstance(obj, torch.Tensor)
            else "store tensors, numbers, strings, None and dicts, lists or tuples of them "
            "(for a module or an optimizer, its state_dict())"
        )
        raise TypeError(
            f"save_checkpoint: {where} is a {kind.__module__}.{kind.__qualname__}, which "
            f"torch.load(weights_only=True) cannot read back; {hint}"
        )
    if id(obj) in active:
        raise TypeError(f"save_checkpoint: {where} contains itself; a checkpoint must be a tree")
    active.add(id(obj))
    try:
        if isinstance(obj, dict):
            sub = [(f"{path}.{k}" if path else str(k), k, v) for k, v in obj.items()]
            items = [
                (_sanitize(k, f"{p} (the key)", active), _sanitize(v, p, active)) for p, k, v in sub
            ]
            if all(nk is k and nv is v for (nk, nv), (_, k, v) in zip(items, sub, strict=True)):
                return obj
            new = kind(dict(items))
            if hasattr(obj, "_metadata"):  # a state dict's per-module versions
                new._metadata = obj._metadata
            return new
        values = [
            _sanitize(v, f"{path}.{i}" if path else str(i), active) for i, v in enumerate(obj)
        ]
        return obj if all(n is v for n, v in zip(values, obj, strict=True)) else kind(values)
    finally:
        active.discard(id(obj))


def _replace_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    # Make the rename itself durable; some platforms and file systems cannot.
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file(obj: Any, tmp: Path) -> None:
    with open(tmp, "xb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(obj: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` atomically, in a form ``torch.load(weights_only=True)`` reads.

    Accepted: tensors, ``str``, ``bytes``, ``int``, ``float``, ``complex``, ``bool``,
    ``None``, ``torch.Size``/``dtype``/``device``, and ``dict``/``OrderedDict``/
    ``Counter``/``list``/``tuple``/``set`` of them. NumPy scalars are stored as
    Python numbers (in a copy; ``obj`` is not modified). NumPy arrays are refused
    rather than converted, so what you load back has the type you stored. The
    data goes to ``.{name}.tmp-{pid}-{random}`` next to ``path``, is fsynced, and
    is renamed over ``path``.

    Args:
        obj: a mapping, usually of state dicts.
        path: the file to write; its directory must exist.

    Raises:
        TypeError: something in ``obj`` cannot be loaded back; the message names
            its key path and type. Nothing is written.
        FileNotFoundError: the directory of ``path`` does not exist.
        NotADirectoryError: the parent of ``path`` is not a directory.
        OSError: writing failed (a full disk ...); ``path`` is as it was.

    Example:
        >>> save_checkpoint({"model": model.state_dict(), "epoch": 3}, "run/ckpt.pth")
    """
    if not isinstance(obj, Mapping):
        raise TypeError(f"save_checkpoint takes a mapping (dict), got {type(obj).__name__}")
    clean = _sanitize(obj if type(obj) in _CONTAINERS else dict(obj), "", set())
    target = Path(path)
    if not target.parent.is_dir():
        error, problem = (
            (NotADirectoryError, "is not a directory")
            if target.parent.exists()
            else (FileNotFoundError, "does not exist; create it first")
        )
        raise error(f"save_checkpoint: {target.parent}, the directory of {target}, {problem}")
    _replace_atomic(target, functools.partial(_write_file, clean))


def load_checkpoint(
    path: str | os.PathLike[str], map_location: _MapLocation = "cpu"
) -> dict[str, Any]:
    """Load a checkpoint with ``torch.load(weights_only=True)``: nothing in it can run code.

    Args:
        path: the file.
        map_location: where tensors go, as for ``torch.load``; the CPU by default.

    Returns:
        The stored dict.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CheckpointError: the file is damaged or truncated, holds no dict, or
            holds objects that only a full unpickle (which can run code) builds.

    Example:
        >>> state = load_checkpoint("run/latest.pth")
    """
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"load_checkpoint: no checkpoint file at {path}") from None
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        if not found and "allowlist" not in str(e):
            raise _damaged(path, e) from e
        raise CheckpointError(
            f"{path} holds {found.group(1) if found else 'an object'} that only a full unpickle, "
            "which can run code, would build; ddpkit loads only weights_only-safe checkpoints. "
            "If you trust the file, convert it once: torch.load(path, weights_only=False), "
            "then save its state dicts, tensors and numbers with ddpkit.save_checkpoint"
        ) from None
    except (RuntimeError, EOFError, ValueError, KeyError, IndexError) as e:
        raise _damaged(path, e) from e
    except OSError as e:
        if e.errno != 22:  # EINVAL: torch's reader seeking past the end of a truncated file
            raise
        raise _damaged(path, e) from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a dict of state")
    return obj


def _damaged(path: object, error: BaseException) -> CheckpointError:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return CheckpointError(
        f"{path} is damaged (truncated write? full disk?) and cannot be loaded ({reason}); "
        "use an older checkpoint"
    )


@overload
def rank0_only(fn: Callable[_P, _R], /) -> Callable[_P, _R | None]: ...
@overload
def rank0_only(
    fn: None = None, /, *, sync: bool = False
) -> Callable[[Callable[_P, _R]], Callable[_P, _R | None]]: ...


def rank0_only(
    fn: Callable[_P, _R] | None = None, /, *, sync: bool = False
) -> Callable[_P, _R | None] | Callable[[Callable[_P, _R]], Callable[_P, _R | None]]:
    """Run the decorated function on rank 0 only; the other ranks get None.

    Without a process group the function always runs. With ``sync=True`` a call
    is a collective (all ranks must call it, or it deadlocks): every rank waits
    for rank 0, and if rank 0 raised, it re-raises its exception while every
    other rank raises :class:`RankZeroError`, instead of waiting at the next
    collective for a rank that is gone.

    Args:
        fn: the function, when used as ``@rank0_only``.
        sync: wait for rank 0 and share its failure: ``@rank0_only(sync=True)``.

    Returns:
        The decorated function: rank 0's result on rank 0, None elsewhere.

    Raises:
        RankZeroError: (calls with ``sync=True``, ranks > 0) rank 0 raised; its
            exception type, message and traceback are on the error.

    Example:
        >>> @rank0_only(sync=True)
        ... def write_report(path: str) -> None: ...
    """

    def decorate(func: Callable[_P, _R]) -> Callable[_P, _R | None]:
        @functools.wraps(func)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
            rank = get_rank()
            if not (sync and is_dist_initialized()):
                return func(*args, **kwargs) if rank == 0 else None
            result, error, report = None, None, None
            if rank == 0:
                try:
                    result = func(*args, **kwargs)
                except Exception as e:
                    error = e
                    report = (type(e).__qualname__, str(e), "".join(traceback.format_exception(e)))
            verdict = all_gather_object(report)[0]
            if error is not None:
                raise error
            if verdict is not None:
                raise RankZeroError(
                    f"rank 0 raised {verdict[0]}: {verdict[1]} (in {func.__qualname__}); rank "
                    f"{rank} stops too rather than wait for it. Rank 0's traceback has the cause",
                    *verdict,
                )
            return result

        return wrapper

    return decorate if fn is None else decorate(fn)


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Run the body on rank 0 first, then on the other ranks (build a cache, then read it).

    All ranks must enter it, or it deadlocks. If rank 0's body raises, the other
    ranks are still released.

    Example:
        >>> with rank_zero_first():
        ...     dataset = build_or_open_cache(path)
    """
    if get_rank() != 0:
        barrier()
    try:
        yield
    finally:
        if get_rank() == 0:
            barrier()


def capture_rng_state() -> dict[str, Any]:
    """Return the states of Python's, NumPy's, torch's and (in use) CUDA's global RNGs.

    The dict holds only tensors, numbers, strings and tuples, so it saves with
    :func:`save_checkpoint`. CUDA generators are captured once CUDA is
    initialised; before that they have no state of their own.

    Example:
        >>> state = capture_rng_state()
        >>> restore_rng_state(state)  # the next torch.rand() repeats
    """
    kind, keys, pos, has_gauss, cached = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    cuda_in_use = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return {
        "python": random.getstate(),
        # weights_only cannot read numpy arrays; int64 holds the uint32 key exactly.
        "numpy": (
            str(kind),
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda_in_use else [],
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the RNG states that :func:`capture_rng_state` returned.

    Args:
        state: its dict, possibly saved and loaded.

    Raises:
        ValueError: ``state`` lacks a part.

    Example:
        >>> restore_rng_state(load_checkpoint("run/latest.pth")["rng"][get_rank()])
    """
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(
            f"restore_rng_state: the state lacks {sorted(missing)}; pass capture_rng_state()'s dict"
        )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") and torch.cuda.is_available():
        # On machines with fewer GPUs than the saving ones, restore the generators that exist.
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)


def _link_or_copy(source: Path, target: Path) -> None:
    def link(tmp: Path) -> None:
        try:
            os.link(source, tmp)
        except OSError:  # a file system without hard links
            shutil.copyfile(source, tmp)

    _replace_atomic(target, link)


class CheckpointManager:
    """Save and resume one training run's checkpoints in ``directory``.

    The files, all loadable with ``torch.load(weights_only=True)``:

    - ``latest.pth``: the full state after the last saved epoch: ``format``,
      ``version``, ``epoch``, ``acc1``, ``loss``, ``lr``, ``model`` (unwrapped
      from DDP and torch.compile), ``optimizer``, ``scheduler``, ``scaler``,
      ``world_size``, ``rng`` (one state per rank), ``metrics``, ``extra``,
      ``best_acc1`` and ``best_epoch``.
    - ``previous.pth``: the full state saved before that. Each save renames
      ``latest.pth`` to it (unless :meth:`resume` found ``latest.pth`` damaged),
      so a damaged ``latest.pth`` costs an epoch, not the run.
    - ``{network}-epoch{N}-acc{acc1:.2f}.pth``: the model's weights alone, as
      classic training scripts write them: the last ``keep_last`` epochs, plus
      the best. Files of later epochs (left by an earlier run) are left alone.
    - ``best.pth``: the weights of the epoch with the highest ``metrics["acc1"]``,
      a hard link to that epoch's file where the file system allows, else a copy.

    :meth:`save` and :meth:`resume` are collectives: all ranks must call them,
    or they deadlock. Rank 0 writes; every rank reads in :meth:`resume`, so
    ``directory`` must be on a file system all nodes share (resume checks that
    the ranks found the same checkpoint). With plain DDP every rank holds the
    same model and optimizer state; sharded optimizers are not supported.

    Args:
        directory: where the files go; created by the first save.
        network: the prefix of the per-epoch weight files.
        keep_last: how many per-epoch weight files to keep, at least 1.

    Attributes:
        best_acc1: the best ``acc1`` saved so far (restored by :meth:`resume`), or None.
        latest_path: ``directory / "latest.pth"``.

    Example:
        >>> manager = CheckpointManager("runs/exp1", network="seresnext50", keep_last=3)
        >>> start = manager.resume(model, optimizer, scheduler)
        >>> for epoch in range(start, epochs):
        ...     train_one_epoch(...)
        ...     manager.save(epoch, model, optimizer, scheduler, metrics=evaluate(model, val))
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, network: str = "model", keep_last: int = 3
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        if not network or "/" in network or os.sep in network:
            raise ValueError(f"network must be a file name prefix without '/', got {network!r}")
        self.directory = Path(directory)
        self.network, self.keep_last = network, keep_last
        self.latest_path = self.directory / "latest.pth"
        self._previous_path = self.directory / "previous.pth"
        self.best_acc1: float | None = None
        self._best_epoch: int | None = None
        self._latest_damaged = False
        self._epoch_file = re.compile(rf"{re.escape(network)}-epoch(\d+)-acc.*\.pth")

    def save(
        self,
        epoch: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        metrics: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Path | None:
        """Save the state after ``epoch``. All ranks must call this, or it deadlocks.

        Every rank sends its RNG state to rank 0, which writes the files. Pass
        the same ``metrics`` on every rank (``ddpkit.evaluate``'s are): each
        rank tracks the best accuracy from them.

        Args:
            epoch: the epoch just finished.
            model: the model, wrapped or not.
            optimizer: its optimizer.
            scheduler: an LR scheduler, or None.
            scaler: a ``torch.amp.GradScaler``, or None.
            metrics: ``acc1`` names the weight file (0 without it) and picks
                ``best.pth``; ``loss`` and the rest are stored.
            extra: anything else to store, weights_only-loadable.

        Returns:
            The path of ``latest.pth`` on rank 0, None on the other ranks.

        Raises:
            TypeError: (rank 0) ``metrics`` or ``extra`` hold something that
                cannot be loaded back; nothing is written.
            OSError: (rank 0) writing failed.
            RankZeroError: (other ranks) rank 0 failed.
        """
        rng = all_gather_object(capture_rng_state())
        metrics = dict(metrics or {})
        acc1 = float(metrics["acc1"]) if "acc1" in metrics else None
        improved = (
            acc1 is not None
            and not math.isnan(acc1)
            and (self.best_acc1 is None or acc1 > self.best_acc1)
        )
        best = (acc1, epoch) if improved else (self.best_acc1, self._best_epoch)
        weights = unwrap_model(model).state_dict()
        state = {
            "format": _FORMAT,
            "version": _VERSION,
            "epoch": epoch,
            "acc1": acc1,
            "loss": float(metrics["loss"]) if "loss" in metrics else None,
            "lr": float(optimizer.param_groups[0]["lr"]),
            "model": weights,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "world_size": get_world_size(),
            "rng": rng,
            "metrics": metrics,
            "extra": dict(extra or {}),
            "best_acc1": best[0],
            "best_epoch": best[1],
        }
        name = f"{self.network}-epoch{epoch}-acc{acc1 or 0.0:.2f}.pth"
        written = rank0_only(sync=True)(self._write)(state, weights, name, improved)
        self.best_acc1, self._best_epoch = best  # only once the files are written
        return written

    def _write(self, state: dict[str, Any], weights: Any, name: str, improved: bool) -> Path:
        clean = _sanitize(state, "", set())  # refuse bad metrics or extra before touching a file
        self.directory.mkdir(parents=True, exist_ok=True)
        epoch_path = self.directory / name
        save_checkpoint(weights, epoch_path)
        if improved:
            _link_or_copy(epoch_path, self.directory / "best.pth")
        # latest.pth comes last, so the files it refers to exist whenever it does.
        if self.latest_path.exists() and not self._latest_damaged:
            os.replace(self.latest_path, self._previous_path)
        _replace_atomic(self.latest_path, functools.partial(_write_file, clean))
        self._latest_damaged = False
        self._prune(state["epoch"], name, state["best_epoch"])
        logger.info("saved epoch %d: %s and %s", state["epoch"], self.latest_path, epoch_path)
        return self.latest_path

    def _prune(self, epoch: int, current: str, best_epoch: int | None) -> None:
        found = []
        for path in self.directory.iterdir():
            match = self._epoch_file.fullmatch(path.name)
            if match and int(match.group(1)) <= epoch:
                found.append((int(match.group(1)), path))
        keep = sorted({n for n, _ in found if n < epoch}, reverse=True)[: self.keep_last - 1]
        for number, path in found:
            # Another file of this epoch comes from a run that resumed before it.
            old = number != epoch and number not in keep and number != best_epoch
            if old or (number == epoch and path.name != current):
                path.unlink(missing_ok=True)

    def resume(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        map_location: _MapLocation = "cpu",
        strict_rng: bool = True,
    ) -> int:
        """Restore the newest loadable full checkpoint; return the epoch to start from.

        Tries ``latest.pth``, then (with a warning if ``latest.pth`` is damaged)
        ``previous.pth``. Restores the model (unwrapped), those of optimizer,
        scheduler and scaler that are given, this rank's RNG state and
        :attr:`best_acc1`. All ranks must call this, or it deadlocks.

        Args:
            model: the model, wrapped or not.
            optimizer: its optimizer, or None.
            scheduler: an LR scheduler, or None.
            scaler: a ``torch.amp.GradScaler``, or None.
            map_location: where loaded tensors go first.
            strict_rng: refuse a checkpoint saved by a different number of ranks,
                whose RNG states cannot be matched to these; with False, resume
                without restoring RNG state, with a warning.

        Returns:
            The saved epoch + 1, or 0 when there is no checkpoint.

        Raises:
            CheckpointError: no checkpoint file is loadable, a rank failed to
                load, the ranks found different checkpoints, a part asked for
                is missing, or the world size changed and ``strict_rng`` is True.

        Example:
            >>> start_epoch = manager.resume(model, optimizer, scheduler, scaler)
        """
        state, path, found, error = None, self.latest_path, None, None
        try:
            state, path = self._load_newest(map_location)
            found = (path.name, int(state["epoch"])) if state is not None else None
        except Exception as e:  # reported to every rank below, instead of leaving them waiting
            error = e
        reports = all_gather_object((found, f"{type(error).__name__}: {error}" if error else ""))
        if error is not None:
            raise error
        failed = [f"rank {r} ({p})" for r, (_, p) in enumerate(reports) if p]
        if failed:
            raise CheckpointError("resume failed on " + "; ".join(failed))
        if len({f for f, _ in reports}) > 1:
            views = ", ".join(
                f"rank {r}: {f'{f[0]} of epoch {f[1]}' if f else 'nothing'}"
                for r, (f, _) in enumerate(reports)
            )
            raise CheckpointError(
                f"the ranks found different checkpoints in {self.directory} ({views}); "
                "put the directory on a file system that every node shares"
            )
        if state is None:
            return 0
        self._restore(state, path, model, (optimizer, scheduler, scaler), strict_rng)
        return int(state["epoch"]) + 1

    def _load_newest(self, map_location: _MapLocation) -> tuple[dict[str, Any] | None, Path]:
        self._latest_damaged = False
        for path in (self.latest_path, self._previous_path):
            try:
                state = load_checkpoint(path, map_location)
            except FileNotFoundError:
                continue
            except CheckpointError as e:
                warnings.warn(f"{e}; trying an older checkpoint", RuntimeWarning, stacklevel=3)
                self._latest_damaged |= path == self.latest_path
                continue
            if state.get("format") != _FORMAT or state.get("version", 0) > _VERSION:
                raise CheckpointError(
                    f"{path} is not a ddpkit checkpoint of version <= {_VERSION} (format "
                    f"{state.get('format')!r}, version {state.get('version')!r})"
                )
            return state, path
        if self._latest_damaged:
            raise CheckpointError(
                f"no checkpoint in {self.directory} is loadable; see the warnings"
            )
        return None, self.latest_path

    def _restore(
        self,
        state: dict[str, Any],
        path: Path,
        model: nn.Module,
        parts: tuple[Any, ...],
        strict_rng: bool,
    ) -> None:
        names = ("optimizer", "scheduler", "scaler")
        for name, obj in zip(names, parts, strict=True):
            if obj is not None and state.get(name) is None:
                raise CheckpointError(f"{path} holds no {name} state; pass {name}=None to resume")
        saved, now = int(state["world_size"]), get_world_size()
        if saved != now:
            message = f"{path} holds RNG states for {saved} ranks and this job has {now}"
            if strict_rng:
                raise CheckpointError(f"{message}; pass strict_rng=False to resume without them")
            warnings.warn(
                f"{message}; resuming without restoring RNG state", RuntimeWarning, stacklevel=3
            )
        unwrap_model(model).load_state_dict(state["model"])
        for name, obj in zip(names, parts, strict=True):
            if obj is not None:
                obj.load_state_dict(state[name])
        if saved == now:
            restore_rng_state(state["rng"][get_rank()])
        self.best_acc1, self._best_epoch = state.get("best_acc1"), state.get("best_epoch")
