"""The hang report: every rank's last collectives and stack, matched into one file a person reads.

When the hang watchdog gives its verdict, or someone sends the report signal
to a rank of a running job, each rank that can still answer writes
:func:`answer` (its flight-recorder history, reduced to names, sequence
numbers and source lines, and its Python stacks) to the c10d store; the rank
that writes the report reads them and renders them with :func:`render`:
which ranks answered, for each process group the last collective each rank
entered, the first collective where the ranks disagree (a desync, or a rank
that never entered it), the line of code that issued it on each rank, and
what to do next. :func:`render` is a pure function of the answers.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ddpkit._docs import see
from ddpkit.distributed.recorder import dump_prefix, local_history

__all__ = [
    "REPORT_FILE",
    "answer",
    "first_disagreement",
    "is_collective_failure",
    "render",
    "report_collective_failure",
    "write_report",
]

REPORT_FILE = "hang-report.txt"
_KEPT = 12  # collectives per process group and rank carried in an answer
_STACK_CHARS = 20_000
# Frames in these trees are not where a collective was asked for: torch's own, the stdlib.
_LIBRARY = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"]}
)
_C10D = os.path.join("torch", "distributed", "")
_DDPKIT = str(Path(__file__).resolve().parents[1]) + os.sep


def _place(frame: Mapping[str, Any]) -> str:
    return f"{frame.get('filename')}:{frame.get('line')} ({frame.get('name')})"


def _source(frames: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """(the innermost line outside torch, the innermost outside torch and ddpkit), or ''."""
    outside, user = "", ""
    for frame in frames:
        path = str(frame.get("filename", ""))
        full = str(Path(path).resolve()) if path.startswith(os.sep) else path
        if full.startswith(_LIBRARY) or path.startswith("<"):
            continue
        outside = outside or _place(frame)
        if not full.startswith(_DDPKIT):
            user = _place(frame)
            break
    return outside, user


def _main_thread_source() -> tuple[str, str] | None:
    """Where the main thread issued the collective it waits in; None when it waits in none."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return None
    frames = [
        {"filename": f.filename, "line": f.lineno, "name": f.name}
        for f in reversed(traceback.extract_stack(frame))
    ]
    if not any(_C10D in str(f["filename"]) for f in frames):
        return None
    return _source(frames)


def _collectives(
    trace: Mapping[str, Any] | None, waiting: tuple[str, str] | None
) -> list[dict[str, Any]]:
    """The last collectives of each process group in a torch dump, oldest first, in plain form.

    ``waiting``: where the main thread issued the collective it waits in, the newest one.
    """
    if not trace:
        return []
    kept: dict[str, list[dict[str, Any]]] = {}
    entries = trace.get("entries", [])
    newest = max(entries, key=lambda e: e.get("time_created_ns", 0), default=None)
    for entry in entries:
        group = entry.get("process_group") or ("?", "?")
        p2p = bool(entry.get("is_p2p"))
        name = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
        issued, user = _source(entry.get("frames") or [])
        if entry is newest and waiting is not None and not issued:
            issued, user = waiting
        kept.setdefault(str(group[0]), []).append(
            {
                "pg": str(group[0]),
                "pg_desc": str(group[1]) if len(group) > 1 else "",
                "seq": int(entry["p2p_seq_id"] if p2p else entry["collective_seq_id"]),
                "p2p": p2p,
                "name": name,
                "sizes": entry.get("input_sizes", []),
                "done": bool(entry.get("retired")),
                "issued": issued,
                "user": user,
            }
        )
    return [c for entries in kept.values() for c in entries[-_KEPT:]]


def answer(
    rank: int,
    stacks: str,
    backend: str | None = None,
    directory: str | None = None,
    frames: bool = False,
) -> dict[str, Any]:
    """This rank's answer: host, process, last collectives and Python ``stacks``.

    With ``directory``, also writes torch's own dump of the recorder there
    (``flight-recorder/rank_<rank>``) for PyTorch's analyzer. Never raises
    for a missing recorder: the answer then carries no collectives. ``frames``
    (main thread only) reads each collective's stack from the recorder itself.
    """
    trace = local_history(backend, frames=frames)
    if trace is not None and directory is not None:
        path = Path(dump_prefix(directory) + str(rank))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(pickle.dumps(trace))
        except OSError:
            pass  # the report itself still carries the history
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "recorder": trace is not None,
        "collectives": _collectives(trace, _main_thread_source()),
        "stacks": stacks[-_STACK_CHARS:],
    }


def first_disagreement(
    answers: Mapping[int, Mapping[str, Any]],
) -> dict[str, Any] | None:
    """The first collective (lowest sequence number) where the answering ranks of a group differ.

    Returns None when they agree, else ``{"pg", "seq", "by_rank"}`` where
    ``by_rank`` maps each rank to its entry at ``seq`` (None: it never entered
    it). Only sequence numbers every rank still holds in its buffer count.
    """
    groups: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for rank, ans in answers.items():
        for c in ans.get("collectives", []):
            if not c["p2p"]:
                groups.setdefault(c["pg"], {}).setdefault(rank, {})[c["seq"]] = c
    found: dict[str, Any] | None = None
    for pg, ranks in groups.items():
        if len(ranks) < 2:
            continue
        low = max(min(seqs) for seqs in ranks.values())
        high = max(max(seqs) for seqs in ranks.values())
        for seq in range(low, high + 1):
            at = {r: seqs.get(seq) for r, seqs in ranks.items()}
            names = {None if c is None else c["name"] for c in at.values()}
            if len(names) > 1:
                if found is None or seq < int(found["seq"]):
                    found = {"pg": pg, "seq": seq, "by_rank": dict(sorted(at.items()))}
                break
    return found


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "none"


