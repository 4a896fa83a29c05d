"""``LazyLMDBDataset``: a map-style dataset over ddpkit LMDB databases, safe in any worker.

The index (labels, class names) is read once in ``__init__`` with a
short-lived environment, so ``len()`` and ``.targets`` come from the file.
The environment that serves images opens lazily, once per process, on the
first item a process reads: after ``fork`` a DataLoader worker closes its
inherited copy and opens its own; under ``spawn``/``forkserver`` the dataset
is pickled without it. Read-only and lock-free, so any number of ranks and
workers can read one database at once.
"""

from __future__ import annotations

import bisect
import mmap
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lmdb
import numpy as np
from torch.utils.data import Dataset

from ddpkit.data import gpu_decode
from ddpkit.data.images import decode_pil, decode_tensor_known, pixel_limit
from ddpkit.data.lmdb_format import (
    EnvHandle,
    Identity,
    data_file,
    identity,
    read_index,
    shared_handle,
)
from ddpkit.data.lmdb_index import LEGACY_KEYS, LMDBFormatError, sample_key

__all__ = ["Decode", "LazyLMDBDataset"]

Decode = Literal["tensor", "pil", "bytes", "cuda"]
_DECODES = ("tensor", "pil", "bytes", "cuda")
PathLike = str | os.PathLike[str]
# How long a look at a database's file (a stat: was it replaced?) is trusted. Right
# after a decode a stat costs about 3 % of a photo's read; once per 10 ms, nothing.
_RECHECK_SECONDS = 0.01


