"""The slot queue, the share-out and plan_due, as pure functions of the times given to them."""

from __future__ import annotations

from collections import Counter

import pytest

from django_anarchon.registry import Job, build_job
from django_anarchon.schedules import IntervalSchedule, cron_schedule
from django_anarchon.slots import (
    BACKUP_AHEAD_MS,
    BACKUP_WINDOW_MS,
    SHED_DETAIL,
    DuePlan,
    ShareOut,
    SlotQueue,
    draw_claim_ahead,
    first_current,
    plan_due,
)
from django_anarchon.store import Outcome

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


def test_every_current_slot_is_claimed_as_scheduled_one_plan_at_a_time() -> None:
    """With jobs more frequent than the grace (or the claim-ahead), several slots are current at once:
    each is claimed as scheduled in a plan of its own, oldest first, and none goes to catch-up (where
    catch_up='none' counted it missed while the instance ran, and 'latest' ran it as a catch-up)."""
    grace = 2_000
    assert plan_due(SECOND, T, T + 1_500, grace) == DuePlan(T, None, T + 1_000)
    assert plan_due(SECOND, T + 1_000, T + 1_500, grace) == DuePlan(T + 1_000, None, T + 2_000)
    assert plan_due(SECOND, T + 2_000, T + 1_500, grace) == DuePlan(None, None, T + 2_000)
    # The oldest is past its grace: it goes to catch-up, and the first current one after it is claimed.
    assert plan_due(SECOND, T, T + 2_100, grace) == DuePlan(T + 1_000, T, T + 2_000)
    assert plan_due(SECOND, T, T + 900, grace) == DuePlan(T, None, T + 1_000), "one slot due: nothing else"


def test_a_turn_whose_claim_ahead_spans_several_slots_of_a_job_claims_each_of_them() -> None:
    every_100ms = build_job("interval", "often", "100ms", lambda ctx: None, {})
    queue = queue_at([every_100ms], {"often": SLOT}, claim_ahead_ms=250)
    batch = queue.take_due(SLOT, 500, lambda name, slot: True)
    assert [claim.slot for claim in batch.claims] == [SLOT, SLOT + 100, SLOT + 200]
    assert all(claim.reason == "scheduled" for claim in batch.claims) and batch.catch_ups == []
    assert batch.previous == {"often": SLOT}, "undecided, the job is looked at again from its oldest slot"
    assert queue.next_slot("often") == SLOT + 300


def test_an_instance_starting_claims_the_newest_slot_within_the_grace_and_catches_up_the_rest() -> None:
    grace = 2_000
    # Restarted 0.4 s after T+5s: T+5s is current; T+3s and T+4s, within the grace too, are for catch-up.
    assert first_current(SECOND, T + 5_400, grace) == T + 5_000
    queue = SlotQueue([build_job("interval", "a", "1s", lambda ctx: None, {})])
    queue.seed(T + 5_400, grace)
    assert queue.next_slot("a") == T + 5_000
    # Past the grace: nothing due is current, the next slot is the first.
    assert first_current(SECOND, T + 5_400, 300) == T + 6_000
    assert first_current(SECOND, T + 5_000, 0) == T + 5_000, "a slot due this very instant is current"


def test_cron_plans_follow_the_dst_rules() -> None:
    daily = cron_schedule("30 2 * * *", "Europe/Paris")
    gap_day = 1_711_846_800_000  # 2024-03-31 01:00 UTC = 03:00 CEST, the first instant after the gap
    before = daily.next_after(gap_day - 3_600_000)
    assert before == gap_day
    plan = plan_due(daily, before, gap_day + 100, GRACE)
    assert plan.claim == gap_day and plan.catch_up_until is None
    assert plan.next_slot == 1_711_931_400_000  # 2024-04-01 02:30 CEST


# -- the share-out ---------------------------------------------------------------------------

SLOT = 1_800_000_000_000


def jobs(count: int, every: str = "1s") -> list[Job]:
    return [build_job("interval", f"job-{n}", every, lambda ctx: None, {}) for n in range(count)]


def shares(instances: int, declared: list[Job]) -> list[ShareOut]:
    tokens = [f"token-{n}" for n in range(instances)]
    found = [ShareOut([job.name for job in declared], token) for token in tokens]
    for share in found:
        share.update(tokens)
    return found


