"""Safe checkpoint files: written atomically, loaded with ``weights_only=True``.

Nothing ddpkit reads executes code: every file is read with ``weights_only=True``,
so :func:`save_checkpoint` refuses, before writing a byte, anything such a load
could not read back (numpy arrays, custom objects, functions ...) and names where
it sits (``"optimizer.state.3.momentum_buffer"``). Files are written under a
temporary name in the same directory, fsynced, then renamed over the old one:
a crash or a kill leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
import shutil
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ddpkit._docs import see
from ddpkit.files import is_no_space, is_quota, no_space, remove_stale, temp_path

__all__ = [
    "CheckpointError",
    "check_records",
    "check_saveable",
    "link_or_copy",
    "load_checkpoint",
    "payload_bytes",
    "replace_atomic",
    "save_checkpoint",
    "write_file",
]

# Exact types, not subclasses: a subclass (an IntEnum, a namedtuple, a defaultdict)
# pickles as its own class, which the weights_only unpickler refuses (torch 2.14).
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None))
_TORCH_LEAVES = (torch.Tensor, nn.Parameter, torch.Size, torch.dtype, torch.device, torch.layout)
_CONTAINERS = (dict, OrderedDict, Counter, list, tuple, set)
_NUMPY_SCALARS = ((np.bool_, bool), (np.integer, int), (np.floating, float))
MapLocation = str | torch.device | None


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: damaged, unsafe to load, or saved for another job."""


def check_saveable(obj: Any) -> Any:
    """Return ``obj`` as :func:`save_checkpoint` would store it, or raise ``TypeError``.

    NumPy scalars become Python numbers (in a copy; ``obj`` is unchanged);
    anything ``torch.load(weights_only=True)`` could not read back is refused,
    its key path named.
    """
    return _sanitize(obj, "", set())


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


def replace_atomic(path: Path, write: Callable[[Path], None], needed: int | None = None) -> None:
    """Have ``write`` fill a temporary file beside ``path``, then rename it over ``path``.

    A crash at any moment leaves the old file or the new one; the temporary
    file is removed when ``write`` fails, and the rename is made durable.
    Temporary files that killed writers of ``path`` left behind on this host
    are removed once the new file is in place. A full disk is an ``OSError``
    (``ENOSPC``) that says how much room was ``needed`` and how much is free.
    """
    tmp = temp_path(path, hidden=True)
    try:
        write(tmp)
        os.replace(tmp, path)
        # rename() between two links of one file does nothing and leaves both names.
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, Exception) and _out_of_space(exc, path.parent, needed):
            raise no_space(path, needed, quota=is_quota(exc)) from exc
        raise
    # Make the rename itself durable; some platforms and file systems cannot.
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    remove_stale(path, hidden=True)


def _out_of_space(exc: Exception, directory: Path, needed: int | None) -> bool:
    if is_no_space(exc):
        return True
    # torch.save reports a short write as "unexpected pos" or "file write failed",
    # without the errno: a full disk only if there is less room than the file needs.
    text = str(exc).lower()
    if needed is None or not ("unexpected pos" in text or "write failed" in text):
        return False
    try:
        return shutil.disk_usage(directory).free < needed
    except OSError:
        return False


def payload_bytes(obj: Any) -> int:
    """Roughly what ``torch.save(obj)`` writes: each storage's bytes once, plus a little."""
    storages: dict[tuple[str, int], int] = {}
    overhead = _collect_storages(obj, storages)
    return sum(storages.values()) + overhead


def _collect_storages(obj: Any, storages: dict[tuple[str, int], int]) -> int:
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()  # views and tied weights share one: saved once
        storages[(str(storage.device), storage.data_ptr())] = storage.nbytes()
        return 0
    if isinstance(obj, dict):
        return sum(_collect_storages(v, storages) for v in obj.values()) + 64
    if isinstance(obj, list | tuple | set):
        return sum(_collect_storages(v, storages) for v in obj) + 64
    return 64


