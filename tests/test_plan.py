"""What the loop does with a due job at a given time (plan_due), with injected times."""

from __future__ import annotations

from django_anarchon.engine import DuePlan, plan_due
from django_anarchon.schedules import IntervalSchedule, cron_schedule

SECOND = IntervalSchedule(1000)
T = 1_800_000_000_000
GRACE = 400


def test_nothing_is_due_before_the_slot() -> None:
    assert plan_due(SECOND, T, T - 1, GRACE) == DuePlan(None, None, T)


def test_a_current_slot_is_claimed_as_scheduled() -> None:
    assert plan_due(SECOND, T, T, GRACE) == DuePlan(T, None, T + 1000)
    assert plan_due(SECOND, T, T + GRACE, GRACE) == DuePlan(T, None, T + 1000)


def test_a_slot_older_than_the_grace_goes_to_catch_up() -> None:
    assert plan_due(SECOND, T, T + GRACE + 1, GRACE) == DuePlan(None, T, T + 1000)


def test_after_falling_behind_the_newest_slot_is_current_and_the_rest_go_to_catch_up() -> None:
    # Frozen or cut off for ten seconds: slots T .. T+10s are due at T+10.1s.
    assert plan_due(SECOND, T, T + 10_100, GRACE) == DuePlan(T + 10_000, T + 9_000, T + 11_000)
    # ... and if even the newest is too old, everything goes to catch-up.
    assert plan_due(SECOND, T, T + 10_500, GRACE) == DuePlan(None, T + 10_000, T + 11_000)


def test_cron_plans_follow_the_dst_rules() -> None:
    daily = cron_schedule("30 2 * * *", "Europe/Paris")
    gap_day = 1_711_846_800_000  # 2024-03-31 01:00 UTC = 03:00 CEST, the first instant after the gap
    before = daily.next_after(gap_day - 3_600_000)
    assert before == gap_day
    plan = plan_due(daily, before, gap_day + 100, GRACE)
    assert plan.claim == gap_day and plan.catch_up_until is None
    assert plan.next_slot == 1_711_931_400_000  # 2024-04-01 02:30 CEST