def test_each_slot_has_one_preferred_instance_and_the_instances_share_them_evenly() -> None:
    """Of the jobs due at an instant, each instance gets as many as the others, to one.

    A hash per (job, slot) shared them out only on average: one of three instances
    often got over 40 of 100, and its handlers started last.
    """
    declared = jobs(100)
    three = shares(3, declared)
    firsts: Counter[str] = Counter()
    for slot in range(SLOT, SLOT + 10_000, 1000):
        counts: Counter[str] = Counter()
        for job in declared:
            preferred = [share.token for share in three if share.preferred(job.name, slot)]
            assert len(preferred) == 1, f"{job.name}@{slot} is preferred by {preferred}"
            counts[preferred[0]] += 1
        assert sorted(counts.values()) == [33, 33, 34], f"uneven share of slot {slot}: {counts}"
        firsts[next(share.token for share in three if share.preferred("job-0", slot))] += 1
    assert len(firsts) > 1, "a job's slots go to different instances over time"
    # Jobs due together are often a subset (other jobs have other intervals): still about even.
    subset = [job.name for n, job in enumerate(declared) if n % 4 == 0]
    for slot in range(SLOT, SLOT + 10_000, 1000):
        counts = Counter(next(share.token for share in three if share.preferred(name, slot)) for name in subset)
        assert max(counts.values()) <= 13, f"uneven share of 25 jobs at {slot}: {counts}"
    [alone] = shares(1, declared[:5])
    assert all(alone.preferred(job.name, SLOT) for job in declared[:5]), "an instance alone claims everything"


def test_an_instance_counts_itself_among_the_live_ones() -> None:
    share = ShareOut(["a"], "me")
    share.update(["other"])
    assert share.peers == ("me", "other")
    share.update([])
    assert share.peers == ("me",) and share.preferred("a", SLOT)


@pytest.mark.parametrize(("claim_ms", "first"), [(2.0, 90), (30.0, 90), (60.0, 120), (500.0, 250)])
@pytest.mark.parametrize("jitter", [0.0, 20.0])
def test_every_instance_claims_other_shares_after_every_first_pass(claim_ms: float, first: int, jitter: float) -> None:
    """The backup lead is the same everywhere and below every first lead, whatever the claim times.

    A backup lead that grew with the claim time let the instance writing the most
    rows take the shares of the fastest one, which then won nothing at all.
    """
    lead = draw_claim_ahead(claim_ms, jitter)
    assert (BACKUP_AHEAD_MS, BACKUP_WINDOW_MS) == (30, 20)
    assert lead == first + int(jitter)
    assert lead >= BACKUP_AHEAD_MS + BACKUP_WINDOW_MS + 40, "a peer's first pass comes well before"
    assert lead >= min(2 * claim_ms, 250), "its own claims commit before the slot"


# -- the slot queue --------------------------------------------------------------------------


def queue_at(declared: list[Job], slots: dict[str, int], claim_ahead_ms: int = 80) -> SlotQueue:
    queue = SlotQueue(declared)
    queue.claim_ahead_ms = claim_ahead_ms
    for name, slot in slots.items():
        queue.push(slot, name, slot)
    return queue


def test_an_instance_claims_its_share_first_and_the_rest_just_before_the_slot() -> None:
    declared = jobs(60)
    mine_share = shares(3, declared)[0]
    queue = queue_at(declared, {job.name: SLOT for job in declared})
    mine = sorted(job.name for job in declared if mine_share.preferred(job.name, SLOT))
    assert 0 < len(mine) < 60
    assert queue.due(SLOT - 80)
    first = queue.take_due(SLOT - 80, 500, mine_share.preferred)
    assert sorted(c.job.name for c in first.claims) == mine, "the first pass claims this instance's share only"
    assert not queue.due(SLOT - 80 + 49), "the others' share waits for the backup lead"
    assert queue.due(SLOT - 30)
    second = queue.take_due(SLOT - 30, 500, mine_share.preferred)
    assert sorted(c.job.name for c in second.claims) == sorted(set(queue.jobs) - set(mine)), "then the rest"
    assert not queue.due(SLOT - 30) and all(queue.next_slot(name) == SLOT + 1000 for name in queue.jobs)