class LazyLMDBDataset(Dataset[tuple[Any, Any]]):
    """Images and labels from one or more ddpkit LMDB databases (shards, concatenated).

    Args:
        path: a database, or a list of them read as one dataset in order
            (all must have the same classes).
        transform: applied to the decoded image.
        target_transform: applied to the integer label.
        decode: ``"tensor"``: a uint8 ``CxHxW`` RGB tensor
            (TorchCodec's decoders for JPEG and WebP, Pillow for the rest:
            :func:`ddpkit.data.images.decode_tensor`; grayscale, CMYK and
            alpha are converted); ``"pil"``: an RGB ``PIL.Image``; ``"bytes"``: the
            stored bytes; ``"cuda"``: decoded on the GPU, a batch at a time, in
            the training process (``ddpkit.data.gpu_decode``): the workers hand
            over each JPEG's bytes and the crop box ``transform`` (ddpkit's
            ``train_transform`` or ``val_transform``, without presets) drew
            from the same random numbers as for ``"tensor"``; other formats
            are decoded on the CPU by the worker, counted. Needs CUDA.
        readahead: let the OS read ahead in the file. Off by default: random
            access over a dataset larger than RAM only wastes I/O with it.
        max_pixels: the most pixels a stored image may have, checked from its
            header before decoding (default: Pillow's limit,
            :func:`ddpkit.data.images.pixel_limit`); a larger one is an
            ``LMDBFormatError`` naming its size, not a tensor of many GB.

    Raises:
        FileNotFoundError: a path does not exist.
        LMDBFormatError: a path is not a ddpkit LMDB (the message says how to
            convert a folder2lmdb database) or the shards' classes differ.
        ValueError: an unknown ``decode``, ``max_pixels`` below 1, or
            ``decode="cuda"`` without CUDA or with another transform.

    Example:
        >>> train = LazyLMDBDataset("data/train.lmdb", train_transform(224))
        >>> len(train), train.classes[:3]
    """

    def __init__(
        self,
        path: PathLike | Sequence[PathLike],
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        *,
        decode: Decode = "tensor",
        readahead: bool = False,
        max_pixels: int | None = None,
    ) -> None:
        if decode not in _DECODES:
            raise ValueError(f"decode must be one of {_DECODES}, got {decode!r}")
        pixel_limit(max_pixels)  # refuses a bad value now, not in a worker later
        if decode == "cuda":
            gpu_decode.require_cuda()
            _check_gpu_transform(transform)
        self.max_pixels = max_pixels
        paths = [path] if isinstance(path, str | os.PathLike) else list(path)
        if not paths:
            raise ValueError("LazyLMDBDataset needs at least one database path")
        self.paths = tuple(os.fspath(p) for p in paths)
        self.transform = transform
        self.target_transform = target_transform
        self.decode = decode
        self.readahead = readahead
        self._targets: list[int] | None = None
        # Which files the index was read from: a file replaced later is refused, not mixed in.
        self._real_paths = [os.path.realpath(p) for p in self.paths]
        self._data_files = [data_file(p) for p in self.paths]
        self._identities: list[Identity | None] = [None] * len(self.paths)
        self._held: list[EnvHandle | None] = [None] * len(self.paths)
        before = [_identity_or_none(p) for p in self.paths]
        self._load_index()
        self._identities = [identity(p) for p in self.paths]
        if before != self._identities:  # replaced while its index was read: which one is unknown
            raise LMDBFormatError(
                f"{self.paths[0] if len(self.paths) == 1 else list(self.paths)} was replaced "
                "while its index was read (a build with --overwrite finishing?); create the "
                "dataset again"
            )
        self._held = [None] * len(self.paths)  # the first read checks the file it now expects
        self._known = _facts(len(self))

    def _load_index(self) -> None:
        indexes = [read_index(p) for p in self.paths]
        first = indexes[0].classes
        for p, ix in zip(self.paths[1:], indexes[1:], strict=True):
            if ix.classes != first:
                raise LMDBFormatError(
                    f"shards disagree on the classes: {self.paths[0]} has {len(first)} "
                    f"({_preview(first)}), {p} has {len(ix.classes)} ({_preview(ix.classes)}). "
                    "Build every shard with the same class list."
                )
        self.classes: list[str] = list(first)
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self._labels = np.concatenate([ix.labels for ix in indexes]).astype(np.int64)
        self._labels.flags.writeable = False
        self._label_of = self._labels.data  # a memoryview: a Python int per read, no NumPy scalar
        self._starts = [0]
        for ix in indexes:
            self._starts.append(self._starts[-1] + len(ix))

    # -- what torchvision's ImageFolder offers -------------------------------------------

    def __len__(self) -> int:
        return len(self._labels)

    @property
    def labels(self) -> np.ndarray:
        """The label of every sample as a read-only ``int64`` array (cheap for millions)."""
        return self._labels

    @property
    def targets(self) -> list[int]:
        """The label of every sample as a list, as ``ImageFolder.targets``."""
        if self._targets is None:
            self._targets = self._labels.tolist()
        return self._targets

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        n = self._starts[-1]
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for {n} samples")
        index %= n
        raw, label = self._record(index)
        if self.decode == "tensor":  # the default, without a call more (see decode_tensor)
            known = self._known[index]
            try:
                image, found = decode_tensor_known(raw, known, max_pixels=self.max_pixels)
            except Exception as exc:
                raise self._undecodable(index, exc) from exc
            if found != known:
                self._known[index] = found
        else:
            image = self._decode(raw, index)
        if self.transform is not None:
            image = self.transform(image)
        target: Any = label if self.target_transform is None else self.target_transform(label)
        return image, target

    def __getstate__(self) -> dict[str, Any]:
        # LMDB environments live in lmdb_format's per-process table; a pickled copy
        # (a spawned worker) asks there for its own.
        state = self.__dict__.copy()
        state["_targets"] = None
        state["_held"] = [None] * len(self.paths)
        state.pop("_label_of", None)
        state.pop("_known", None)  # memory shared with forked children, not with a pickle
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "_labels" in state:
            self._label_of = self._labels.data
        self._known = _facts(len(self))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self)} samples, {len(self.classes)} classes, "
            f"decode={self.decode!r}, shards={list(self.paths)})"
        )

    # -- reading -------------------------------------------------------------------------

    def _env(self, shard: int) -> lmdb.Environment:
        # This process's environment for the file, opened lazily on its first read
        # (also the first read after a fork); a stat at most every 10 ms notices a
        # replaced file. Held here between those looks: asking lmdb_format's table
        # each read costs about 1 % of a photo's.
        held = self._held[shard]
        if held is None or not held.usable(_RECHECK_SECONDS):
            held = self._held[shard] = shared_handle(
                self.paths[shard],
                readahead=self.readahead,
                key=self._real_paths[shard],
                expect=self._identities[shard],
                data=self._data_files[shard],
                recheck=_RECHECK_SECONDS,
            )
        return held.env

    def _locate(self, index: int) -> tuple[int, int]:
        if len(self._starts) == 2:  # one database: no search
            return 0, index
        shard = bisect.bisect_right(self._starts, index) - 1
        return shard, index - self._starts[shard]

    def _record(self, index: int) -> tuple[bytearray, int]:
        shard, local = self._locate(index)
        with self._env(shard).begin(buffers=True) as txn:
            try:
                buf = txn.get(sample_key(local))
            except lmdb.Error as exc:  # MDB_CORRUPTED, MDB_PAGE_NOTFOUND ...: a damaged file
                raise LMDBFormatError(
                    f"{self.paths[shard]}: record {local} (sample {index}) cannot be read "
                    f"({exc}); the database is damaged: `ddpkit lmdb verify "
                    f"{self.paths[shard]}` lists every bad record; copy it again or rebuild it"
                ) from exc
            if buf is None:
                raise LMDBFormatError(
                    f"{self.paths[shard]}: record {local} (sample {index}) is missing; "
                    "the database is damaged: check it with `ddpkit lmdb verify` and rebuild"
                )
            # Copy out of the memory map before the transaction ends; bytearray is
            # writable, so torch can wrap it without another copy. (Decoded in the map,
            # the record would be read for a whole decode, while another thread that
            # finds the file replaced may close the environment and unmap it.)
            return bytearray(buf), self._label_of[index]

    def _decode(self, raw: bytearray, index: int) -> Any:
        if self.decode == "bytes":
            return bytes(raw)
        try:
            if self.decode == "cuda":
                shard, local = self._locate(index)
                where = f"sample {index} (record {local} of {self.paths[shard]})"
                return gpu_decode.encode(raw, max_pixels=self.max_pixels, where=where)
            return decode_pil(raw, max_pixels=self.max_pixels)  # "tensor" is __getitem__'s
        except Exception as exc:
            raise self._undecodable(index, exc) from exc

    def _undecodable(self, index: int, exc: Exception) -> LMDBFormatError:
        shard, local = self._locate(index)
        return LMDBFormatError(
            f"sample {index} (record {local} of {self.paths[shard]}"
            f"{self._built_from(shard, local)}) does not decode as an image: "
            f"{type(exc).__name__}: {exc}. `ddpkit lmdb verify {self.paths[shard]}` lists "
            "every bad record."
        )

    def _built_from(self, shard: int, local: int) -> str:
        """``", built from <path>"`` for an error message, when the index keeps paths."""
        try:  # read on this error only: a path per sample costs memory the dataset never keeps
            name = read_index(self.paths[shard], columns=("path",)).columns["path"][local]
        except Exception:
            return ""
        return f", built from {name}" if name else ""

    # -- the old pickled layout ----------------------------------------------------------

    @classmethod
    def from_legacy(
        cls,
        path: PathLike,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        *,
        allow_pickle: bool = False,
        decode: Decode = "pil",
        readahead: bool = False,
    ) -> LazyLMDBDataset:
        """Read a folder2lmdb-style database: pickled ``(image_bytes, label)`` values.

        **Unsafe for files you did not make yourself**: unpickling a record can
        run arbitrary code, so this needs ``allow_pickle=True``. Rebuilding the
        database with ``ddpkit lmdb build`` gives the safe, faster format.
        Databases written with ``pyarrow.serialize`` cannot be read at all:
        pyarrow removed that format (deprecated in 2.0, gone in 12.0).

        Raises:
            ValueError: ``allow_pickle`` is not True.
            LMDBFormatError: not the folder2lmdb layout, or a pyarrow-serialized one.
        """
        if allow_pickle is not True:
            raise ValueError(
                "from_legacy() unpickles every record, and unpickling can run arbitrary code: "
                "pass allow_pickle=True only for a database you made yourself, or rebuild it "
                "with `ddpkit lmdb build` (no pickle)"
            )
        return _LegacyLMDBDataset(
            path, transform, target_transform, decode=decode, readahead=readahead
        )


