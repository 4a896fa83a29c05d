"""Where ``build_lmdb`` may write, and putting a finished database there without a gap.

Nothing a user has is replaced unless it is recognisably an LMDB database:
not a file, not the source, not a directory with other files in it. The new
database is built beside the output under a temporary name and swapped in
atomically where the system allows it; what killed builds left behind is
removed once a later build into the same place has finished.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ddpkit.data.lmdb_format import is_lmdb
from ddpkit.files import exchange, remove_stale, rename_new, temp_path

__all__ = ["check_output", "move_into_place", "temp_output"]

# What an LMDB environment directory holds; anything else there is not ours to delete.
_LMDB_FILES = {"data.mdb", "lock.mdb"}


def check_output(source: str, output: str, overwrite: bool) -> None:
    """Refuse, before any work, an output that would destroy or poison something.

    Raises:
        ValueError: an empty path, the output is the source, or lies inside it.
        FileNotFoundError: the output's directory does not exist.
        FileExistsError: the output exists and ``overwrite`` is false, or it is
            not an LMDB database (a file, a link, a directory with other files).
    """
    for name, path in (("source", source), ("output", output)):
        if not path.strip():
            raise ValueError(f"the {name} path is empty; name a file or directory")
    src, out = Path(source).resolve(), Path(output).resolve()
    if src == out:
        raise ValueError(
            f"the output {output} is the source {source}; write the database elsewhere"
        )
    if src.is_dir() and out.is_relative_to(src):
        raise ValueError(
            f"the output {output} lies inside the source {source}: its files would become part "
            "of every later build of that source. Write the database outside the source"
        )
    if not out.parent.is_dir():
        raise FileNotFoundError(
            f"{out.parent}, the directory of the output {output}, does not exist"
        )
    if not os.path.lexists(output):
        return
    if not overwrite:
        raise FileExistsError(
            f"{output} already exists; pass overwrite=True (--overwrite) to "
            "replace it, or choose another output path"
        )
    refuse = "refusing to replace it even with overwrite: remove it yourself or choose another path"
    if os.path.islink(output) or not os.path.isdir(output):
        kind = "a symbolic link" if os.path.islink(output) else "a file"
        raise FileExistsError(f"{output} is {kind}, not an LMDB database directory; {refuse}")
    if not os.path.exists(os.path.join(output, "data.mdb")):
        raise FileExistsError(
            f"{output} is a directory without data.mdb, not an LMDB database; {refuse}"
        )
    if not is_lmdb(output):
        raise FileExistsError(
            f"{output}/data.mdb has no LMDB header, so {output} is not an LMDB database; {refuse}"
        )
    others = sorted(set(os.listdir(output)) - _LMDB_FILES)
    if others:
        raise FileExistsError(
            f"{output} holds {', '.join(others[:5])} beside data.mdb, which an LMDB database "
            f"does not; {refuse}"
        )


def temp_output(output: str) -> str:
    """Where to build the database for ``output``: a fresh name beside it."""
    return os.fspath(temp_path(output))


def move_into_place(tmp: str, source: str, output: str, overwrite: bool) -> None:
    """Give the finished database at ``tmp`` the name ``output``, replacing an old one.

    The output is checked again first: a build can take hours, and what is
    at ``output`` now need not be what was there when it started (another
    rank's build, a file the user put there). An old database is swapped out
    atomically (Linux), checked once more, and deleted; where the swap is not
    available, two renames leave a window in which ``output`` is missing, and
    ``open_env`` then says where the databases are. Removing the old database
    and the leftovers of killed builds is best-effort: the new one is in place.

    Raises:
        FileExistsError: something that is not to be replaced appeared at
            ``output`` during the build; ``output`` is left as it is.
    """
    check_output(source, output, overwrite)
    if not os.path.lexists(output):
        rename_new(tmp, output)  # FileExistsError if something appears at the last moment
    elif exchange(tmp, output):
        if not _only_lmdb(tmp):  # swapped out something that is not a database: put it back
            exchange(tmp, output)
            raise FileExistsError(
                f"{output} changed during the build and is not an LMDB "
                "database now; it is left as it is"
            )
        shutil.rmtree(tmp, ignore_errors=True)  # the old database, under the temporary name
    else:
        aside = os.fspath(temp_path(output, "old"))
        os.rename(output, aside)
        try:
            os.rename(tmp, output)
        except BaseException:
            os.rename(aside, output)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    with contextlib.suppress(OSError):
        remove_stale(output)


def _only_lmdb(path: str) -> bool:
    return (
        os.path.isdir(path)
        and not os.path.islink(path)
        and is_lmdb(path)
        and set(os.listdir(path)) <= _LMDB_FILES
    )
