"""Interval and cron schedules: slots, month ends, leap years, weekdays and daylight-saving time.

Every test passes instants as millisecond timestamps; none of them reads the clock or sleeps.
Zones and their 2024 transitions used below (UTC instants):

* Europe/Paris       spring 03-31 01:00 (02:00 CET -> 03:00 CEST), fall 10-27 01:00 (03:00 CEST -> 02:00 CET)
* America/New_York   spring 03-10 07:00 (02:00 EST -> 03:00 EDT), fall 11-03 06:00 (02:00 EDT -> 01:00 EST)
* Australia/Sydney   fall 04-06 16:00 (03:00 AEDT -> 02:00 AEST), spring 10-05 16:00 (02:00 AEST -> 03:00 AEDT)
* Australia/Lord_Howe (a 30-minute shift) fall 04-06 15:00 (02:00 +11 -> 01:30 +1030),
  spring 10-05 15:30 (02:00 +1030 -> 02:30 +11)
"""

from __future__ import annotations

import bisect
import functools
import random
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from django_anarchon import schedules
from django_anarchon.schedules import (
    COUNT_CAP,
    CronSchedule,
    IntervalSchedule,
    cron_schedule,
    load_timezone,
    normalise_cron,
)

UTC = timezone.utc
PARIS, NEW_YORK, SYDNEY, LORD_HOWE = "Europe/Paris", "America/New_York", "Australia/Sydney", "Australia/Lord_Howe"
HOUR = 3_600_000
MINUTE = 60_000


def utc(*parts: int) -> int:
    """Milliseconds of a UTC wall time, e.g. ``utc(2024, 3, 31, 1)``."""
    return int(datetime(*parts, tzinfo=UTC).timestamp()) * 1000  # type: ignore[misc]


def local(zone: str, *parts: int, fold: int = 0) -> int:
    """Milliseconds of a (existing) local wall time in ``zone``."""
    moment = datetime(*parts, tzinfo=ZoneInfo(zone), fold=fold)  # type: ignore[misc]
    assert moment.astimezone(UTC).astimezone(ZoneInfo(zone)).replace(tzinfo=None) == moment.replace(tzinfo=None)
    return int(moment.timestamp()) * 1000


def iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return f"{datetime.fromtimestamp(ms // 1000, UTC):%Y-%m-%dT%H:%M:%S}.{ms % 1000:03d}Z"


def cron(expression: str, zone: str = "UTC") -> CronSchedule:
    return CronSchedule(expression, ZoneInfo(zone))


def fires(schedule: schedules.Schedule, after: int, until: int) -> list[int]:
    """The slots in ``(after, until]`` by repeated ``next_after``."""
    out = []
    t = after
    while True:
        t = schedule.next_after(t)
        if t > until:
            return out
        out.append(t)


# -- intervals ---------------------------------------------------------------------------------


def test_interval_slots_are_multiples_of_the_interval_since_the_epoch() -> None:
    every_10s = IntervalSchedule(10_000)
    assert every_10s.next_after(0) == 10_000
    assert every_10s.next_after(1) == 10_000
    assert every_10s.next_after(9_999) == 10_000
    assert every_10s.next_after(10_000) == 20_000
    assert every_10s.next_after(-1) == 0
    assert every_10s.latest_at_or_before(10_000) == 10_000
    assert every_10s.latest_at_or_before(19_999) == 10_000
    assert every_10s.latest_at_or_before(0) == 0
    assert every_10s.latest_at_or_before(-1) == -10_000


def test_interval_slots_do_not_depend_on_when_you_ask() -> None:
    """Two instances that start at different moments compute the same slots (aligned to the epoch, not to t)."""
    every_7s = IntervalSchedule(7_000)
    t1, t2 = utc(2024, 5, 1, 12, 0, 0) + 123, utc(2024, 5, 1, 12, 0, 3) + 456
    slots1 = set(fires(every_7s, t1, t1 + 120_000))
    slots2 = set(fires(every_7s, t2, t2 + 120_000))
    assert all(slot % 7_000 == 0 for slot in slots1 | slots2)
    overlap = range(t2, t1 + 120_000)
    assert {s for s in slots1 if s in overlap} == {s for s in slots2 if s in overlap}


def test_daily_interval_fires_at_utc_midnight() -> None:
    daily = IntervalSchedule(86_400_000)
    assert daily.next_after(utc(2024, 3, 31, 0, 30)) == utc(2024, 4, 1)
    assert daily.latest_at_or_before(utc(2024, 3, 31, 23, 59, 59)) == utc(2024, 3, 31)


def test_interval_odd_millisecond_interval() -> None:
    every_1500ms = IntervalSchedule(1_500)
    assert fires(every_1500ms, 0, 6_000) == [1_500, 3_000, 4_500, 6_000]
    assert every_1500ms.next_after(4_499) == 4_500


def test_interval_random_instants() -> None:
    rnd = random.Random(7)
    for interval in (1, 500, 1_000, 7_000, 60_000, 5_400_000, 86_400_000):
        schedule = IntervalSchedule(interval)
        for _ in range(200):
            t = rnd.randrange(utc(2024, 1, 1), utc(2026, 1, 1))
            latest, nxt = schedule.latest_at_or_before(t), schedule.next_after(t)
            assert latest is not None
            assert latest <= t < nxt
            assert nxt - latest == interval
            assert nxt % interval == 0 and latest % interval == 0
            assert schedule.next_after(latest) == nxt
            assert schedule.latest_at_or_before(nxt) == nxt