def test_backup_looks_due_close_together_share_one_statement() -> None:
    """Other instances' slots due within BACKUP_WINDOW_MS of each other are looked at in one claim.

    Each backup look took its own round trip; with several instances they are most of the
    statements a cluster sends (each instance looks at every slot not in its share), and
    nearly all of them find the slot decided. Jobs due at distinct instants 2 ms apart,
    walked one millisecond at a time: the instance's own slots are claimed at the first
    lead, the others' no earlier than the backup lead plus the window (still well after
    their own instance's first pass) and no later than the backup lead, a few per statement.
    """
    declared = jobs(60)
    share = shares(3, declared)[0]
    slots = {job.name: SLOT + 2 * n for n, job in enumerate(declared)}
    queue = queue_at(declared, slots, claim_ahead_ms=90)
    calls: list[tuple[int, list[tuple[str, int]]]] = []
    for now in range(SLOT - 200, SLOT + 200):
        if queue.due(now):
            batch = queue.take_due(now, 500, share.preferred)
            if batch:
                calls.append((now, [(claim.job.name, claim.slot) for claim in batch.claims]))
    looked = [(at, name, slot) for at, claims in calls for name, slot in claims]
    assert sorted((name, slot) for _, name, slot in looked) == sorted(slots.items()), "each slot exactly once"
    own = [(at, slot) for at, name, slot in looked if share.preferred(name, slot)]
    backups = [(at, slot) for at, name, slot in looked if not share.preferred(name, slot)]
    assert 10 < len(own) < 30 and len(backups) > 30
    assert all(at == slot - 90 for at, slot in own), "own share at the first lead"
    assert all(slot - 30 - BACKUP_WINDOW_MS <= at <= slot - 30 for at, slot in backups), backups
    assert all(at >= slot - 90 + 40 for at, slot in backups), "a peer's first pass comes well before"
    statements = {at for at, name, slot in looked if not share.preferred(name, slot)}
    assert len(statements) <= len(backups) / 4, f"{len(backups)} backup looks in {len(statements)} statements"


def test_retried_slots_leave_no_stale_entries_behind_in_the_heaps() -> None:
    declared = jobs(3, every="500ms")
    queue = queue_at(declared, {job.name: SLOT for job in declared})
    always = lambda name, slot: True  # noqa: E731
    for attempt in range(5):  # the database is down: every batch fails and is retried 50 ms later
        now = SLOT - 80 + attempt * 50
        batch = queue.take_due(now, 500, always)
        assert len(batch.claims) == 3
        queue.failed(batch, now + 50)
    assert queue.live() == 3, "one live entry per job"
    assert len(queue) <= 3 + 5 * 3
    for now in (SLOT - 80 + 250, SLOT + 500 - 80):  # the database is back, and the next slot comes
        batch = queue.take_due(now, 500, always)
        assert len(batch.claims) == 3
        queue.settle(batch, Outcome(), now, now)
    assert queue.live() == 3 and len(queue) <= 6, "stale entries are dropped as they surface"


def test_a_busy_jobs_slot_is_looked_at_again_and_an_early_one_at_its_slot() -> None:
    declared = jobs(2)
    queue = queue_at(declared, {"job-0": SLOT, "job-1": SLOT})
    batch = queue.take_due(SLOT - 80, 500, lambda name, slot: True)
    early = [c for c in batch.claims if c.job.name == "job-1"]
    queue.settle(batch, Outcome(busy=["job-0"], early=early), SLOT - 80, SLOT - 60)
    assert queue.next_slot("job-0") == SLOT and queue.next_slot("job-1") == SLOT
    assert [c.job.name for c in queue.take_due(SLOT - 60, 500, lambda n, s: True).claims] == ["job-0"]
    assert not queue.due(SLOT - 1) or not queue.take_due(SLOT - 1, 500, lambda n, s: True).claims
    assert [c.job.name for c in queue.take_due(SLOT, 500, lambda n, s: True).claims] == ["job-1"], "decided at the slot"


def test_a_slot_due_with_no_free_worker_runs_late_until_the_next_slot_then_is_shed() -> None:
    declared = jobs(1)
    queue = queue_at(declared, {"job-0": SLOT})
    always = lambda name, slot: True  # noqa: E731
    batch = queue.take_due(SLOT - 80, 500, always)
    assert queue.settle(batch, Outcome(deferred=batch.claims), SLOT - 80, SLOT), "room wanted"
    # A worker frees up 700 ms late, past the grace: still owed, claimed as scheduled.
    late = queue.take_due(SLOT + 700, 500, always)
    assert [(c.slot, c.reason, c.shed) for c in late.claims] == [(SLOT, "scheduled", "")]
    queue.settle(late, Outcome(deferred=late.claims), SLOT + 700, SLOT + 700)
    # None until after the next slot: the old one is shed (recorded skipped), the new one claimed.
    later = queue.take_due(SLOT + 1100, 500, always)
    assert [(c.slot, c.shed) for c in later.claims] == [(SLOT, SHED_DETAIL), (SLOT + 1000, "")]
    assert later.catch_ups == [], "an instance that never stopped does not catch itself up"


