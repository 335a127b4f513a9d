"""Time for the loop: the database-aligned clock, and what to do with a due job (pure)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .schedules import Schedule


def sleep(seconds: float) -> None:
    """``time.sleep()`` through a condition wait.

    Under libfaketime with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` (the usual way to
    skew a host's clock in tests) ``time.sleep()`` fails with ``EINVAL``, while
    condition waits, which every other wait in the scheduler uses, work.
    """
    if seconds > 0:
        threading.Event().wait(seconds)


class Clock:
    """Wall and monotonic time; ``offset_ms`` corrects the wall clock to the database's."""

    # A change of the wall clock against the monotonic one beyond this is a step
    # (NTP, an operator, a VM resumed), not drift: about 1 ms a minute at worst.
    STEP_S = 0.05

    def __init__(self) -> None:
        self.offset_ms = 0.0
        self._wall_minus_monotonic = time.time() - time.monotonic()

    def now_ms(self) -> int:
        return int(self.exact_ms())

    def exact_ms(self) -> float:
        """The database-corrected time in ms, with the fraction (for waiting until an instant)."""
        return time.time() * 1000 + self.offset_ms

    def monotonic(self) -> float:
        return time.monotonic()

    def stepped(self) -> float:
        """By how many seconds the wall clock was stepped since the last call (0.0 if it was not)."""
        now = time.time() - time.monotonic()
        step = now - self._wall_minus_monotonic
        self._wall_minus_monotonic = now
        return step if abs(step) > self.STEP_S else 0.0


@dataclass(frozen=True)
class DuePlan:
    """What to do with a job whose next slot is due (see :func:`plan_due`)."""

    claim: int | None  # a current slot to claim as scheduled
    catch_up_until: int | None  # slots up to here may have been missed by everyone
    next_slot: int  # the job's next slot after this turn


def plan_due(schedule: Schedule, next_slot: int, now_ms: int, grace_ms: int) -> DuePlan:
    """Decide what a due job needs at ``now_ms``. Pure: takes time, returns a plan.

    A slot is *current* while it is no more than ``grace_ms`` old: it is claimed
    as ``scheduled``. Older due slots, which this instance did not claim in time
    (it was starting, frozen or cut off from the database), go to catch-up,
    where the database decides whether anyone missed them.
    """
    if next_slot > now_ms:  # nothing due yet
        return DuePlan(None, None, next_slot)
    following = schedule.next_after(next_slot)
    if following > now_ms:
        # The common case, one slot due: no backward search (it is the costly one
        # for cron), and next_after() is memoised for jobs sharing the schedule.
        latest = next_slot
    else:
        latest = schedule.latest_at_or_before(now_ms) or next_slot
    current = latest if now_ms - latest <= grace_ms else None
    until = None
    if latest > next_slot or current is None:
        stale = schedule.latest_at_or_before(now_ms - grace_ms)
        if stale is not None and stale >= next_slot:
            until = stale
    return DuePlan(current, until, following if latest == next_slot else schedule.next_after(latest))
