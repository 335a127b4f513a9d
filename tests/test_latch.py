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
