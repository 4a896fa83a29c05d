"""Checkpoints on an object store (``s3://bucket/prefix``, any fsspec URL), committed by manifests.

The objects under the prefix have the names and contents of a local checkpoint
directory (``latest.pth``, ``previous.pth``, ``step-<n>.pth``, ``interrupted.pth``,
the weight files, ``best.pth``, ``metrics.jsonl``): a copy of the prefix is a
checkpoint directory. What the commit needs lies beside them, in ``manifests/``
and, for a moment, ``pending/``. One save, in the writer thread:

1. the new files are uploaded: a name the committed layout does not hold yet (a
   weight file, a new step file) under that name, one it holds (``latest.pth``)
   under ``pending/<name>``: nothing committed changes;
2. the manifest ``manifests/<seq>.json`` (every file's size and SHA-256, and
   the copies still to make) is put last, with a conditional put where the
   store has one (S3's ``If-None-Match``), so a second job writing to the
   prefix fails on its first commit: that is the commit;
3. the layout rolls forward: server-side copies (``latest.pth`` to
   ``previous.pth``, ``pending/latest.pth`` to ``latest.pth``, the weight file to
   ``best.pth``), then the deletes (``pending/``, what ``keep_last`` drops, the
   manifests of checkpoints no longer held).

A resume reads manifests alone, never a listing of half-written objects: it
finishes step 3 of the newest (a copy is skipped where its target already holds
the content, by the ``sha256`` each object carries) and downloads the newest
checkpoint whose bytes match their manifest; one that does not match gives way
to the previous complete checkpoint, with a warning naming both.

fsspec and s3fs do the transfers (multipart, their per-request retries); a whole
file whose upload was cut is retried here, with backoff, since they cannot
restart it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from ddpkit._docs import see
from ddpkit.checkpoint.files import (
    BEST,
    INTERRUPTED,
    LATEST,
    PREVIOUS,
    Found,
    averaged,
    checkpoint_name,
    describe_run,
    is_run_file,
    run_files,
    stale_steps,
    stale_weights,
    weight_name,
)
from ddpkit.checkpoint.serialization import CheckpointError, check_saveable, save_checkpoint
from ddpkit.files import remove_stale, temp_path

__all__ = ["CHECK_SECONDS", "MANIFESTS", "PENDING", "ObjectStore", "check_location", "is_url"]

logger = logging.getLogger("ddpkit")
_T = TypeVar("_T")

MANIFESTS, PENDING = "manifests", "pending"
SIDE_FILES = ("metrics.jsonl",)
"""Files of the local directory that travel with every commit (``fit``'s records)."""
CHECK_SECONDS = 30.0
"""A store that does not answer the first check within this long is reported unreachable."""
PAUSES = (0.5, 1.0, 2.0, 4.0, 8.0)
"""Seconds between the attempts of a transfer that failed: about 15 s, then the save fails."""
_FORMAT = "ddpkit-manifest"
_MANIFEST = re.compile(r"(\d{9})\.json")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_S3 = ("s3", "s3a")
_CHUNK = 8 << 20


def is_url(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` names a store (``s3://...``), not a local path (``file://`` is)."""
    text = os.fspath(directory)
    return isinstance(text, str) and bool(_URL.match(text)) and not text.startswith("file://")


class ObjectStore:
    """One run's prefix on an object store: the committed layout, saves, the resume's download.

    Credentials and the endpoint come the way the store's library takes them
    (for S3: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
    a profile); ``storage_options`` go to ``fsspec.url_to_fs`` as they are.

    Attributes:
        url: the prefix's URL, without a trailing ``/``.
        files: the committed layout, ``{name: {"size", "sha256", ...}}``; a
            checkpoint's entry also holds its header (``snapshot``, ``generation``,
            ``step``, ``kind``, ``epoch``, ``world_size``). Read by :meth:`claim`
            or :meth:`fetch`, then kept up to date by :meth:`save`.
        seq: the number of the last commit (0: none).

    Raises:
        ImportError: fsspec, or the store's own package (s3fs), is not installed.
        ValueError: the URL names no bucket.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        protocol = url.split("://", 1)[0].lower()
        try:
            import fsspec

            if protocol in _S3:
                import s3fs  # noqa: F401 - fsspec needs it for s3://, and says so less clearly
        except ImportError as exc:
            raise ImportError(
                f"checkpoints at {url} need fsspec and s3fs: pip install 'ddpkit[s3]' ({exc})"
            ) from None
        options = dict(storage_options or {})
        self.s3 = protocol in _S3
        if self.s3:
            # A client of its own: a cached one keeps the credentials and endpoint it was made with.
            options.setdefault("skip_instance_cache", True)
            # Each request's own retries stay few: the whole transfer is retried with backoff.
            options.setdefault(
                "config_kwargs",
                {
                    "connect_timeout": 10,
                    "read_timeout": 120,
                    "retries": {"max_attempts": 2, "mode": "standard"},
                },
            )
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        if self.s3:
            self.fs.retries = 2
        self.url, self.root = url.rstrip("/"), root.rstrip("/")
        if not self.root:
            raise ValueError(f"{url} names no bucket: pass s3://BUCKET/PREFIX")
        self.files: dict[str, dict[str, Any]] = {}
        self.seq = 0
        self._committed: dict[int, str] = {}  # each known manifest's checkpoint SHA-256
        self._present: set[str] = set()  # the run's names under the prefix, as last listed

    def where(self, name: str) -> str:
        """The URL of ``name`` under the prefix."""
        return f"{self.url}/{name}"

    @property
    def endpoint(self) -> str:
        """Where the store is: its endpoint URL, or the protocol's default service."""
        kwargs = getattr(self.fs, "client_kwargs", None) or {}
        given = getattr(self.fs, "endpoint_url", None) or kwargs.get("endpoint_url")
        return str(given or os.environ.get("AWS_ENDPOINT_URL") or "the default AWS S3 endpoint")

    # -- checks ---------------------------------------------------------------------------

    def check(self, seconds: float = CHECK_SECONDS) -> None:
        """Reach the store with these credentials and write there, or say why not in ``seconds``.

        Puts and deletes one empty object under ``manifests/``.

        Raises:
            CheckpointError: the bucket is missing, the credentials are refused,
                the endpoint does not answer (within ``seconds``), or writing fails;
                names the URL, the endpoint and the fix.
        """
        probe = self._key(f"{MANIFESTS}/.probe-{secrets.token_hex(6)}")
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                self.fs.pipe_file(probe, b"")
                self.fs.rm_file(probe)
            except BaseException as exc:  # reported by the caller's thread
                outcome.append(exc)

        # A daemon thread: a black-holed endpoint must not hold the check, nor the exit.
        thread = threading.Thread(target=run, name="ddpkit-store-check", daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            raise CheckpointError(
                f"{self.url}: the store at {self.endpoint} did not answer within {seconds:.0f} s. "
                "Check the endpoint (AWS_ENDPOINT_URL) and that this machine can reach it. "
                + see("the-object-store-cannot-be-reached")
            )
        if outcome:
            raise CheckpointError(self.explain(outcome[0])) from outcome[0]

    def explain(self, error: BaseException) -> str:
        """One message for a failed request: what is wrong with the store, and the fix."""
        text = f"{type(error).__name__}: {error}"
        bucket = self.root.split("/", 1)[0]
        if isinstance(error, FileNotFoundError) or "NoSuchBucket" in text:
            why = (
                f"the bucket {bucket!r} does not exist at {self.endpoint}; create it "
                f"(aws s3 mb s3://{bucket}) or fix the URL"
            )
        elif isinstance(error, PermissionError) or any(
            word in text for word in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")
        ):
            why = (
                f"{self.endpoint} refused these credentials for bucket {bucket!r} ({text}); set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to a key that may "
                "read and write it"
            )
        else:
            why = (
                f"cannot use the store at {self.endpoint} ({text}); check AWS_ENDPOINT_URL and "
                "the network"
            )
        return f"{self.url}: {why}. {see('the-object-store-cannot-be-reached')}"

    def claim(self, overwrite: bool, job: str | None = None) -> str | bool | None:
        """Check the store, then refuse or remove another run's files under the prefix.

        Returns:
            True, touching nothing, when the newest checkpoint there was saved by
            this same launcher ``job`` (the run continues); None when the prefix
            is free (or was cleared, ``overwrite``); else one line about the run
            found there, for the refusal.
        """
        self.check()
        names = self._run_names()
        if names and job is not None and self._newest_job() == job:
            return True
        if names and not overwrite:
            return self._describe(names)
        for name in names:
            self._retried(f"deleting {self.where(name)}", functools.partial(self._remove, name))
        if names:
            logger.warning(
                "overwrite: removed the previous run's %d objects from %s", len(names), self.url
            )
        self.files, self.seq, self._committed, self._present = {}, 0, {}, set()
        return None

    # -- a save ---------------------------------------------------------------------------

    def save(
        self,
        state: dict[str, Any],
        staging: Path,
        *,
        prefix: str,
        keep_last: int,
        keep_steps: int,
        best: bool,
        rotate: bool,
        sides: Mapping[str, bytes],
    ) -> str:
        """Upload a checkpoint's files, commit its manifest, roll the layout forward; its URL.

        ``staging`` is a local directory for the files on their way up; the
        arguments are :func:`~ddpkit.checkpoint.files.write_files`'s, and
        ``sides`` the side files' contents (``metrics.jsonl``).

        Raises:
            OSError: a transfer failed after its retries, or the local disk is full
                (nothing committed was changed); or, after the commit, a copy or a
                delete failed (the checkpoint is committed; a resume finishes its layout).
            CheckpointError: another job committed to the prefix meanwhile.
        """
        clean = check_saveable(state)
        staging.mkdir(parents=True, exist_ok=True)
        kind, position, generation = clean["kind"], clean["position"], clean["generation"]
        name = checkpoint_name(kind, position["step"])
        files, moves = dict(self.files), []

        def put(target: str, write: Callable[[Path], None]) -> dict[str, Any]:
            remove_stale(staging / target, hidden=True)
            tmp = temp_path(staging / target, hidden=True)
            try:
                write(tmp)
                entry: dict[str, Any] = {"size": tmp.stat().st_size, "sha256": _sha256(tmp)}
                # A name the store holds is replaced only after the next commit.
                held = target in self.files or target in self._present
                source = f"{PENDING}/{target}" if held else target
                self._upload(tmp, source, entry["sha256"])
            finally:
                tmp.unlink(missing_ok=True)
            if source != target:
                moves.append([source, target, entry["sha256"], entry["size"]])
            files[target] = entry
            return entry

        doomed: list[str] = []
        try:
            if kind == "epoch":
                epoch = clean["epoch"]
                weights_file = weight_name(prefix, epoch, clean["acc1"])
                weights = (
                    clean["model"] if clean.get("weights") != "ema" else averaged(clean["ema"])
                )
                entry = put(weights_file, lambda tmp: save_checkpoint(weights, tmp))
                if rotate and LATEST in self.files:
                    latest = self.files[LATEST]
                    moves.append([LATEST, PREVIOUS, latest["sha256"], latest["size"]])
                    files[PREVIOUS] = latest
                put(LATEST, lambda tmp: save_checkpoint(clean, tmp))
                if best:
                    moves.append([weights_file, BEST, entry["sha256"], entry["size"]])
                    files[BEST] = entry
                best_epoch = clean["best_epoch"]
                doomed += stale_weights(
                    files,
                    prefix,
                    keep_last,
                    epoch + 1,
                    weights_file,
                    None if best_epoch is None else best_epoch + 1,
                )
            else:
                put(name, lambda tmp: save_checkpoint(clean, tmp))
            files[name] |= {
                "snapshot": clean["snapshot"],
                "generation": generation,
                "step": position["step"],
                "kind": kind,
                "epoch": position["epoch"],
                "world_size": clean["world_size"],
                "job": clean.get("job"),
            }
            steps = {n: e.get("generation") for n, e in files.items() if n.startswith("step-")}
            doomed += stale_steps(steps, keep_steps, generation)
            held = files.get(INTERRUPTED)
            older = held is not None and (
                held.get("generation") != generation or held.get("step", 0) < position["step"]
            )
            if name != INTERRUPTED and older:
                doomed.append(INTERRUPTED)
            for side, data in sides.items():
                put(side, functools.partial(_write_bytes, data))
        except OSError as exc:
            raise OSError(f"{exc}; nothing committed was changed") from exc
        for gone in doomed:
            files.pop(gone, None)
        manifest: dict[str, Any] = {
            "format": _FORMAT,
            "version": 1,
            "seq": self.seq + 1,
            "checkpoint": name,
            "written": time.time(),
            "files": files,
            "moves": moves,
            "extra": _jsonable(clean.get("extra") or {}),
        }
        self._commit(manifest)
        self.files, self.seq = files, self.seq + 1
        self._committed[self.seq] = files[name]["sha256"]
        try:
            self.roll_forward(manifest, check=False)
            self._clean_up()
        except OSError as exc:
            raise OSError(
                f"{self.where(name)} is committed (manifest {self.seq}), but finishing the "
                f"layout failed: {exc}; a resume finishes it"
            ) from exc
        logger.info("committed %s (manifest %d)", self.where(name), self.seq)
        return self.where(name)

    def _commit(self, manifest: dict[str, Any]) -> None:
        base = f"{manifest['seq']:09d}.json"
        data = json.dumps(manifest, indent=1).encode()
        # Never overwritten: a second job writing to the prefix fails here, loudly.
        extra = {"IfNoneMatch": "*"} if self.s3 else {}
        key = self._key(f"{MANIFESTS}/{base}")
        try:
            self._retried(
                f"committing {self.where(MANIFESTS + '/' + base)}",
                lambda: self.fs.pipe_file(key, data, **extra),
            )
        except FileExistsError:
            raise CheckpointError(
                f"{self.where(MANIFESTS + '/' + base)} exists already: another job commits "
                f"checkpoints to {self.url} too. Give each run its own prefix. "
                + see("a-directory-holds-another-run")
            ) from None
        except OSError as exc:
            raise OSError(f"{exc}; nothing committed was changed") from exc

    def roll_forward(self, manifest: Mapping[str, Any], *, check: bool = True) -> None:
        """Make the copies a commit asked for that are not made yet (each at most once).

        ``check`` False: the save that committed it makes them all, knowing none is made.
        """
        for source, target, sha, size in manifest.get("moves", []):
            if not check:
                self._copy(source, target, sha, size)
                continue
            if self._content(target) == sha:
                continue
            if self._content(source) != sha:
                logger.warning(
                    "%s: %s does not hold what manifest %s committed and %s is gone: not used",
                    self.url,
                    target,
                    manifest.get("seq"),
                    source,
                )
                self.files.pop(target, None)
                continue
            self._copy(source, target, sha, size)

    def _copy(self, source: str, target: str, sha: str, size: int) -> None:
        """A server-side copy that keeps the object's ``sha256``.

        s3fs copies an object above its threshold in parts, which drops the
        source's metadata: there it is given again.
        """
        extra = {}
        if self.s3 and size > getattr(_s3fs_core(), "MANAGED_COPY_THRESHOLD", 0):
            extra = {"Metadata": {"sha256": sha}}
        self._retried(
            f"copying {self.where(source)} to {self.where(target)}",
            functools.partial(self.fs.copy, self._key(source), self._key(target), **extra),
        )

    def _clean_up(self) -> None:
        """Delete what the committed layout does not hold: old files, pending copies, manifests."""
        held = {entry["sha256"] for entry in self.files.values()}
        names = self._run_names()
        for name in names:
            if name.startswith(f"{MANIFESTS}/"):
                match = _MANIFEST.fullmatch(name.split("/", 1)[1])
                seq = int(match[1]) if match else None
                # Kept: the newest, those whose checkpoint the layout holds, and unknown ones.
                if seq is None or seq == self.seq or self._committed.get(seq, "") in held:
                    continue
                if seq not in self._committed:
                    continue
                del self._committed[seq]
            elif name in self.files:
                continue
            self._retried(f"deleting {self.where(name)}", functools.partial(self._remove, name))
        self._present = {n for n in names if n in self.files or "/" in n}

    # -- a resume -------------------------------------------------------------------------

    def fetch(self, local: Path, name: str | None = None) -> tuple[Found, Path] | None:
        """Read the committed layout; download the checkpoint to resume from into ``local``.

        The newest checkpoint whose bytes match their manifest (or ``name``, a
        file of the layout); the side files (``metrics.jsonl``) come down too.

        Returns:
            The checkpoint's header (its ``name`` where it was found) and the
            downloaded file, or None when the prefix holds no commit.

        Raises:
            CheckpointError: the store cannot be used, ``name`` is not a
                committed checkpoint, or no committed checkpoint matches its manifest.
        """
        self.check()
        manifests, failed = self.load_layout()
        if not manifests:
            if name is not None:
                raise CheckpointError(
                    f"{self.where(name)}: {self.url} holds no committed checkpoint"
                )
            return None
        local.mkdir(parents=True, exist_ok=True)
        for side in SIDE_FILES:
            if side in self.files:
                self._download_checked(side, local / side)
        entry = self.files.get(name or "")
        if name is not None and (entry is None or "kind" not in entry):
            held = sorted(n for n, e in self.files.items() if "kind" in e)
            raise CheckpointError(
                f"{self.where(name)} is not a committed checkpoint of {self.url}; those "
                f"committed: {', '.join(held) or 'none'}. " + see("checkpoints")
            )
        wanted = (
            [(name, entry)]
            if name is not None
            else [(m["checkpoint"], dict(m["files"][m["checkpoint"]])) for m in manifests]
        )
        for checkpoint, entry in wanted:
            assert entry is not None
            # Where the layout holds this content now: latest.pth's may have moved to previous.pth.
            places = [n for n, e in self.files.items() if e.get("sha256") == entry["sha256"]]
            rotated = [PREVIOUS] if entry.get("kind") == "epoch" else []  # a later save's rotation
            for place in dict.fromkeys([*places, checkpoint, *rotated]):
                target = temp_path(local / place, hidden=True)
                try:
                    size, sha = self._download(place, target)
                except FileNotFoundError:
                    failed.append(f"{self.where(place)} (missing)")
                    continue
                if (size, sha) == (entry["size"], entry["sha256"]):
                    if failed:
                        warnings.warn(
                            f"{'; '.join(failed)}: changed or damaged since its commit; resuming "
                            f"from the previous complete checkpoint, {self.where(place)}",
                            RuntimeWarning,
                            stacklevel=4,
                        )
                    return _found(place, entry), target
                target.unlink(missing_ok=True)
                failed.append(
                    f"{self.where(place)} (sha256 {sha[:12]}, {size} bytes; its manifest says "
                    f"{entry['sha256'][:12]}, {entry['size']} bytes)"
                )
                if place in (LATEST, INTERRUPTED) or place.startswith("step-"):
                    self.files.pop(place, None)  # damaged: never rotated, replaced by the next save
        raise CheckpointError(
            f"no committed checkpoint in {self.url} matches its manifest: {'; '.join(failed)}. "
            + see("checkpoints")
        )

    def load_layout(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Read the committed layout from the manifests and finish the newest's copies.

        Returns:
            The manifests, newest first, and one line about each that cannot be read.

        Raises:
            CheckpointError: manifests exist and none can be read.
        """
        listed = self._manifests()
        failed: list[str] = []
        manifests = []  # newest first; one that cannot be read is passed over, and said
        for _, base in listed:
            try:
                manifests.append(self._read(base))
            except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
                failed.append(f"{self.where(MANIFESTS + '/' + base)} ({exc})")
        self._present = set(self._run_names())
        if not manifests:
            self.files, self._committed = {}, {}
            self.seq = listed[0][0] if listed else 0
            if listed:
                raise CheckpointError(
                    f"no manifest of {self.url} can be read: {'; '.join(failed)}. "
                    + see("checkpoints")
                )
            return [], []
        newest = manifests[0]
        # The next commit's number follows every manifest there, read or not.
        self.files, self.seq = dict(newest["files"]), max(seq for seq, _ in listed)
        self._committed = {
            int(m["seq"]): str(m["files"][m["checkpoint"]]["sha256"]) for m in manifests
        }
        self.roll_forward(newest)
        return manifests, failed

    def newest(self) -> dict[str, Any] | None:
        """The newest manifest (its ``checkpoint`` and ``extra``), or None."""
        listed = self._manifests()
        return self._read(listed[0][1]) if listed else None

    # -- requests -------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _retried(self, what: str, op: Callable[[], _T]) -> _T:
        for attempt, pause in enumerate((*PAUSES, None)):
            try:
                return op()
            except (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError):
                raise  # the store's answer, not a failed request: another try says the same
            except Exception as exc:
                if pause is None:
                    raise OSError(
                        f"{what} failed {attempt + 1} times, the last: {type(exc).__name__}: {exc}"
                    ) from exc
                logger.warning(
                    "%s failed (%s: %s); retrying in %.1f s", what, type(exc).__name__, exc, pause
                )
                time.sleep(pause)
        raise AssertionError("unreachable")

    def _upload(self, local: Path, name: str, sha: str) -> None:
        extra = {"Metadata": {"sha256": sha}} if self.s3 else {}
        self._retried(
            f"uploading {self.where(name)}",
            lambda: self.fs.put_file(str(local), self._key(name), **extra),
        )

    def _download(self, name: str, target: Path) -> tuple[int, str]:
        def get() -> tuple[int, str]:
            self.fs.get_file(self._key(name), str(target))
            return target.stat().st_size, _sha256(target)

        return self._retried(f"downloading {self.where(name)}", get)

    def _download_checked(self, name: str, target: Path) -> None:
        tmp = temp_path(target, hidden=True)
        try:
            _, sha = self._download(name, tmp)
            if sha == self.files[name]["sha256"]:
                os.replace(tmp, target)
        except FileNotFoundError:
            pass  # a side file is a convenience: the checkpoint is what must match
        finally:
            tmp.unlink(missing_ok=True)

    def _content(self, name: str) -> str | None:
        """The SHA-256 of the object ``name``, or None when there is none.

        Read from the ``sha256`` it carries (no download); an object without one
        (another tool wrote it, or another store) is read and hashed.
        """
        key = self._key(name)
        try:
            if self.s3:
                meta = self._retried(f"reading {self.where(name)}", lambda: self.fs.metadata(key))
                if "sha256" in meta:
                    return str(meta["sha256"])

            def digest() -> str:
                hashed = hashlib.sha256()
                with self.fs.open(key, "rb", block_size=_CHUNK) as f:
                    while chunk := f.read(_CHUNK):
                        hashed.update(chunk)
                return hashed.hexdigest()

            return self._retried(f"reading {self.where(name)}", digest)
        except FileNotFoundError:
            return None

    def _remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(name))

    def _run_names(self) -> list[str]:
        """The names under the prefix that a run writes (its files, manifests, pending copies)."""
        self.fs.invalidate_cache(self.root)
        try:
            keys = self.fs.find(self.root)
        except FileNotFoundError:
            return []
        names = [key[len(self.root) + 1 :] for key in keys if key.startswith(self.root + "/")]

        def ours(name: str) -> bool:
            folder, _, rest = name.partition("/")
            if folder == MANIFESTS:
                return bool(_MANIFEST.fullmatch(rest))
            if folder == PENDING:
                return is_run_file(rest) or rest in SIDE_FILES
            return is_run_file(name) or name in SIDE_FILES

        return sorted(n for n in names if ours(n))

    def _manifests(self) -> list[tuple[int, str]]:
        """``(seq, name)`` of every manifest under the prefix, newest first."""
        folder = self._key(MANIFESTS)
        self.fs.invalidate_cache(folder)
        try:
            keys = self._retried(
                f"listing {self.where(MANIFESTS)}", lambda: self.fs.ls(folder, detail=False)
            )
        except FileNotFoundError:
            return []
        found = []
        for key in keys:
            base = str(key).rsplit("/", 1)[-1]
            match = _MANIFEST.fullmatch(base)
            if match:
                found.append((int(match[1]), base))
        return sorted(found, reverse=True)

    def _read(self, base: str) -> dict[str, Any]:
        key = self._key(f"{MANIFESTS}/{base}")
        data = self._retried(
            f"reading {self.where(MANIFESTS + '/' + base)}", lambda: self.fs.cat_file(key)
        )
        manifest = json.loads(data)
        if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
            raise ValueError("not a ddpkit manifest")
        if int(manifest.get("version", 0)) > 1:
            raise ValueError(f"written by a newer ddpkit (manifest version {manifest['version']})")
        if (
            not isinstance(manifest.get("files"), dict)
            or manifest.get("checkpoint") not in manifest["files"]
        ):
            raise ValueError("its files do not name its checkpoint")
        moves = manifest.get("moves", [])
        if not isinstance(moves, list) or any(
            not isinstance(m, list) or len(m) != 4 for m in moves
        ):
            raise ValueError("its moves are not [source, target, sha256, size] lists")
        return manifest

    def _newest_job(self) -> str | None:
        """The launcher job that committed the newest checkpoint, or None."""
        listed = self._manifests()
        try:
            manifest = self._read(listed[0][1]) if listed else {}
            job = manifest["files"][manifest["checkpoint"]].get("job") if manifest else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return job if isinstance(job, str) else None

    def _describe(self, names: Iterable[str]) -> str:
        listed = self._manifests()
        shown = ", ".join(list(names)[:6])
        if not listed:
            return f"no committed checkpoint; objects: {shown}"
        try:
            manifest = self._read(listed[0][1])
            entry = manifest["files"][manifest["checkpoint"]]
            return f"{_found(manifest['checkpoint'], entry).describe()}; objects: {shown}"
        except (OSError, ValueError, KeyError, TypeError):
            return f"objects: {shown}"


def check_location(location: str) -> tuple[Literal["OK", "FAIL"], str, str]:
    """``ddpkit doctor --checkpoints``: can a run write to ``location``, and what does it hold?

    Returns:
        A status, what was found and the fix (for a FAIL).
    """
    if not is_url(location):
        directory = Path(location.removeprefix("file://")).absolute()
        parent = next((p for p in (directory, *directory.parents) if p.exists()), directory)
        if not os.access(parent, os.W_OK):
            return "FAIL", f"{parent} is not writable", "pass a directory this user may write"
        files = run_files(directory)
        held = describe_run(directory, files) if files else "no run yet"
        return "OK", f"{directory}: writable; {held}", ""
    try:
        store = ObjectStore(location)
        store.check()
        names = store._run_names()
    except (CheckpointError, ImportError, ValueError) as exc:
        return (
            "FAIL",
            str(exc).split(" See ")[0],
            "see docs/troubleshooting.md#the-object-store-cannot-be-reached",
        )
    held = store._describe(names) if names else "no run yet"
    return "OK", f"{store.url} at {store.endpoint}: readable and writable; {held}", ""


def _found(name: str, entry: Mapping[str, Any]) -> Found:
    return Found(
        name=name,
        snapshot=str(entry["snapshot"]),
        generation=int(entry["generation"]),
        step=int(entry["step"]),
        kind=str(entry["kind"]),
        epoch=int(entry["epoch"]),
        world_size=int(entry["world_size"]),
        job=entry["job"] if isinstance(entry.get("job"), str) else None,
    )


def _s3fs_core() -> Any:
    import s3fs.core

    return s3fs.core


def _write_bytes(data: bytes, path: Path) -> None:
    path.write_bytes(data)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _jsonable(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``extra`` that JSON holds as they are: settings read without a download."""
    kept = {}
    for key, value in extra.items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            continue
        kept[str(key)] = value
    return kept