def write_file(obj: Any, tmp: Path) -> None:
    """``torch.save`` into the new file ``tmp``, then fsync it: a writer for ``replace_atomic``."""
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
    data goes to ``.{name}.tmp-{host}-{pid}-{random}`` next to ``path``, is
    fsynced, and is renamed over ``path``; such files that killed saves left
    behind are removed then.

    Args:
        obj: a mapping, usually of state dicts.
        path: the file to write; its directory must exist.

    Raises:
        TypeError: something in ``obj`` cannot be loaded back; the message names
            its key path and type. Nothing is written.
        FileNotFoundError: the directory of ``path`` does not exist.
        NotADirectoryError: the parent of ``path`` is not a directory.
        OSError: writing failed; ``path`` is as it was. A full disk is
            ``ENOSPC`` with the room needed and free in the message.

    Example:
        >>> save_checkpoint({"model": model.state_dict(), "epoch": 3}, "run/ckpt.pth")
    """
    if not isinstance(obj, Mapping):
        raise TypeError(f"save_checkpoint takes a mapping (dict), got {type(obj).__name__}")
    clean = check_saveable(obj if type(obj) in _CONTAINERS else dict(obj))
    target = Path(path)
    if not target.parent.is_dir():
        error, problem = (
            (NotADirectoryError, "is not a directory")
            if target.parent.exists()
            else (FileNotFoundError, "does not exist; create it first")
        )
        raise error(f"save_checkpoint: {target.parent}, the directory of {target}, {problem}")
    replace_atomic(target, functools.partial(write_file, clean), payload_bytes(clean))


def load_checkpoint(
    path: str | os.PathLike[str], map_location: MapLocation = "cpu"
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
        check_records(path)
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
            "then save its state dicts with ddpkit.save_checkpoint. " + see("checkpoints")
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


def check_records(path: str | os.PathLike[str]) -> None:
    """Check every record's CRC: torch stores them in the zip but does not check them on load.

    A bit-rotted tensor would otherwise load silently, with wrong numbers.
    """
    if not zipfile.is_zipfile(path):
        return  # torch's legacy format, or not a zip at all: torch.load says which
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except Exception as exc:  # BadZipFile, zlib.error, EOFError, OSError ...: all damage
        raise _damaged(path, exc) from exc
    if bad is not None:
        raise CheckpointError(
            f"{path} is damaged: record {bad!r} fails its CRC check (bit rot, or a bad copy), "
            "so its numbers cannot be trusted; use an older checkpoint. " + see("checkpoints")
        )


def _damaged(path: object, error: BaseException) -> CheckpointError:
    text = str(error).strip()
    # torch's own message suggests weights_only=False: never pass that on.
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].strip()
    elif "weights_only" in text:
        text = "its pickled data are unreadable"
    reason = (text.splitlines() or [type(error).__name__])[0][:200]
    return CheckpointError(
        f"{path} is damaged (truncated write? full disk? bit rot?) and cannot be loaded "
        f"({reason}); use an older checkpoint"
    )


class _Kept(Exception):
    pass


def link_or_copy(source: Path, target: Path, keep: Callable[[Path], bool] | None = None) -> None:
    """Make ``target`` the same file as ``source``: a hard link, else a copy (atomically).

    With ``keep``, ``target`` is left as it is when ``source`` is gone or
    ``keep`` refuses the new file (a fixed view of ``source`` at this instant).
    """

    def link(tmp: Path) -> None:
        try:
            try:
                os.link(source, tmp)
            except OSError:  # a file system without hard links (or no source: the copy says)
                shutil.copyfile(source, tmp)
        except FileNotFoundError:
            if keep is None:
                raise
            raise _Kept from None
        if keep is not None and not keep(tmp):
            raise _Kept

    with contextlib.suppress(_Kept):
        replace_atomic(target, link)
