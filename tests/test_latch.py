"""The one-way event that every held run uses (django_anarchon/latch.py)."""

from __future__ import annotations

import threading
import time

from django_anarchon.latch import Latch


def test_wait_times_out_until_set_then_returns_at_once() -> None:
    latch = Latch()
    assert not latch.is_set()
    assert latch.wait(0) is False and latch.wait(-1) is False
    started = time.monotonic()
    assert latch.wait(0.05) is False
    assert time.monotonic() - started >= 0.04
    latch.set()
    latch.set()  # setting twice changes nothing
    assert latch.is_set() and latch.wait() is True and latch.wait(0) is True


def test_every_waiter_wakes_when_it_is_set_even_with_several_setters() -> None:
    latch = Latch()
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(latch.wait(5))) for _ in range(20)]
    for thread in waiters:
        thread.start()
    time.sleep(0.05)
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def setter() -> None:
        barrier.wait()
        try:
            latch.set()
        except BaseException as error:  # noqa: B036 - asserted below
            errors.append(error)

    setters = [threading.Thread(target=setter) for _ in range(4)]
    for thread in setters:
        thread.start()
    for thread in setters + waiters:
        thread.join(5)
    assert errors == []
    assert woke == [True] * 20
    assert latch.wait(0) is True, "still set after the waiters passed the lock on"


def test_a_waiter_and_a_setter_that_race_never_leave_the_waiter_blocked() -> None:
    """The lock is made by the first waiter: a set() just before or after that still wakes it."""
    slow: list[float] = []
    for _ in range(500):
        latch = Latch()
        barrier = threading.Barrier(2)
        woke: list[tuple[bool, float]] = []

        def waiter(latch: Latch = latch, barrier: threading.Barrier = barrier, woke: list = woke) -> None:
            barrier.wait()
            started = time.monotonic()
            woke.append((latch.wait(5), time.monotonic() - started))

        thread = threading.Thread(target=waiter)
        thread.start()
        barrier.wait()
        latch.set()
        thread.join(10)
        [(ok, took)] = woke
        assert ok
        if took > 1:
            slow.append(took)
    assert slow == [], f"waiters blocked until their timeout although set: {slow}"


def test_a_latch_set_before_anyone_waits_makes_no_lock() -> None:
    latch = Latch()
    latch.set()
    assert latch.wait(0) is True and latch._lock is None
