"""ddpkit.distributed.deadline: calls in a helper thread that the caller stops waiting for."""

from __future__ import annotations

import threading
import time

import pytest

from ddpkit.distributed.deadline import BoundedCalls, DeadlinePassed


def test_a_call_returns_its_value_and_passes_its_arguments() -> None:
    calls = BoundedCalls(time.monotonic() + 30)
    try:
        assert calls(divmod, 17, 5) == (3, 2)
        assert calls(threading.current_thread) is not threading.current_thread()
    finally:
        calls.close()


def test_an_exception_reaches_the_caller_unchanged() -> None:
    calls = BoundedCalls(time.monotonic() + 30)
    error = KeyError("missing")
    try:

        def fail() -> None:
            raise error

        with pytest.raises(KeyError) as info:
            calls(fail)
        assert info.value is error
        assert calls(len, "abc") == 3  # an exception does not stick the helper
    finally:
        calls.close()


def test_a_blocked_call_is_abandoned_at_the_deadline_and_later_calls_refused() -> None:
    release = threading.Event()
    calls = BoundedCalls(time.monotonic() + 0.2, name="test-bounded")
    start = time.monotonic()
    with pytest.raises(DeadlinePassed, match="did not return by the deadline"):
        calls(release.wait)
    assert time.monotonic() - start < 5
    with pytest.raises(DeadlinePassed, match="an earlier call is still blocked"):
        calls(len, "abc")
    assert isinstance(DeadlinePassed("x"), TimeoutError)
    assert any(t.name == "test-bounded" and t.daemon for t in threading.enumerate())
    release.set()
    calls.close()


def test_grace_extends_the_wait_past_the_deadline() -> None:
    def late() -> str:
        time.sleep(0.3)
        return "late"

    calls = BoundedCalls(time.monotonic() + 0.05)
    try:
        assert calls(late, grace=20) == "late"
    finally:
        calls.close()


def test_a_deadline_already_passed_still_runs_nothing_forever() -> None:
    calls = BoundedCalls(time.monotonic() - 10)
    release = threading.Event()
    with pytest.raises(DeadlinePassed):
        calls(release.wait)  # waited for 0 s, not forever
    release.set()
    calls.close()


def test_calls_run_one_after_another_in_one_thread() -> None:
    calls = BoundedCalls(time.monotonic() + 30)
    try:
        names = {calls(lambda: threading.get_ident()) for _ in range(5)}
        assert len(names) == 1
    finally:
        calls.close()


def test_close_ends_the_helper_thread() -> None:
    calls = BoundedCalls(time.monotonic() + 30, name="test-closing")
    calls(len, "x")
    calls.close()
    for thread in threading.enumerate():
        if thread.name == "test-closing":
            thread.join(timeout=5)
            assert not thread.is_alive()
