"""Blocking calls that give up at a deadline: run them in a helper thread and stop waiting.

c10d's ``TCPStore`` blocks without limit when its peer accepted the
connection but does not answer (another program on the port, rank 0 stopped
with Ctrl-Z / SIGSTOP): its own timeout covers only some calls. A call made
through :class:`BoundedCalls` runs in a daemon thread while the caller waits
at most until the deadline; a call that outlives it is abandoned, stays
blocked in the kernel, and ends with the process. c10d releases the GIL
while it waits on the network, so the caller keeps running.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

__all__ = ["BoundedCalls", "DeadlinePassed"]

_T = TypeVar("_T")
_Job = tuple[Callable[..., Any], tuple[Any, ...], "Future[Any]"]


# At exit, how long to wait for calls abandoned at their deadline to return: c10d's own
# timeout usually ends them within a second or two of ours.
_EXIT_WAIT_S = 10.0
_abandoned: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _wait_for_abandoned_calls() -> None:
    """Let abandoned calls return before the interpreter is torn down (bounded).

    A daemon thread that comes back from C++ (c10d giving up on a store) while the
    interpreter finalizes is ended from inside pybind11 with a forced unwind, which
    aborts the whole process ("terminate called without an active exception") and
    replaces the exit status the program chose. Atexit handlers run before that
    point, while such a thread can still return normally.
    """
    until = time.monotonic() + _EXIT_WAIT_S
    for thread in list(_abandoned):
        thread.join(max(0.0, until - time.monotonic()))


class DeadlinePassed(TimeoutError):
    """A call did not return before the deadline; it was left running."""


class BoundedCalls:
    """Run calls one after another in one helper thread, each bounded by ``deadline``.

    Args:
        deadline: a ``time.monotonic()`` time after which no call is waited for.
        name: the helper thread's name.

    Once a call has timed out the helper is stuck in it, so every later call
    raises :class:`DeadlinePassed` at once.
    """

    def __init__(self, deadline: float, name: str = "ddpkit-bounded") -> None:
        self.deadline = deadline
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stuck = False
        # A daemon thread, never joined: one blocked for good must not hold up exit.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def __call__(self, fn: Callable[..., _T], *args: Any, grace: float = 0.0) -> _T:
        """``fn(*args)``, or :class:`DeadlinePassed` at ``deadline + grace``.

        Exceptions that ``fn`` raises reach the caller unchanged.
        """
        if self._stuck:
            raise DeadlinePassed(f"an earlier call is still blocked; {fn!r} was not made")
        done: Future[_T] = Future()
        self._jobs.put((fn, args, done))
        left = self.deadline + grace - time.monotonic()
        try:  # threading's wait cannot take more than TIMEOUT_MAX (about 292 years)
            return done.result(timeout=min(max(left, 0.0), threading.TIMEOUT_MAX))
        except FutureTimeout:
            self._stuck = True
            self.close()  # the helper ends once the call returns, if it ever does
            _abandoned.add(self._thread)
            raise DeadlinePassed(f"{fn!r} did not return by the deadline") from None

    def close(self) -> None:
        """Let the helper thread end once its current call (if any) returns."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, done = job
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller
                done.set_exception(exc)