def render(
    answers: Mapping[int, Mapping[str, Any] | None], world_size: int, reason: str
) -> tuple[str, str]:
    """The report: ``(summary, full text)``; the summary is the text without the stacks.

    ``answers`` maps each rank to its :func:`answer`, or None (it did not answer).
    """
    heard = {r: a for r, a in sorted(answers.items()) if a is not None}
    silent = [r for r in range(world_size) if r not in heard]
    lines = [
        f"ddpkit hang report, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"why: {reason}",
        f"ranks that answered: {_ranks(list(heard))}",
        f"ranks that did not answer (stopped, dead or unreachable): {_ranks(silent)}",
    ]
    hosts = {r: f"{a['host']} pid {a['pid']}" for r, a in heard.items()}
    no_recorder = [r for r, a in heard.items() if not a.get("recorder")]
    if no_recorder:
        lines.append(
            f"no collective history from rank(s) {_ranks(no_recorder)}: the flight recorder "
            "is off there (TORCH_FR_BUFFER_SIZE=0) or was never used"
        )
    groups = sorted({c["pg"] for a in heard.values() for c in a["collectives"]})
    for pg in groups:
        lines.append("")
        lines.append(f"process group {pg}: the last collective each rank entered")
        for r, a in heard.items():
            mine = [c for c in a["collectives"] if c["pg"] == pg]
            if mine:
                last = mine[-1]
                state = "finished" if last["done"] else "not finished"
                kind = "p2p " if last["p2p"] else ""
                lines.append(
                    f"  rank {r} ({hosts[r]}): {kind}#{last['seq']} {last['name']} ({state}), "
                    f"issued at {last['user'] or last['issued'] or 'an unknown line'}"
                )
    desync = first_disagreement(heard)
    lines.append("")
    if desync is not None:
        lines.append(
            f"FIRST DISAGREEMENT: process group {desync['pg']}, collective #{desync['seq']}:"
        )
        for r, c in desync["by_rank"].items():
            if c is None:
                lines.append(f"  rank {r}: never entered #{desync['seq']}")
            else:
                lines.append(f"  rank {r}: {c['name']} #{desync['seq']} {c['sizes']}")
                lines.append(f"    issued at {c['issued'] or 'an unknown line'}")
                if c["user"] and c["user"] != c["issued"]:
                    lines.append(f"    user code {c['user']}")
        lines.append(
            "next: the ranks ran different code at that point (a branch on the rank, a data-"
            "dependent condition, a rank that skipped a step); make every rank issue the same "
            "collectives in the same order."
        )
    elif silent:
        lines.append(
            f"no disagreement among the ranks that answered; rank(s) {_ranks(silent)} did not "
            "answer: look at their logs and hosts (killed by the OOM killer, stopped, a lost "
            "node), and at the stacks below for where the others wait for them."
        )
    else:
        lines.append(
            "no disagreement: every rank entered the same collectives; the stacks below show "
            "where each waits (a slow or stuck rank, a network that dropped a connection)."
        )
    lines.append(see("a-hang-report"))
    summary = "\n".join(lines)
    stacks = [
        f"\n===== rank {r} ({hosts[r]}): Python stacks =====\n{a['stacks']}"
        for r, a in heard.items()
    ]
    return summary, summary + "\n" + "\n".join(stacks)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out or lost a peer (c10d, Gloo, NCCL)."""
    if isinstance(error, torch.distributed.DistError):
        return True
    text = str(error).lower()  # older torch raises a plain RuntimeError from the backend
    return isinstance(error, RuntimeError) and any(m in text for m in ("gloo", "nccl", "c10d"))


def report_collective_failure(
    directory: str | os.PathLike[str],
    rank: int,
    world_size: int,
    error: BaseException,
    backend: str | None = None,
) -> Path | None:
    """On a rank whose collective failed: its own report, ``hang-report-rank<rank>.txt``.

    The peers may be gone or stuck, so no rank waits for another's answer: each
    writes what it knows (its last collectives, with the line that issued each,
    and its stack) and says that the others did not answer here. Call it from
    the main thread, in the ``except`` that caught ``error``. Its path, or None
    when it cannot be written.
    """
    stacks = "".join(traceback.format_exception(error))
    mine = answer(rank, stacks, backend, str(directory), frames=True)
    reason = f"a collective failed on rank {rank}: {type(error).__name__}: {error}".strip()
    _, text = render({rank: mine}, world_size, reason.splitlines()[0])
    return write_report(directory, text, name=f"hang-report-rank{rank}.txt")


def write_report(
    directory: str | os.PathLike[str], text: str, name: str = REPORT_FILE
) -> Path | None:
    """Write ``hang-report.txt`` (or ``name``) in ``directory``; its path, or None if it cannot."""
    path = Path(directory) / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        return None
    return path
