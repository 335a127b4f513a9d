"""Interval and cron schedules: parse, validate, and compute slots.

Pure Python, no Django. A *slot* is a scheduled instant in whole milliseconds
since the Unix epoch (UTC). Every instance computes the same slots from the
same declaration without talking to the others, so the slot can serve as the
key that the instances race for.

Cron expressions are matched by croniter on *naive local wall times*; turning a
wall time into an instant is done here, so that daylight-saving time follows
our rules rather than whatever the matching library does:

* a wall time that does not exist (spring-forward gap) fires once, at the first
  instant after the gap;
* a wall time that happens twice (fall-back) fires once, at its first
  occurrence.

A job that fires every hour or more often (its hour field covers all 24 hours)
keeps firing on real elapsed time instead: both occurrences of a repeated wall
time fire, and a wall time in a gap fires at the instant it would have had if
the clocks had not jumped (``"30 * * * *"`` fires at 01:30 and 03:30 CEST
on the night Paris springs forward -- one real hour apart -- not also at 03:00).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, CroniterError, croniter

from .durations import format_ms

UTC = timezone.utc
_HOUR_MS = 3_600_000
# No zone has moved its clocks by more than this in one step in modern times
# (the largest DST shift is 2 hours); it bounds how far a local wall time's
# instant can stray from the wall time read as UTC.
_MAX_SHIFT = timedelta(hours=3)
# Counting missed cron slots stops here; the count is then a lower bound.
COUNT_CAP = 10_000
_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
CRON_FORMS = (
    "five fields 'minute hour day-of-month month day-of-week' (e.g. '0 6 1 * *'), "
    "an optional sixth field for seconds (e.g. '*/15 * * * * 30'), or one of " + ", ".join(sorted(_ALIASES))
)


class Schedule(Protocol):
    """What the scheduler needs from a schedule."""

    @property
    def kind(self) -> str:
        """``"interval"`` or ``"cron"``."""

    def next_after(self, t_ms: int) -> int:
        """The first slot strictly after ``t_ms``."""

    def latest_at_or_before(self, t_ms: int) -> int | None:
        """The last slot at or before ``t_ms`` (None if there is none)."""

    def slots_between(self, after_ms: int, until_ms: int, limit: int) -> tuple[list[int], int]:
        """The most recent ``limit`` slots in ``(after_ms, until_ms]``, oldest first, and how many there are."""

    def describe(self) -> str:
        """The schedule as it was declared, e.g. ``every 10s`` or ``cron 0 6 1 * * (Europe/Paris)``."""


@dataclass(frozen=True)
class IntervalSchedule:
    """Slots at every whole multiple of ``interval_ms`` since the Unix epoch."""

    interval_ms: int
    kind: str = field(default="interval", init=False)

    def __post_init__(self) -> None:
        if self.interval_ms <= 0:
            raise ValueError(f"interval must be positive, got {self.interval_ms}ms")

    def next_after(self, t_ms: int) -> int:
        return (t_ms // self.interval_ms + 1) * self.interval_ms

    def latest_at_or_before(self, t_ms: int) -> int | None:
        return (t_ms // self.interval_ms) * self.interval_ms

    def slots_between(self, after_ms: int, until_ms: int, limit: int) -> tuple[list[int], int]:
        first = self.next_after(after_ms)
        last = self.latest_at_or_before(until_ms)
        if last is None or last < first:
            return [], 0
        count = (last - first) // self.interval_ms + 1
        shown = min(count, limit)
        start = last - (shown - 1) * self.interval_ms
        return list(range(start, last + 1, self.interval_ms)), count

    def describe(self) -> str:
        return f"every {format_ms(self.interval_ms)}"


def normalise_cron(expression: str) -> str:
    """Expand aliases and check the field count; raise ``ValueError`` with the valid forms."""
    if not isinstance(expression, str):
        raise ValueError(f"{expression!r} is not a cron expression; use {CRON_FORMS}")
    text = " ".join(expression.split())
    if text.startswith("@"):
        if text.lower() not in _ALIASES:
            raise ValueError(f"{expression!r} is not a known cron alias; use {CRON_FORMS}")
        return _ALIASES[text.lower()]
    fields = text.split(" ")
    if len(fields) not in (5, 6):
        raise ValueError(f"{expression!r} has {len(fields)} field(s); use {CRON_FORMS}")
    try:
        croniter(text)
    except (CroniterError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{expression!r} is not a valid cron expression ({error}); use {CRON_FORMS}") from None
    return text


def load_timezone(name: object) -> ZoneInfo:
    """Return the IANA timezone ``name`` or raise ``ValueError`` saying what is valid."""
    if isinstance(name, ZoneInfo):
        return name
    if not isinstance(name, str) or not name:
        raise ValueError(f"{name!r} is not a timezone name; use an IANA name such as 'Europe/Paris' or 'UTC'")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"{name!r} is not a known timezone; use an IANA name such as 'Europe/Paris', 'America/New_York' or 'UTC'"
        ) from None


def _ms(moment: datetime) -> int:
    return int(round(moment.timestamp() * 1000))


class CronSchedule:
    """A cron expression evaluated in a timezone, with the DST rules of the module docstring.

    Instances are immutable and cheap to share: :func:`cron_schedule` interns
    them, so jobs that share an expression and timezone share the cache of
    recently computed slots.
    """

    kind = "cron"

    def __init__(self, expression: str, tz: ZoneInfo) -> None:
        self.expression = normalise_cron(expression)
        self.declared = expression
        self.tz = tz
        expanded = croniter(self.expression).expanded
        hours = expanded[1]
        self.hourly = hours == ["*"] or set(hours) >= set(range(24))
        self._memo: dict[int, int] = {}
        # Probe once so that an expression that never fires ("0 0 30 2 *")
        # fails at declaration, not hours later in the scheduler loop.
        try:
            self.next_after(_ms(datetime.now(UTC)))
        except CroniterBadDateError:
            raise ValueError(f"{expression!r} never fires (no such date); use {CRON_FORMS}") from None

    def __repr__(self) -> str:
        return f"CronSchedule({self.expression!r}, {self.tz.key!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CronSchedule) and (self.expression, self.tz.key) == (
            other.expression,
            other.tz.key,
        )

    def __hash__(self) -> int:
        return hash((self.expression, self.tz.key))

    def describe(self) -> str:
        return f"cron {self.declared} ({self.tz.key})"

    # -- wall time <-> instants ---------------------------------------------------

    def _wall(self, t_ms: int) -> datetime:
        """The naive local wall time of instant ``t_ms`` (seconds precision, floored)."""
        moment = datetime.fromtimestamp(t_ms // 1000, tz=UTC).astimezone(self.tz)
        return moment.replace(tzinfo=None)

    def _instants(self, wall: datetime) -> tuple[list[int], bool]:
        """The instants at which local ``wall`` happens, earliest first, and whether it is in a gap.

        One for an ordinary wall time; both occurrences for a wall time that
        happens twice (callers that keep only the first take ``[0]``); for a
        wall time that does not exist, the instants it would have with the
        offsets before and after the jump (the gap lies between them).
        """
        first = wall.replace(tzinfo=self.tz, fold=0)
        second = wall.replace(tzinfo=self.tz, fold=1)
        if first.utcoffset() == second.utcoffset():
            return [_ms(first)], False
        a, b = sorted((_ms(first), _ms(second)))
        exists = first.astimezone(UTC).astimezone(self.tz).replace(tzinfo=None) == wall
        return [a, b], not exists

    def _transition_between(self, lo: int, hi: int) -> int:
        """The instant in ``(lo, hi]`` at which the zone's UTC offset changes (to the second)."""
        before = datetime.fromtimestamp(lo / 1000, tz=UTC).astimezone(self.tz).utcoffset()
        lo_s, hi_s = lo // 1000, -(-hi // 1000)
        while hi_s - lo_s > 1:
            mid = (lo_s + hi_s) // 2
            if datetime.fromtimestamp(mid, tz=UTC).astimezone(self.tz).utcoffset() == before:
                lo_s = mid
            else:
                hi_s = mid
        return hi_s * 1000

    def _near_transition(self, t_ms: int) -> bool:
        span = int(_MAX_SHIFT.total_seconds() * 1000)
        here = self._offset(t_ms)
        return any(self._offset(other) != here for other in (t_ms - span, t_ms + span))

    def _offset(self, t_ms: int) -> timedelta | None:
        return datetime.fromtimestamp(t_ms / 1000, tz=UTC).astimezone(self.tz).utcoffset()

    def _just_after_gap(self, t_ms: int) -> bool:
        """True if ``t_ms`` is less than one jump after a spring-forward transition.

        The wall times of that gap fire (for hourly jobs) in this stretch, out
        of wall-time order, so a backward walk must not stop here yet.
        """
        now = self._offset(t_ms)
        before = self._offset(t_ms - int(_MAX_SHIFT.total_seconds() * 1000))
        if now is None or before is None or now <= before:
            return False
        return self._offset(t_ms - (now - before) // timedelta(milliseconds=1)) != now

    # -- slots --------------------------------------------------------------------

    def next_after(self, t_ms: int) -> int:
        cached = self._memo.get(t_ms)
        if cached is not None:
            return cached
        result = self._next_after(t_ms)
        if len(self._memo) > 256:
            self._memo.clear()
        self._memo[t_ms] = result
        return result

    def _occurrences(self, wall: datetime) -> tuple[list[int], bool]:
        """The instants at which the job fires for ``wall``, and whether they are out of wall-time order.

        Both occurrences of a repeated wall time only for hourly jobs. A wall
        time in a gap fires at the first instant after the gap, or for hourly
        jobs at the instant it would have had without the jump (the later of
        the two) -- which can come after the instants of the next few wall
        times, so the walks below must not stop on it.
        """
        instants, in_gap = self._instants(wall)
        if in_gap:
            if self.hourly:
                return [instants[1]], True
            return [self._transition_between(*instants)], False
        return (instants if self.hourly else instants[:1]), False

    def _next_after(self, t_ms: int) -> int:
        start = self._wall(t_ms)
        if self.hourly and self._near_transition(t_ms):
            # Second occurrences of earlier wall times may still lie ahead of t.
            start -= _MAX_SHIFT
        it = croniter(self.expression, start)
        best: int | None = None
        for _ in range(1_000_000):
            instants, out_of_order = self._occurrences(it.get_next(datetime))
            for instant in instants:
                if instant > t_ms and (best is None or instant < best):
                    best = instant
            # A wall time's earliest instant never decreases as wall time grows
            # (gap times of hourly jobs aside), so once it reaches best, nothing
            # earlier than best can follow.
            if best is not None and not out_of_order and instants[0] >= best:
                return best
        raise CroniterBadDateError("no slot found")  # pragma: no cover - defensive

    def latest_at_or_before(self, t_ms: int) -> int | None:
        start = self._wall(t_ms) + timedelta(seconds=1)
        if self._near_transition(t_ms):
            # After a fall-back, first occurrences of later wall times lie behind t.
            start += _MAX_SHIFT
        it = croniter(self.expression, start)
        best: int | None = None
        for _ in range(1_000_000):
            try:
                instants, out_of_order = self._occurrences(it.get_prev(datetime))
            except CroniterBadDateError:
                return best
            for instant in instants:
                if instant <= t_ms and (best is None or instant > best):
                    best = instant
            if (
                best is not None
                and not out_of_order
                and instants[-1] <= best
                and not (self.hourly and self._just_after_gap(instants[-1]))
            ):
                return best
        return best  # pragma: no cover - defensive

    def slots_between(self, after_ms: int, until_ms: int, limit: int) -> tuple[list[int], int]:
        """The newest ``limit`` slots are found walking back from ``until_ms``.

        Counting walks forward from ``after_ms`` and stops at ``COUNT_CAP``
        slots (a per-second job that was down for hours), so in that case the
        count is a lower bound.
        """
        recent: list[int] = []
        t = until_ms
        while len(recent) < limit:
            slot = self.latest_at_or_before(t)
            if slot is None or slot <= after_ms:
                break
            recent.append(slot)
            t = slot - 1
        recent.reverse()
        if len(recent) < limit:
            return recent, len(recent)
        count = 0
        t = after_ms
        while count < COUNT_CAP:
            t = self.next_after(t)
            if t > until_ms:
                break
            count += 1
        return recent, max(count, len(recent))


@functools.lru_cache(maxsize=4096)
def cron_schedule(expression: str, tz_name: str) -> CronSchedule:
    """An interned :class:`CronSchedule` (jobs with the same expression share one)."""
    return CronSchedule(expression, load_timezone(tz_name))