class _LegacyLMDBDataset(LazyLMDBDataset):
    """The pickled folder2lmdb layout: ``__keys__`` and ``__len__`` records, tuple values."""

    def _load_index(self) -> None:
        # The old layout has no index: the keys come from its pickled __keys__ record.
        with self._env(0).begin() as txn:
            raw_keys, raw_len = (txn.get(k) for k in LEGACY_KEYS)
        if raw_keys is None or raw_len is None:
            raise LMDBFormatError(
                f"{self.paths[0]}: no __keys__/__len__ records, so not a folder2lmdb database"
            )
        self._keys: list[bytes] = list(_legacy_loads(raw_keys, self.paths[0]))
        self._starts = [0, len(self._keys)]
        self._legacy_labels: np.ndarray | None = None
        self.classes, self.class_to_idx = [], {}

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def labels(self) -> np.ndarray:
        """Every label; the old layout keeps them in the records, so this reads them all once."""
        if self._legacy_labels is None:
            self._legacy_labels = np.array(
                [self._record(i)[1] for i in range(len(self))], dtype=np.int64
            )
        return self._legacy_labels

    @property
    def targets(self) -> list[int]:
        return list(self.labels.tolist())

    def _record(self, index: int) -> tuple[bytearray, int]:
        with self._env(0).begin() as txn:
            value = txn.get(self._keys[index])
        if value is None:
            raise LMDBFormatError(f"{self.paths[0]}: key {self._keys[index]!r} is missing")
        image, label = _legacy_loads(value, self.paths[0])[:2]
        return bytearray(image), int(label)