def test_an_owed_batch_left_undecided_offers_its_shed_slots_again() -> None:
    # The job's row was locked by another instance (busy), or the database failed: the slot
    # the batch would have shed is offered again, not lost with the batch.
    declared = jobs(1)
    always = lambda name, slot: True  # noqa: E731
    for undecided in ("busy", "failed"):
        queue = queue_at(declared, {"job-0": SLOT})
        batch = queue.take_due(SLOT - 80, 500, always)
        queue.settle(batch, Outcome(deferred=batch.claims), SLOT - 80, SLOT)
        owed = queue.take_due(SLOT + 1_100, 500, always)
        assert [(c.slot, c.shed) for c in owed.claims] == [(SLOT, SHED_DETAIL), (SLOT + 1000, "")]
        if undecided == "busy":
            queue.settle(owed, Outcome(busy=["job-0"]), SLOT + 1_100, SLOT + 1_150)
        else:
            queue.failed(owed, SLOT + 1_150)
        again = queue.take_due(SLOT + 1_150, 500, always)
        assert [(c.slot, c.shed) for c in again.claims] == [(SLOT, SHED_DETAIL), (SLOT + 1000, "")], undecided


def test_at_a_stop_the_owed_slots_overtaken_by_their_next_are_offered_to_shed_and_no_others() -> None:
    """A stop with every worker busy left the owed slots with no record at all (CI on dbb4fd7):
    they are shed only on their job's next look, and nobody else looks at a slot once it has come."""
    declared = jobs(3)
    always = lambda name, slot: True  # noqa: E731
    queue = queue_at(declared, {"job-0": SLOT, "job-1": SLOT, "job-2": SLOT + 2_000})
    batch = queue.take_due(SLOT - 80, 500, always)
    queue.settle(batch, Outcome(deferred=[c for c in batch.claims if c.job.name == "job-0"]), SLOT - 80, SLOT)
    queue.note_no_room(SLOT + 100)  # job-1's slot was decided (won); from here no worker is free
    shed = queue.overtaken(SLOT + 2_500)
    # job-0: owed from SLOT, its slots up to the one still current (SLOT + 2000) are overtaken;
    # job-1: its next slot (SLOT + 1000) came with no free worker, overtaken by SLOT + 2000;
    # job-2: its slot is still current.
    assert sorted((c.job.name, c.slot, c.shed) for c in shed) == [
        ("job-0", SLOT, SHED_DETAIL),
        ("job-0", SLOT + 1_000, SHED_DETAIL),
        ("job-1", SLOT + 1_000, SHED_DETAIL),
    ]
    fresh = queue_at(declared, {"job-0": SLOT, "job-1": SLOT, "job-2": SLOT})
    assert fresh.overtaken(SLOT + 5_000) == [], "slots not owed here (frozen, not short of workers): catch-up's"


def test_slots_due_while_every_worker_was_busy_are_owed_not_missed() -> None:
    declared = jobs(1)
    queue = queue_at(declared, {"job-0": SLOT})
    always = lambda name, slot: True  # noqa: E731
    queue.note_no_room(SLOT - 100)  # every worker busy from before the slot to well after it
    batch = queue.take_due(SLOT + 2_600, 500, always)
    shed = [(SLOT, SHED_DETAIL), (SLOT + 1000, SHED_DETAIL)]
    assert [(c.slot, c.shed) for c in batch.claims] == [*shed, (SLOT + 2000, "")]
    assert batch.catch_ups == []
    queue.settle(batch, Outcome(), SLOT + 2_600, SLOT + 2_600)
    # Room again: a slot missed afterwards (the instance was frozen) goes to catch-up as usual.
    after = queue.take_due(SLOT + 10_000, 500, always)
    assert after.catch_ups and after.catch_ups[0].until == SLOT + 9_000
    # It says which slot it came to late: the store records the undecided ones from there as
    # overtaken if the job's next slot was decided meanwhile (tests/test_store.py).
    assert after.catch_ups[0].since == SLOT + 3_000