def test_interval_slots_between_counts_and_limits() -> None:
    every_10s = IntervalSchedule(10_000)
    # (after, until]: after is excluded, until included.
    assert every_10s.slots_between(0, 50_000, 100) == ([10_000, 20_000, 30_000, 40_000, 50_000], 5)
    assert every_10s.slots_between(0, 59_999, 100) == ([10_000, 20_000, 30_000, 40_000, 50_000], 5)
    assert every_10s.slots_between(-1, 50_000, 100) == ([0, 10_000, 20_000, 30_000, 40_000, 50_000], 6)
    # The newest N, oldest first, and the total.
    assert every_10s.slots_between(0, 50_000, 2) == ([40_000, 50_000], 5)
    assert every_10s.slots_between(0, 50_000, 1) == ([50_000], 5)
    assert every_10s.slots_between(0, 50_000, 0) == ([], 5)
    assert every_10s.slots_between(0, 10**9, 3) == ([999_980_000, 999_990_000, 1_000_000_000], 100_000)
    # Nothing due.
    assert every_10s.slots_between(10_000, 19_999, 10) == ([], 0)
    assert every_10s.slots_between(50_000, 50_000, 10) == ([], 0)
    assert every_10s.slots_between(50_000, 10_000, 10) == ([], 0)


def test_interval_must_be_positive_and_describes_itself() -> None:
    with pytest.raises(ValueError, match="positive"):
        IntervalSchedule(0)
    with pytest.raises(ValueError, match="positive"):
        IntervalSchedule(-1_000)
    assert IntervalSchedule(5_400_000).describe() == "every 1h30m"
    assert IntervalSchedule(500).describe() == "every 500ms"
    assert IntervalSchedule(10_000).kind == "interval"


# -- cron: parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alias", "expanded"),
    [
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        ("@monthly", "0 0 1 * *"),
        ("@weekly", "0 0 * * 0"),
        ("@daily", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@hourly", "0 * * * *"),
        ("@DAILY", "0 0 * * *"),
        ("  @hourly ", "0 * * * *"),
    ],
)
def test_aliases(alias: str, expanded: str) -> None:
    assert normalise_cron(alias) == expanded


