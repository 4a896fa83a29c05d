"""Job functions for the spawn restart and signal tests, importable by spawned children.

Each leaves a trace the test can read: a marker file per attempt and rank,
or a line on stdout, which the children share with their parent.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.distributed.stops import Preempted


def _mark(info: ddpkit.DistInfo, outdir: str) -> None:
    seen = f"{info.restart_count} {os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
    Path(outdir, f"attempt{info.restart_count}-rank{info.rank}").write_text(seen)


def die_on_first_attempt(info: ddpkit.DistInfo, outdir: str) -> tuple[int, int, str | None]:
    """Rank 1 SIGKILLs itself on attempt 0; on later attempts every rank all-reduces, returns."""
    _mark(info, outdir)
    if info.restart_count == 0 and info.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return info.rank, info.restart_count, os.environ.get("TORCHELASTIC_RESTART_COUNT")


def always_die(info: ddpkit.DistInfo, outdir: str) -> None:
    """Rank 1 SIGKILLs itself on every attempt, after leaving its marker."""
    _mark(info, outdir)
    if info.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def preempt_every_rank(info: ddpkit.DistInfo, outdir: str) -> None:
    """All ranks stop together after step 3, as ddpkit.fit does; rank 0 wrote the checkpoint."""
    _mark(info, outdir)
    dist.barrier()
    raise Preempted("SIGUSR1", "/ckpt/step3.pt" if info.is_main else None, step=3)


def preempt_rank_one(info: ddpkit.DistInfo, outdir: str) -> None:
    """Rank 1 stops alone; rank 0, waiting in a barrier, only loses its peer."""
    _mark(info, outdir)
    if info.rank == 1:
        raise Preempted("SIGTERM", step=7)
    dist.barrier()


def _say(line: str) -> None:
    # One write: the children share the parent's stdout, and print() may split
    # a line in two writes that another child's line then lands between.
    os.write(1, f"{line}\n".encode())


def _wait_in_steps(event: threading.Event) -> None:
    # Short waits, like a training loop's steps: a signal may land on one of
    # Gloo's threads, and then only the main thread's next bytecode runs the
    # Python handler; an endless wait would never get there.
    while not event.wait(0.1):
        pass


_stop = threading.Event()
_stop_signal: list[int] = []


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _stop_signal.append(signum)
    _stop.set()


def wait_for_a_signal(info: ddpkit.DistInfo) -> None:
    """Stop on SIGTERM (Preempted) or SIGINT (KeyboardInterrupt), as a training loop would.

    Prints ``ready <rank> <pid>`` once its handlers are in place, and
    ``stopping <rank> <signal>`` when one came.
    """
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    _say(f"ready {info.rank} {os.getpid()}")
    _wait_in_steps(_stop)
    name = signal.Signals(_stop_signal[0]).name
    _say(f"stopping {info.rank} {name}")
    if name == "SIGINT":
        raise KeyboardInterrupt
    raise Preempted(name, step=1)


def ignore_sigint(info: ddpkit.DistInfo) -> None:
    """Print ``sigint <rank>`` for each SIGINT and go on, as a job that cannot stop early."""
    signal.signal(signal.SIGINT, lambda signum, frame: _say(f"sigint {info.rank}"))
    _say(f"ready {info.rank} {os.getpid()}")
    _wait_in_steps(threading.Event())


def stall_rank_one(info: ddpkit.DistInfo) -> None:
    """Rank 1 stops stepping (its data never comes); rank 0 goes on until the watchdog ends both."""
    from ddpkit.distributed.watchdog import HangWatchdog

    watchdog = HangWatchdog(timeout=1.5).start()
    watchdog.progress(1, "done")
    step = 1
    while True:
        watchdog.progress(step, "data")
        if info.rank == 1 and step == 3:
            threading.Event().wait()  # the file system never answers
        watchdog.progress(step, "compute")
        time.sleep(0.05)
        step += 1
        watchdog.progress(step, "done")


def wait_before_fit(info: ddpkit.DistInfo) -> None:
    """Prints ``ready <rank> <pid>`` and waits, as a job still loading its data: no handlers."""
    _say(f"ready {info.rank} {os.getpid()}")
    _wait_in_steps(threading.Event())
