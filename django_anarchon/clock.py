"""Time for the scheduler: the database-aligned clock and the estimate of its offset (pure).

Nothing here touches the database: the engine measures round trips and hands the
samples to :class:`ClockEstimate`, which says how far this host's clock is from
the database's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable


def sleep(seconds: float) -> None:
    """``time.sleep()`` through a condition wait.

    Under libfaketime with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` (the usual way to
    skew a host's clock in tests) ``time.sleep()`` fails with ``EINVAL``, while
    condition waits, which every other wait in the scheduler uses, work.
    """
    if seconds > 0:
        threading.Event().wait(seconds)


class Clock:
    """Wall and monotonic time; ``offset_ms`` corrects the wall clock to the database's.

    Anchored (once the database's clock, another host's, has been measured: PostgreSQL, MySQL),
    the corrected time runs on the monotonic clock from the last measurement of the database's: a
    step of this host's wall clock (NTP, an operator, a resumed VM) between two loop turns, or a
    wall clock running fast or slow against the monotonic one, moves no slot's start. Not anchored
    (SQLite, whose clock is this host's and steps with it), it follows the wall clock.
    """

    # A change of the wall clock against the monotonic one beyond this is a step
    # (NTP, an operator, a VM resumed), not drift.
    STEP_S = 0.05

    def __init__(self) -> None:
        self._wall_minus_monotonic = time.time() - time.monotonic()  # as stepped() last saw it
        # (anchored, wall minus monotonic when the offset was measured, the offset), replaced as
        # one: other threads read the time while the loop's thread measures.
        self._reading = (False, self._wall_minus_monotonic, 0.0)

    @property
    def anchored(self) -> bool:
        """Whether the corrected time runs on the monotonic clock (see the class)."""
        return self._reading[0]

    @property
    def offset_ms(self) -> float:
        """The database's clock minus this host's wall clock, in ms, as last measured."""
        return self._reading[2]

    def now_ms(self) -> int:
        return int(self.exact_ms())

    def exact_ms(self) -> float:
        """The database-corrected time in ms, with the fraction (for waiting until an instant)."""
        anchored, anchor, offset_ms = self._reading
        if anchored:
            return (time.monotonic() + anchor) * 1000 + offset_ms
        return time.time() * 1000 + offset_ms

    def measured(self, offset_ms: float, wall_minus_monotonic: float | None = None) -> None:
        """The database's clock (another host's) was just measured ``offset_ms`` from this host's wall clock.

        ``wall_minus_monotonic`` is this host's wall clock minus its monotonic clock as the
        measurement read them (:meth:`reading`); by default, now. From now on the corrected time
        is anchored to the monotonic clock (see the class).
        """
        if wall_minus_monotonic is None:
            wall_minus_monotonic = time.time() - time.monotonic()
        self._reading = (True, wall_minus_monotonic, offset_ms)

    @staticmethod
    def reading() -> tuple[float, float]:
        """This host's wall and monotonic clocks, read together (seconds)."""
        return time.time(), time.monotonic()

    @classmethod
    def steady_between(cls, before: tuple[float, float], after: tuple[float, float]) -> bool:
        """Whether the wall clock moved with the monotonic one between two :meth:`reading` results (no step)."""
        return abs((after[0] - before[0]) - (after[1] - before[1])) <= cls.STEP_S

    def follow_step(self, step_s: float) -> None:
        """This host's wall clock was stepped by ``step_s`` and the database's was not: keep the corrected time.

        Anchored, the corrected time never moved with the step (the anchor takes it in); otherwise
        the offset takes it back.
        """
        anchored, anchor, offset_ms = self._reading
        self._reading = (anchored, anchor + step_s, offset_ms - step_s * 1000)

    def monotonic(self) -> float:
        return time.monotonic()

    def stepped(self) -> float:
        """By how many seconds the wall clock was stepped since the last call (0.0 if it was not)."""
        now = time.time() - time.monotonic()
        step = now - self._wall_minus_monotonic
        self._wall_minus_monotonic = now
        return step if abs(step) > self.STEP_S else 0.0


def describe_offset(offset_ms: float) -> str:
    """How a host's clock stands against the database's, in words: ``"4.2s ahead of"``.

    ``offset_ms`` is the database clock minus the host's (:func:`clock_offset`), so a
    host whose clock is ahead has a negative offset.
    """
    return f"{abs(offset_ms) / 1000:.1f}s {'ahead of' if offset_ms < 0 else 'behind'}"


def _uncertainty_ms(rtt: float) -> float:
    """How far a clock sample's offset can be from the truth: half its round trip, plus 1 ms of resolution."""
    return rtt / 2 + 1.0


def clock_offset(samples: Iterable[tuple[float, float]]) -> float:
    """The database clock minus this host's, in ms, from ``(round trip, offset)`` samples.

    Estimated like NTP: the sample with the shortest round trip. An offset within
    its uncertainty (half the round trip, plus a millisecond) is noise on a host
    whose clock agrees with the database's and counts as zero; a larger one is used
    as measured, not shrunk toward zero, so that a skewed host is neither early nor
    late by a systematic margin and races its peers for slots on equal terms.
    """
    rtt, offset = min(samples)
    return offset if abs(offset) > _uncertainty_ms(rtt) else 0.0


def add_clock_sample(samples: list[tuple[float, float]], sample: tuple[float, float]) -> list[tuple[float, float]]:
    """The recent ``(round trip, offset)`` samples to estimate from, with ``sample`` added.

    The database's timestamp was taken during the round trip, so each sample
    bounds the true offset to its offset ± its uncertainty. A new sample whose
    bounds do not meet the current best sample's means one of the clocks was
    stepped (NTP, an operator): the older samples describe a clock that no longer
    exists and are dropped, rather than outvoting the new one for the next eight
    measurements.
    """
    if samples:
        best_rtt, best = min(samples)
        rtt, offset = sample
        if abs(offset - best) > _uncertainty_ms(best_rtt) + _uncertainty_ms(rtt):
            return [sample]
    return [*samples[-7:], sample]


class ClockEstimate:
    """The recent samples of the database clock and the offset they give."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []

    def add(self, sent_s: float, received_s: float, database_s: float) -> float:
        """Add a sample (this host's wall times around the round trip, the database's reading); the offset in ms."""
        sample = ((received_s - sent_s) * 1000, database_s * 1000 - (sent_s + received_s) * 500)
        self.samples = add_clock_sample(self.samples, sample)
        return clock_offset(self.samples)

    def forget(self) -> None:
        """Drop the samples (this host's clock was stepped: they describe a clock that no longer exists)."""
        self.samples = []