def test_normalise_cron_keeps_five_and_six_fields_and_squeezes_blanks() -> None:
    assert normalise_cron("0 6 1 * *") == "0 6 1 * *"
    assert normalise_cron("  0   6\t1 *  * ") == "0 6 1 * *"
    assert normalise_cron("*/15 * * * * 30") == "*/15 * * * * 30"


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("* * * * * * *", "has 7 field(s)"),
        ("0 0 1 1 * 0 2030", "has 7 field(s)"),
        ("* * * *", "has 4 field(s)"),
        ("", "has 1 field(s)"),
        ("   ", "has 1 field(s)"),
        ("61 * * * *", "not a valid cron expression"),
        ("* 24 * * *", "not a valid cron expression"),
        ("* * 0 * *", "not a valid cron expression"),
        ("* * 32 * *", "not a valid cron expression"),
        ("* * * 13 *", "not a valid cron expression"),
        ("* * * * 8", "not a valid cron expression"),
        ("*/0 * * * *", "not a valid cron expression"),
        ("a b c d e", "not a valid cron expression"),
        ("* * * * * 60", "not a valid cron expression"),
        ("? * * * *", "not a valid cron expression"),
        ("@reboot", "not a known cron alias"),
        ("@every 5m", "not a known cron alias"),
        ("@", "not a known cron alias"),
    ],
)
def test_bad_expressions_are_rejected_with_the_valid_forms(expression: str, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        normalise_cron(expression)
    message = str(caught.value)
    assert says in message
    assert repr(expression) in message
    assert schedules.CRON_FORMS in message
    with pytest.raises(ValueError):
        CronSchedule(expression, ZoneInfo("UTC"))


@pytest.mark.parametrize("value", [None, 5, ["0", "*", "*", "*", "*"]])
def test_non_strings_are_not_expressions(value: object) -> None:
    with pytest.raises(ValueError, match="not a cron expression"):
        normalise_cron(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("expression", ["0 0 30 2 *", "0 0 31 2 *", "0 0 31 4,6,9,11 *", "0 0 30 2 * 15"])
def test_an_expression_that_never_fires_is_rejected(expression: str) -> None:
    with pytest.raises(ValueError, match="never fires"):
        CronSchedule(expression, ZoneInfo(PARIS))
    with pytest.raises(ValueError, match="never fires"):
        cron_schedule(expression, PARIS)


def test_load_timezone() -> None:
    assert load_timezone("Europe/Paris") == ZoneInfo("Europe/Paris")
    assert load_timezone("UTC").key == "UTC"
    zone = ZoneInfo("Australia/Lord_Howe")
    assert load_timezone(zone) is zone
    for bad in ["Mars/Olympus", "Europe/Pariss", "../../etc/passwd", "/etc/localtime"]:
        with pytest.raises(ValueError, match="not a known timezone") as caught:
            load_timezone(bad)
        assert repr(bad) in str(caught.value)
        assert "Europe/Paris" in str(caught.value)
    for bad in ["", None, 5, timezone.utc]:
        with pytest.raises(ValueError, match="not a timezone name"):
            load_timezone(bad)


def test_unknown_timezone_in_cron_schedule() -> None:
    with pytest.raises(ValueError, match="not a known timezone"):
        cron_schedule("0 6 * * *", "Europe/Atlantis")


def test_cron_schedules_are_interned_and_compare_by_value() -> None:
    a = cron_schedule("0 6 1 * *", PARIS)
    assert cron_schedule("0 6 1 * *", PARIS) is a
    assert cron_schedule("0 6 1 * *", NEW_YORK) is not a
    assert cron("0 6 1 * *", PARIS) == a
    assert hash(cron("0 6 1 * *", PARIS)) == hash(a)
    assert cron("0 6 1 * *", NEW_YORK) != a
    assert cron("@daily", PARIS) == cron("0 0 * * *", PARIS)
    assert a.describe() == "cron 0 6 1 * * (Europe/Paris)"
    assert cron("@daily", PARIS).describe() == "cron @daily (Europe/Paris)"
    assert a.kind == "cron"


# -- cron: ordinary calendars ------------------------------------------------------------------


def test_five_fields_in_utc() -> None:
    schedule = cron("0 6 1 * *")
    assert schedule.next_after(utc(2024, 1, 15)) == utc(2024, 2, 1, 6)
    assert schedule.next_after(utc(2024, 2, 1, 6)) == utc(2024, 3, 1, 6)
    assert schedule.next_after(utc(2024, 2, 1, 6) - 1) == utc(2024, 2, 1, 6)
    assert schedule.latest_at_or_before(utc(2024, 2, 1, 6)) == utc(2024, 2, 1, 6)
    assert schedule.latest_at_or_before(utc(2024, 2, 1, 6) - 1) == utc(2024, 1, 1, 6)


def test_cron_in_a_timezone() -> None:
    schedule = cron("0 6 1 * *", PARIS)
    assert schedule.next_after(utc(2024, 1, 15)) == utc(2024, 2, 1, 5)  # 06:00 CET
    assert schedule.next_after(utc(2024, 6, 15)) == utc(2024, 7, 1, 4)  # 06:00 CEST


def test_sixth_field_is_seconds_and_comes_last() -> None:
    schedule = cron("*/15 * * * * 30")
    start = utc(2024, 5, 1, 12, 0)
    assert fires(schedule, start, start + 31 * MINUTE) == [
        utc(2024, 5, 1, 12, 0, 30),
        utc(2024, 5, 1, 12, 15, 30),
        utc(2024, 5, 1, 12, 30, 30),
    ]
    every_20s = cron("* * * * * */20")
    assert fires(every_20s, start, start + MINUTE) == [start + 20_000, start + 40_000, start + MINUTE]
    assert every_20s.latest_at_or_before(start + 59_999) == start + 40_000


def test_sub_second_instants_are_handled() -> None:
    schedule = cron("* * * * * *")
    t = utc(2024, 5, 1, 12) + 500
    assert schedule.next_after(t) == utc(2024, 5, 1, 12, 0, 1)
    assert schedule.latest_at_or_before(t) == utc(2024, 5, 1, 12)
    assert schedule.next_after(utc(2024, 5, 1, 12) - 1) == utc(2024, 5, 1, 12)


@pytest.mark.parametrize(
    ("alias", "after", "expected"),
    [
        ("@hourly", utc(2024, 5, 1, 10, 20), utc(2024, 5, 1, 11)),
        ("@daily", utc(2024, 5, 1, 10, 20), local(PARIS, 2024, 5, 2)),
        ("@midnight", utc(2024, 5, 1, 10, 20), local(PARIS, 2024, 5, 2)),
        ("@weekly", utc(2024, 5, 1, 10, 20), local(PARIS, 2024, 5, 5)),  # a Sunday
        ("@monthly", utc(2024, 5, 1, 10, 20), local(PARIS, 2024, 6, 1)),
        ("@yearly", utc(2024, 5, 1, 10, 20), local(PARIS, 2025, 1, 1)),
        ("@annually", utc(2024, 5, 1, 10, 20), local(PARIS, 2025, 1, 1)),
    ],
)
def test_alias_slots(alias: str, after: int, expected: int) -> None:
    assert cron(alias, PARIS).next_after(after) == expected


def _days(slots: list[int], zone: str = "UTC") -> list[str]:
    return [datetime.fromtimestamp(s / 1000, ZoneInfo(zone)).strftime("%Y-%m-%d %H:%M") for s in slots]


def test_the_31st_only_in_months_that_have_one() -> None:
    assert _days(fires(cron("0 0 31 * *"), utc(2024, 1, 1), utc(2025, 1, 1))) == [
        "2024-01-31 00:00",
        "2024-03-31 00:00",
        "2024-05-31 00:00",
        "2024-07-31 00:00",
        "2024-08-31 00:00",
        "2024-10-31 00:00",
        "2024-12-31 00:00",
    ]


def test_last_day_of_the_month_with_l() -> None:
    slots = fires(cron("0 0 L * *", PARIS), utc(2024, 1, 1), utc(2025, 3, 5))
    assert _days(slots, PARIS) == [
        "2024-01-31 00:00",
        "2024-02-29 00:00",
        "2024-03-31 00:00",
        "2024-04-30 00:00",
        "2024-05-31 00:00",
        "2024-06-30 00:00",
        "2024-07-31 00:00",
        "2024-08-31 00:00",
        "2024-09-30 00:00",
        "2024-10-31 00:00",
        "2024-11-30 00:00",
        "2024-12-31 00:00",
        "2025-01-31 00:00",
        "2025-02-28 00:00",
    ]


def test_february_29th_only_in_leap_years() -> None:
    schedule = cron("0 12 29 2 *")
    assert _days(fires(schedule, utc(2023, 1, 1), utc(2033, 1, 1))) == [
        "2024-02-29 12:00",
        "2028-02-29 12:00",
        "2032-02-29 12:00",
    ]
    assert schedule.next_after(utc(2024, 3, 1)) == utc(2028, 2, 29, 12)  # not 2025
    assert schedule.next_after(utc(2096, 3, 1)) == utc(2104, 2, 29, 12)  # 2100 is not a leap year
    assert schedule.latest_at_or_before(utc(2103, 12, 31)) == utc(2096, 2, 29, 12)
    assert schedule.latest_at_or_before(utc(2025, 6, 1)) == utc(2024, 2, 29, 12)


def test_weekdays() -> None:
    schedule = cron("0 9 * * 1-5", PARIS)
    # 2024-10-21 is a Monday; the week crosses Paris' fall-back night (Sunday 27th).
    assert _days(fires(schedule, utc(2024, 10, 19), utc(2024, 11, 2)), PARIS) == [
        "2024-10-21 09:00",
        "2024-10-22 09:00",
        "2024-10-23 09:00",
        "2024-10-24 09:00",
        "2024-10-25 09:00",
        "2024-10-28 09:00",
        "2024-10-29 09:00",
        "2024-10-30 09:00",
        "2024-10-31 09:00",
        "2024-11-01 09:00",
    ]
    assert _days(fires(cron("0 0 * * 7"), utc(2024, 5, 1), utc(2024, 5, 20))) == [
        "2024-05-05 00:00",
        "2024-05-12 00:00",
        "2024-05-19 00:00",
    ]
    assert fires(cron("0 0 * * SUN"), utc(2024, 5, 1), utc(2024, 5, 20)) == fires(
        cron("0 0 * * 0"), utc(2024, 5, 1), utc(2024, 5, 20)
    )
    assert _days(fires(cron("0 0 * * 1#2"), utc(2024, 1, 1), utc(2024, 4, 1))) == [
        "2024-01-08 00:00",
        "2024-02-12 00:00",
        "2024-03-11 00:00",
    ]


# -- DST: wall times that do not exist or happen twice -----------------------------------------


@pytest.mark.parametrize(
    ("expression", "zone", "before", "on", "after"),
    [
        # 02:30 does not exist on the spring-forward day: once, at 03:00 (the first instant after the gap).
        ("30 2 * * *", PARIS, utc(2024, 3, 30, 1, 30), utc(2024, 3, 31, 1), utc(2024, 4, 1, 0, 30)),
        ("30 2 * * *", NEW_YORK, utc(2024, 3, 9, 7, 30), utc(2024, 3, 10, 7), utc(2024, 3, 11, 6, 30)),
        ("0 2 * * *", NEW_YORK, utc(2024, 3, 9, 7), utc(2024, 3, 10, 7), utc(2024, 3, 11, 6)),
        ("59 2 * * *", PARIS, utc(2024, 3, 30, 1, 59), utc(2024, 3, 31, 1), utc(2024, 4, 1, 0, 59)),
        ("30 2 * * *", SYDNEY, utc(2024, 10, 4, 16, 30), utc(2024, 10, 5, 16), utc(2024, 10, 6, 15, 30)),
        # Lord Howe jumps from 02:00 to 02:30: 02:00 and 02:15 run at 02:30 (+11), 02:30 itself exists.
        ("0 2 * * *", LORD_HOWE, utc(2024, 10, 4, 15, 30), utc(2024, 10, 5, 15, 30), utc(2024, 10, 6, 15)),
        ("15 2 * * *", LORD_HOWE, utc(2024, 10, 4, 15, 45), utc(2024, 10, 5, 15, 30), utc(2024, 10, 6, 15, 15)),
        ("30 2 * * *", LORD_HOWE, utc(2024, 10, 4, 16), utc(2024, 10, 5, 15, 30), utc(2024, 10, 6, 15, 30)),
        # 02:30 happens twice on the fall-back day: once, at its first occurrence.
        ("30 2 * * *", PARIS, utc(2024, 10, 26, 0, 30), utc(2024, 10, 27, 0, 30), utc(2024, 10, 28, 1, 30)),
        ("30 1 * * *", NEW_YORK, utc(2024, 11, 2, 5, 30), utc(2024, 11, 3, 5, 30), utc(2024, 11, 4, 6, 30)),
        ("0 1 * * *", NEW_YORK, utc(2024, 11, 2, 5), utc(2024, 11, 3, 5), utc(2024, 11, 4, 6)),
        ("30 2 * * *", SYDNEY, utc(2024, 4, 5, 15, 30), utc(2024, 4, 6, 15, 30), utc(2024, 4, 7, 16, 30)),
        ("45 1 * * *", LORD_HOWE, utc(2024, 4, 5, 14, 45), utc(2024, 4, 6, 14, 45), utc(2024, 4, 7, 15, 15)),
    ],
)
def test_daily_job_runs_once_on_dst_days(expression: str, zone: str, before: int, on: int, after: int) -> None:
    schedule = cron(expression, zone)
    window = fires(schedule, before - 1, after)
    assert [iso(s) for s in window] == [iso(before), iso(on), iso(after)]
    # Asked from any instant of the DST day, the answer is the same single slot.
    assert schedule.next_after(before) == on
    assert schedule.next_after(on - 1) == on
    assert schedule.next_after(on) == after
    for t in range(on, after, 15 * MINUTE):
        assert schedule.latest_at_or_before(t) == on, iso(t)
    for t in range(before, on, 15 * MINUTE):
        assert schedule.latest_at_or_before(t) == before, iso(t)


def test_fall_back_second_occurrence_is_never_returned() -> None:
    schedule = cron("30 1 * * *", NEW_YORK)
    second = local(NEW_YORK, 2024, 11, 3, 1, 30, fold=1)
    assert second == utc(2024, 11, 3, 6, 30)
    assert schedule.next_after(second - 1) == utc(2024, 11, 4, 6, 30)
    assert schedule.latest_at_or_before(second) == utc(2024, 11, 3, 5, 30)
    assert schedule.latest_at_or_before(utc(2024, 11, 3, 6, 59)) == utc(2024, 11, 3, 5, 30)


def test_hourly_job_keeps_real_time_on_spring_forward() -> None:
    # Paris: 00:00Z is 01:00 CET, 01:00Z is 03:00 CEST. No duplicate, no skipped real hour.
    assert [iso(s) for s in fires(cron("0 * * * *", PARIS), utc(2024, 3, 30, 22), utc(2024, 3, 31, 3))] == [
        "2024-03-30T23:00:00.000Z",
        "2024-03-31T00:00:00.000Z",
        "2024-03-31T01:00:00.000Z",
        "2024-03-31T02:00:00.000Z",
        "2024-03-31T03:00:00.000Z",
    ]
    assert fires(cron("0 * * * *", NEW_YORK), utc(2024, 3, 10, 4), utc(2024, 3, 10, 10)) == [
        utc(2024, 3, 10, h) for h in range(5, 11)
    ]
    assert fires(cron("@hourly", SYDNEY), utc(2024, 10, 5, 13), utc(2024, 10, 5, 19)) == [
        utc(2024, 10, 5, h) for h in range(14, 20)
    ]


def test_hourly_job_at_half_past_does_not_also_run_at_the_top_of_the_hour() -> None:
    """Regression: 02:30 of the gap used to run at 03:00 CEST as well as 03:30 CEST (two runs 30 min apart)."""
    schedule = cron("30 * * * *", PARIS)
    assert fires(schedule, utc(2024, 3, 30, 23), utc(2024, 3, 31, 3)) == [
        utc(2024, 3, 30, 23, 30),
        utc(2024, 3, 31, 0, 30),  # 01:30 CET
        utc(2024, 3, 31, 1, 30),  # 03:30 CEST
        utc(2024, 3, 31, 2, 30),
    ]
    assert schedule.latest_at_or_before(utc(2024, 3, 31, 1, 29)) == utc(2024, 3, 31, 0, 30)
    assert schedule.next_after(utc(2024, 3, 31, 0, 30)) == utc(2024, 3, 31, 1, 30)
    new_york = cron("20,40 * * * *", NEW_YORK)
    assert fires(new_york, utc(2024, 3, 10, 6), utc(2024, 3, 10, 8)) == [
        utc(2024, 3, 10, 6, 20),
        utc(2024, 3, 10, 6, 40),
        utc(2024, 3, 10, 7, 20),
        utc(2024, 3, 10, 7, 40),
    ]


def test_hourly_job_repeats_the_repeated_hour_on_fall_back() -> None:
    # New York: 05:00Z is 01:00 EDT, 06:00Z is 01:00 EST; both fire.
    assert fires(cron("0 * * * *", NEW_YORK), utc(2024, 11, 3, 3), utc(2024, 11, 3, 8)) == [
        utc(2024, 11, 3, h) for h in range(4, 9)
    ]
    # Paris: 00:00Z is 02:00 CEST, 01:00Z is 02:00 CET.
    assert fires(cron("0 * * * *", PARIS), utc(2024, 10, 26, 22), utc(2024, 10, 27, 3)) == [
        utc(2024, 10, 26, 23),
        utc(2024, 10, 27, 0),
        utc(2024, 10, 27, 1),
        utc(2024, 10, 27, 2),
        utc(2024, 10, 27, 3),
    ]
    assert fires(cron("0 * * * *", SYDNEY), utc(2024, 4, 6, 13), utc(2024, 4, 6, 18)) == [
        utc(2024, 4, 6, h) for h in range(14, 19)
    ]


@pytest.mark.parametrize(
    ("expression", "step"),
    [("*/30 * * * *", 30 * MINUTE), ("*/15 * * * * 0", 15 * MINUTE), ("*/10 * * * *", 10 * MINUTE)],
)
@pytest.mark.parametrize(
    ("zone", "transition"),
    [
        (PARIS, utc(2024, 3, 31, 1)),
        (PARIS, utc(2024, 10, 27, 1)),
        (NEW_YORK, utc(2024, 3, 10, 7)),
        (NEW_YORK, utc(2024, 11, 3, 6)),
        (SYDNEY, utc(2024, 4, 6, 16)),
        (SYDNEY, utc(2024, 10, 5, 16)),
        (LORD_HOWE, utc(2024, 4, 6, 15)),
        (LORD_HOWE, utc(2024, 10, 5, 15, 30)),
    ],
)
def test_frequent_jobs_fire_on_real_elapsed_time(expression: str, step: int, zone: str, transition: int) -> None:
    start = transition - 3 * HOUR
    slots = fires(cron(expression, zone), start, transition + 3 * HOUR)
    assert slots == list(range(start + step, transition + 3 * HOUR + 1, step))


def test_hourly_on_lord_howe() -> None:
    """A 30-minute shift: the top of the hour cannot stay one real hour apart, but no hour is lost or doubled."""
    schedule = cron("0 * * * *", LORD_HOWE)
    # Spring: 01:00 (+1030), then 02:00 is in the gap and runs when 02:00 +1030 would have been
    # (= 02:30 +11, one real hour later), then 03:00 (+11).
    assert fires(schedule, utc(2024, 10, 5, 14), utc(2024, 10, 5, 17)) == [
        utc(2024, 10, 5, 14, 30),
        utc(2024, 10, 5, 15, 30),
        utc(2024, 10, 5, 16),
        utc(2024, 10, 5, 17),
    ]
    # Fall: 01:00 (+11) happens once, 02:00 (+1030) 90 real minutes later.
    assert fires(schedule, utc(2024, 4, 6, 13), utc(2024, 4, 6, 16, 30)) == [
        utc(2024, 4, 6, 14),
        utc(2024, 4, 6, 15, 30),
        utc(2024, 4, 6, 16, 30),
    ]
    # Every 30 minutes keeps a strict 30-minute rhythm through the repeated half hour.
    half_hourly = cron("*/30 * * * *", LORD_HOWE)
    assert fires(half_hourly, utc(2024, 4, 6, 13), utc(2024, 4, 6, 16)) == [
        utc(2024, 4, 6, 13) + k * 30 * MINUTE for k in range(1, 7)
    ]


@pytest.mark.parametrize(
    ("expression", "zone", "t", "expected"),
    [
        # Spring-forward, daily: the gap's slot is 03:00 local.
        ("30 2 * * *", PARIS, utc(2024, 3, 31, 1), utc(2024, 3, 31, 1)),
        ("30 2 * * *", PARIS, utc(2024, 3, 31, 1) - 1, utc(2024, 3, 30, 1, 30)),
        ("30 2 * * *", NEW_YORK, utc(2024, 3, 10, 9), utc(2024, 3, 10, 7)),
        # Fall-back, daily: inside the repeated hour, the newest slot is the first occurrence.
        ("30 2 * * *", PARIS, utc(2024, 10, 27, 1, 45), utc(2024, 10, 27, 0, 30)),
        ("30 2 * * *", PARIS, utc(2024, 10, 27, 0, 29), utc(2024, 10, 26, 0, 30)),
        ("30 1 * * *", NEW_YORK, utc(2024, 11, 3, 6, 45), utc(2024, 11, 3, 5, 30)),
        ("30 1 * * *", NEW_YORK, utc(2024, 11, 3, 6, 30), utc(2024, 11, 3, 5, 30)),
        # Hourly: the second 01:00 in New York is a slot of its own.
        ("0 * * * *", NEW_YORK, utc(2024, 11, 3, 6, 30), utc(2024, 11, 3, 6)),
        ("0 * * * *", NEW_YORK, utc(2024, 11, 3, 5, 59), utc(2024, 11, 3, 5)),
        ("0 * * * *", PARIS, utc(2024, 3, 31, 1, 59), utc(2024, 3, 31, 1)),
        ("30 * * * *", PARIS, utc(2024, 3, 31, 1, 15), utc(2024, 3, 31, 0, 30)),
        ("0 * * * *", LORD_HOWE, utc(2024, 10, 5, 15, 59), utc(2024, 10, 5, 15, 30)),
        ("0 * * * *", LORD_HOWE, utc(2024, 4, 6, 15, 29), utc(2024, 4, 6, 14)),
    ],
)
def test_latest_at_or_before_around_transitions(expression: str, zone: str, t: int, expected: int) -> None:
    assert iso(cron(expression, zone).latest_at_or_before(t)) == iso(expected)


def test_slots_between_on_dst_days() -> None:
    hourly = cron("0 * * * *", NEW_YORK)
    # The local day of 2024-11-03 has 25 hours; of 2024-03-10, 23.
    fall_day = (local(NEW_YORK, 2024, 11, 3) - 1, local(NEW_YORK, 2024, 11, 4) - 1)
    assert hourly.slots_between(*fall_day, 100)[1] == 25
    assert hourly.slots_between(*fall_day, 100)[0] == [local(NEW_YORK, 2024, 11, 3) + k * HOUR for k in range(25)]
    assert hourly.slots_between(*fall_day, 3) == (
        [utc(2024, 11, 4, 2), utc(2024, 11, 4, 3), utc(2024, 11, 4, 4)],
        25,
    )
    spring_day = (local(NEW_YORK, 2024, 3, 10) - 1, local(NEW_YORK, 2024, 3, 11) - 1)
    assert hourly.slots_between(*spring_day, 100)[1] == 23
    assert hourly.slots_between(*spring_day, 2) == ([utc(2024, 3, 11, 2), utc(2024, 3, 11, 3)], 23)
    # A daily job over a week that contains the fall-back night: seven runs, not eight.
    daily = cron("30 2 * * *", PARIS)
    week = (utc(2024, 10, 24), utc(2024, 10, 31))
    assert daily.slots_between(*week, 100) == (fires(daily, *week), 7)
    assert daily.slots_between(*week, 2) == ([utc(2024, 10, 29, 1, 30), utc(2024, 10, 30, 1, 30)], 7)
    # Every 15 minutes (with seconds) across Paris' fall-back: 3 real hours, 12 slots.
    frequent = cron("*/15 * * * * 0", PARIS)
    assert frequent.slots_between(utc(2024, 10, 27), utc(2024, 10, 27, 3), 100)[1] == 12
    recent, count = frequent.slots_between(utc(2024, 10, 27), utc(2024, 10, 27, 3), 4)
    assert (recent, count) == (
        [utc(2024, 10, 27, 2, 15), utc(2024, 10, 27, 2, 30), utc(2024, 10, 27, 2, 45)] + [utc(2024, 10, 27, 3)],
        12,
    )


def test_cron_slots_between_edges() -> None:
    schedule = cron("0 * * * *")
    assert schedule.slots_between(utc(2024, 1, 1), utc(2024, 1, 1), 5) == ([], 0)
    assert schedule.slots_between(utc(2024, 1, 1), utc(2024, 1, 1, 0, 59), 5) == ([], 0)
    assert schedule.slots_between(utc(2024, 1, 1), utc(2024, 1, 1, 1), 5) == ([utc(2024, 1, 1, 1)], 1)
    assert schedule.slots_between(utc(2024, 1, 1), utc(2024, 1, 1, 5), 0) == ([], 5)
    assert schedule.slots_between(utc(2024, 1, 1) - 1, utc(2024, 1, 1, 2), 10) == (
        [utc(2024, 1, 1), utc(2024, 1, 1, 1), utc(2024, 1, 1, 2)],
        3,
    )


def test_slots_between_count_stops_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    assert COUNT_CAP >= 1_000
    monkeypatch.setattr(schedules, "COUNT_CAP", 50)
    every_second = cron("* * * * * *")
    recent, count = every_second.slots_between(utc(2024, 1, 1), utc(2024, 1, 1, 1), 3)
    assert recent == [utc(2024, 1, 1, 1) - 2_000, utc(2024, 1, 1, 1) - 1_000, utc(2024, 1, 1, 1)]
    assert count == 50  # a lower bound: there are 3600
    # Below the cap the count is exact.
    assert every_second.slots_between(utc(2024, 1, 1), utc(2024, 1, 1, 0, 0, 40), 3)[1] == 40


# -- invariants --------------------------------------------------------------------------------


def test_slots_are_whole_strictly_increasing_milliseconds() -> None:
    for zone in (PARIS, NEW_YORK, LORD_HOWE):
        for expression in ("0 * * * *", "30 2 * * *", "30 1 * * *", "*/15 * * * * 0"):
            schedule = cron(expression, zone)
            t = utc(2024, 3, 9) + 123
            previous = t
            for _ in range(150):
                slot = schedule.next_after(t)
                assert type(slot) is int
                assert slot > t and slot > previous
                assert slot % 1000 == 0
                previous = t = slot
            t = utc(2024, 11, 2) + 789
            for _ in range(150):
                slot = schedule.next_after(t)
                assert slot > t and slot % 1000 == 0
                t = slot


def _check_invariants(schedule: CronSchedule, t: int) -> None:
    latest, nxt = schedule.latest_at_or_before(t), schedule.next_after(t)
    assert latest is not None
    assert latest <= t < nxt, (iso(latest), iso(t), iso(nxt))
    # Nothing lies strictly between the two, whichever side you ask from.
    assert schedule.next_after(latest) == nxt, (iso(t), iso(latest))
    assert schedule.next_after(nxt - 1) == nxt
    assert schedule.latest_at_or_before(nxt) == nxt
    assert schedule.latest_at_or_before(nxt - 1) == latest
    if latest < t:
        assert schedule.latest_at_or_before(t - 1) == latest


@pytest.mark.parametrize("zone", [PARIS, NEW_YORK, SYDNEY, LORD_HOWE, "Asia/Kolkata"])
def test_next_and_latest_agree_at_random_instants(zone: str) -> None:
    rnd = random.Random(zone)
    for expression in ("@hourly", "*/30 * * * *", "30 2 * * *", "30 1 * * *", "0 9 * * 1-5", "0 0 L * *"):
        schedule = cron(expression, zone)
        for _ in range(40):
            _check_invariants(schedule, rnd.randrange(utc(2024, 1, 1), utc(2026, 1, 1)))


@pytest.mark.parametrize("zone", [PARIS, NEW_YORK, SYDNEY, LORD_HOWE])
def test_next_and_latest_agree_near_transitions(zone: str) -> None:
    rnd = random.Random(zone + "dst")
    for transition in _transitions(zone, 2024):
        for expression in ("0 * * * *", "30 * * * *", "*/20 * * * *", "30 2 * * *", "30 1 * * *", "45 1,2 * * *"):
            schedule = cron(expression, zone)
            for _ in range(8):
                _check_invariants(schedule, transition + rnd.randrange(-4 * HOUR, 4 * HOUR))


@pytest.mark.parametrize("expression", ["0 * * * *", "*/7 * * * *", "30 2 * * *", "0 0 L * *", "*/15 * * * * 30"])
def test_without_dst_slots_are_croniters(expression: str) -> None:
    """In a zone without DST our layer must not change anything croniter says."""
    rnd = random.Random(expression)
    for zone in ("UTC", "Asia/Kolkata"):
        schedule = cron(expression, zone)
        for _ in range(30):
            t = rnd.randrange(utc(2024, 1, 1), utc(2026, 1, 1)) // 1000 * 1000
            start = datetime.fromtimestamp(t / 1000, UTC).astimezone(ZoneInfo(zone))
            expected_next = croniter(expression, start).get_next(datetime)
            expected_prev = croniter(expression, start + timedelta(seconds=1)).get_prev(datetime)
            assert schedule.next_after(t) == int(expected_next.timestamp()) * 1000
            assert schedule.latest_at_or_before(t) == int(expected_prev.timestamp()) * 1000


# -- against an independent brute-force model of the DST rules --------------------------------


@functools.cache
def _transitions(zone: str, year: int) -> list[int]:
    """UTC instants (ms) at which ``zone`` changed its offset during ``year``."""
    tz = ZoneInfo(zone)

    def offset(s: int) -> timedelta | None:
        return datetime.fromtimestamp(s, UTC).astimezone(tz).utcoffset()

    found = []
    s = int(datetime(year, 1, 1, tzinfo=UTC).timestamp())
    end = int(datetime(year + 1, 1, 1, tzinfo=UTC).timestamp())
    while s < end:
        if offset(s) != offset(s + 900):
            lo, hi = s, s + 900
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if offset(mid) == offset(s) else (lo, mid)
            found.append(hi * 1000)
        s += 900
    return found


def _model(expression: str, zone: str, start_ms: int, end_ms: int) -> list[int]:
    """The slots in ``[start, end]`` by the rules of SPEC §2, computed the slow, obvious way.

    Walk every UTC minute (or second): it is a slot if its local wall time matches and it is
    the first occurrence of that wall time (or the job is hourly). Then, for each gap, the
    wall times that never happened: a daily-style job runs them at the first instant after
    the gap; an hourly job at the instant they would have had on the old offset.
    """
    tz = ZoneInfo(zone)
    expanded = croniter(expression).expanded
    sets = [None if field == ["*"] else set(field) for field in expanded]
    minute, hour, dom, month, dow = sets[:5]
    second = sets[5] if len(sets) > 5 else {0}
    dow = None if dow is None else {d % 7 for d in dow}
    hourly = hour is None or hour >= set(range(24))

    def matches(wall: datetime) -> bool:
        if (second is not None and wall.second not in second) or (minute is not None and wall.minute not in minute):
            return False
        if (hour is not None and wall.hour not in hour) or (month is not None and wall.month not in month):
            return False
        day_ok = dom is None or wall.day in dom
        weekday_ok = dow is None or (wall.weekday() + 1) % 7 in dow
        return (day_ok or weekday_ok) if dom is not None and dow is not None else (day_ok and weekday_ok)

    step = 60 if second == {0} else 1
    slots = set()
    for s in range(start_ms // 1000 // step * step, end_ms // 1000 + 1, step):
        moment = datetime.fromtimestamp(s, UTC).astimezone(tz)
        if matches(moment.replace(tzinfo=None)) and (hourly or moment.fold == 0):
            slots.add(s * 1000)
    for transition in _transitions(zone, datetime.fromtimestamp(start_ms / 1000, UTC).year):
        before = datetime.fromtimestamp(transition / 1000 - 1, UTC).astimezone(tz).utcoffset()
        after = datetime.fromtimestamp(transition / 1000, UTC).astimezone(tz).utcoffset()
        assert before is not None and after is not None
        if after <= before:
            continue  # a fall-back: no gap
        wall = datetime.fromtimestamp(transition / 1000, UTC).replace(tzinfo=None) + before
        while wall < datetime.fromtimestamp(transition / 1000, UTC).replace(tzinfo=None) + after:
            if matches(wall):
                instant = int((wall - before).replace(tzinfo=UTC).timestamp()) * 1000 if hourly else transition
                slots.add(instant)
            wall += timedelta(seconds=step)
    return sorted(s for s in slots if start_ms <= s <= end_ms)


MODEL_EXPRESSIONS = [
    "0 * * * *",
    "30 * * * *",
    "20,40 * * * *",
    "*/30 * * * *",
    "*/15 * * * * 0",
    "30 2 * * *",
    "30 1 * * *",
    "0 2 * * *",
    "15,45 1-3 * * *",
    "0 3 * * *",
    "45 * * * 0",
]


@pytest.mark.parametrize("zone", [PARIS, NEW_YORK, SYDNEY, LORD_HOWE])
def test_matches_the_brute_force_model_around_every_2024_transition(zone: str) -> None:
    rnd = random.Random(zone)
    for transition in _transitions(zone, 2024):
        start, end = transition - 4 * HOUR, transition + 4 * HOUR
        for expression in MODEL_EXPRESSIONS:
            schedule = cron(expression, zone)
            margin = (8 if expression.endswith(" 0") else 2) * 86_400_000  # room for the slots around t
            model = _model(expression, zone, start - margin, end + margin)
            expected = [s for s in model if start < s <= end]
            assert [iso(s) for s in fires(schedule, start, end)] == [iso(s) for s in expected], expression
            for t in [*(rnd.randrange(start, end) for _ in range(12)), *expected, *(s - 1 for s in expected)]:
                i = bisect.bisect_right(model, t)
                assert 0 < i < len(model)
                assert iso(schedule.next_after(t)) == iso(model[i]), (expression, iso(t))
                assert iso(schedule.latest_at_or_before(t)) == iso(model[i - 1]), (expression, iso(t))