def _legacy_loads(value: bytes, path: str) -> Any:
    # Any protocol: the caller allowed pickles (allow_pickle=True), and protocol 0
    # and 1 pickles start without the 0x80 of later ones.
    try:
        return pickle.loads(value)
    except Exception as exc:
        if value.startswith(b"\xff\xff\xff\xff"):  # an Arrow IPC message
            raise LMDBFormatError(
                f"{path}: the records are Arrow data, not pickles: pyarrow.serialize output, a "
                "format pyarrow removed (deprecated in 2.0, gone in 12.0), so no current library "
                "reads it. Rebuild the database from the images with `ddpkit lmdb build`; if "
                "only the database is left, export the images once in an environment with "
                "pyarrow<12 and build from them."
            ) from exc
        raise LMDBFormatError(
            f"{path}: a record is not a readable pickle ({type(exc).__name__}: {exc}): the "
            "database is damaged, or not a folder2lmdb one. Rebuild it with `ddpkit lmdb build`."
        ) from exc


def _facts(samples: int) -> memoryview | _Forgetful:
    """Per sample, what its first decode found that later ones need not find again
    (:func:`~ddpkit.data.images.decode_tensor_known`; 0: nothing yet), as uint32.

    Anonymous shared memory: DataLoader workers forked from this process (the
    default on Linux) and their successors each epoch fill and read one table,
    so each record is examined once per run, whichever worker reads it. Pages
    are taken as they are written, 4 bytes a sample at most, and count against
    no /dev/shm limit. A pickled dataset (``spawn``, ``forkserver``) starts a
    table of its own.
    """
    try:
        return memoryview(mmap.mmap(-1, 4 * max(samples, 1))).cast("I")
    except OSError:  # refused (a strict overcommit limit): every read is a first read
        return _Forgetful()


class _Forgetful:
    """A table of what first reads found that keeps nothing."""

    def __getitem__(self, index: int) -> int:
        return 0

    def __setitem__(self, index: int, value: int) -> None:
        pass


def _identity_or_none(path: str) -> Identity | None:
    try:
        return identity(path)
    except OSError:  # missing: read_index says so, with the fix
        return None


def _preview(classes: Sequence[str]) -> str:
    shown = ", ".join(classes[:4])
    return shown + (", ..." if len(classes) > 4 else "")


def _check_gpu_transform(transform: Any) -> None:
    """``decode="cuda"`` plans its crop in the worker: only ddpkit's crops know how."""
    from ddpkit.data.transforms import planned_on_gpu

    if not planned_on_gpu(transform):
        raise ValueError(
            f"decode='cuda' takes ddpkit.train_transform(size) or ddpkit.val_transform(size) "
            f"(without auto_augment or random_erase), whose crop the GPU takes after decoding; "
            f"got {transform!r}. Use decode='tensor' for another transform"
        )
