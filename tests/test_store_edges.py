"""The edges of the ownership queries: slots that must not vanish, leases a backlog must not hide.

Each test here stands for a hole found by an adversarial review of the store
(see docs/reliability.md, "Edges"): a manual run taking a scheduled slot's row,
catch-up beyond the free workers, a backlog hiding an expired lease, attempts
without end, runs of jobs nobody declares any more, a frozen claimer's locks.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from django_anarchon import Scheduler, run_now, store
from django_anarchon.exceptions import AttemptsExhausted
from django_anarchon.models import JobState, Run
from django_anarchon.registry import Job
from tests.conftest import vendor

pytestmark = pytest.mark.django_db(transaction=True)

SLOT = 1_800_000_000_000  # 2027-01-15 08:00:00 UTC
TTL = 30.0


def make_job(name: str = "job", every: str = "1s", **options: Any) -> Job:
    scheduler = Scheduler()
    scheduler.every(name, every, lambda ctx: None, **options)
    return scheduler.job(name)


def decide(claims: list[store.Claim], catch_ups: list[store.CatchUp] = (), owner: str = "me", **kw: Any) -> Any:
    kw.setdefault("ttl", TTL)
    kw.setdefault("capacity", 100)
    return store.decide(claims, catch_ups, owner=owner, instance_id=f"i-{owner}", **kw)


def ran(job: Job, slot: int) -> None:
    [run] = decide([store.Claim(job, slot)]).won
    store.finish(run.id, owner="me", status="success")


def expire(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=5))


# -- manual runs have a slot space of their own ----------------------------------------------


def test_a_manual_run_in_the_millisecond_of_a_scheduled_slot_leaves_the_slot_to_the_schedule() -> None:
    job = make_job()
    manual = store.create_manual("job", {"by": "hand"}, slot=SLOT)
    assert manual.slot == SLOT and manual.manual
    [scheduled] = decide([store.Claim(job, SLOT)]).won
    assert (scheduled.slot, scheduled.reason, scheduled.manual) == (SLOT, "scheduled", False)
    assert Run.objects.filter(job="job", slot=SLOT, attempt=1).count() == 2
    # And the other way round: a scheduled row does not push a manual run off its millisecond.
    again = store.create_manual("job", None, slot=SLOT + 1000)
    assert again.slot == SLOT + 1000
    assert store.create_manual("job", None, slot=SLOT).slot == SLOT + 1, "manual runs still get distinct slots"


def test_a_manual_run_is_not_a_scheduled_slot_for_catch_up() -> None:
    """Catch-up counts from the newest *scheduled* slot: manual runs and their takeovers say nothing of it."""
    job = make_job(every="10s")
    ran(job, SLOT)
    manual = store.create_manual("job", None, slot=SLOT + 45_000)
    [run] = store.claim_pending(["job"], {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=1).won
    assert run.pk == manual.pk
    expire(run)
    old, new = store.take_over(run, owner="b", instance_id="i-b", ttl=TTL, start=True)
    assert new is not None and new.manual and new.reason == "takeover"
    store.finish(new.id, owner="b", status="success")
    outcome = decide([], [store.CatchUp(job, until=SLOT + 50_000)], owner="back")
    assert [(r.slot, r.reason) for r in outcome.won] == [(SLOT + 50_000, "catch-up")]
    assert [r.slot for r in outcome.missed] == [SLOT + 40_000], "the slots after SLOT were missed, manual run or not"


def test_run_now_dates_the_run_by_the_database_clock_not_the_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    from django_anarchon import scheduler as default

    default.every("dated", "10000d", lambda ctx: None)
    try:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600)  # the caller's clock is an hour fast
        run = run_now("dated")
        monkeypatch.undo()
        gap = abs((run.scheduled_at - store.database_time()).total_seconds())
        assert gap < 5, f"the manual run is dated {gap:.0f}s away from the database clock"
    finally:
        default.registry.remove("dated")


# -- catch-up beyond the free workers --------------------------------------------------------


def test_catch_up_beyond_the_free_workers_waits_as_pending_runs_instead_of_vanishing() -> None:
    jobs = [make_job(f"j{n}", every="10s") for n in range(5)]
    for job in jobs:
        ran(job, SLOT)
    outcome = decide([], [store.CatchUp(job, until=SLOT + 30_000) for job in jobs], owner="back", capacity=2)
    assert len(outcome.won) == 2 and outcome.deferred == []
    waiting = Run.objects.filter(status="pending", reason="catch-up", slot=SLOT + 30_000)
    owed = sorted({j.name for j in jobs} - {r.job for r in outcome.won})
    assert sorted(waiting.values_list("job", flat=True)) == owed, "every job's latest missed slot is owed a run"
    assert "free worker" in waiting.first().detail
    later = store.claim_pending(
        [j.name for j in jobs], {j.name: j for j in jobs}, owner="other", instance_id="i-o", ttl=TTL, capacity=5
    )
    assert sorted(r.job for r in later.won) == owed, "another instance with free workers runs them"
    assert {r.detail for r in later.won} == {"waited for a free worker (MAX_WORKERS)"}, "no longer 'waiting'"
    assert Run.objects.filter(reason="catch-up").count() == 5
    assert not Run.objects.filter(status="pending").exists()


def test_catch_up_all_beyond_the_free_workers_runs_every_missed_slot_later() -> None:
    job = make_job(every="10s", catch_up="all")
    ran(job, SLOT)
    outcome = decide([], [store.CatchUp(job, until=SLOT + 30_000)], owner="back", capacity=0)
    assert outcome.won == [] and outcome.deferred == []
    pending = list(Run.objects.filter(status="pending").order_by("slot").values_list("slot", flat=True))
    assert pending == [SLOT + 10_000, SLOT + 20_000, SLOT + 30_000]


# -- a backlog never hides an expired lease --------------------------------------------------


def test_an_expired_lease_is_found_behind_a_backlog_of_pending_runs() -> None:
    victim = make_job("victim")
    [run] = decide([store.Claim(victim, SLOT + 500_000)], ttl=0.001).won
    # Hundreds of pending runs with older slots: run_now calls queued behind a long job,
    # an outage's catch-up, and the runs of a job nobody declares any more.
    Run.objects.bulk_create(
        Run(job=name, slot=SLOT + n, attempt=1, status="pending", reason="manual", manual=True,
            scheduled_at=store.slot_datetime(SLOT + n))
        for name in ("queued", "ghost")
        for n in range(300)
    )  # fmt: skip
    time.sleep(0.01)
    found = store.poll()
    assert [r.pk for r in found.expiring] == [run.pk]
    assert sorted(found.pending_jobs) == ["ghost", "queued"], "a backlog is one entry per job"
    old, new = store.take_over(found.expiring[0], owner="backup", instance_id="i-b", ttl=TTL, start=True)
    assert old.status == "interrupted" and new is not None and new.attempt == 2


def test_the_poll_also_returns_leases_about_to_expire() -> None:
    job = make_job()
    [soon] = decide([store.Claim(job, SLOT)], ttl=2.0).won
    assert store.poll().expiring == []
    assert [r.pk for r in store.poll(expiring_within=5.0).expiring] == [soon.pk]


# -- attempts of one slot are capped ------------------------------------------------------------


def _attempt(job: Job, attempt: int) -> Run:
    run = decide([store.Claim(job, SLOT)], ttl=0.001).won[0]
    Run.objects.filter(pk=run.pk).update(attempt=attempt)
    run.refresh_from_db()
    return run


def test_a_takeover_of_the_last_allowed_attempt_records_the_slot_failed() -> None:
    job = make_job()
    run = _attempt(job, 3)
    time.sleep(0.01)
    old, new = store.take_over(run, owner="b", instance_id="i-b", ttl=TTL, start=True, max_attempts=3)
    assert new is None
    assert old.status == "failed" and old.lease_expires_at is None
    assert old.error_type == "django_anarchon.exceptions.AttemptsExhausted"
    assert "gave up after 3 attempt(s) (MAX_ATTEMPTS=3)" in old.error_message
    assert "lease expired" in old.error_message
    assert not Run.objects.filter(attempt=4).exists()
    assert store.take_over(run, owner="c", instance_id="i-c", ttl=TTL, start=True, max_attempts=3) is None


def test_a_takeover_below_the_cap_starts_the_next_attempt() -> None:
    run = _attempt(make_job(), 2)
    time.sleep(0.01)
    old, new = store.take_over(run, owner="b", instance_id="i-b", ttl=TTL, start=True, max_attempts=3)
    assert old.status == "interrupted" and new is not None and new.attempt == 3


def test_a_hand_over_of_the_last_allowed_attempt_records_the_slot_failed() -> None:
    job = make_job()
    [run] = decide([store.Claim(job, SLOT)]).won
    Run.objects.filter(pk=run.pk).update(attempt=5)
    old, new = store.hand_over(run.id, owner="me", detail="stopping", max_attempts=5)
    assert new is None and old.status == "failed" and "MAX_ATTEMPTS=5" in old.error_message
    assert "stopped with its instance" in old.error_message
    assert Run.objects.count() == 1


def test_a_hand_over_on_sqlite_takes_the_write_lock_first_so_another_process_writing_meanwhile_is_waited_for() -> None:
    """Its transaction read first (the attempt, for MAX_ATTEMPTS) and wrote after: on SQLite, another
    process's commit in between made the write fail at once with "database is locked", whatever the
    busy timeout (a stale read snapshot cannot be waited out), and the recorder logged a database error
    at every stop beside a second instance (helper 40)."""
    import sqlite3

    if vendor() != "sqlite":
        pytest.skip("SQLite's read-then-write upgrade; the other databases lock the row")
    job = make_job()
    [run] = decide([store.Claim(job, SLOT)]).won
    other = sqlite3.connect(connection.settings_dict["NAME"], timeout=0.2, isolation_level=None)
    wrote: list[bool] = []

    def after_the_first_statement(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if not wrote and not sql.startswith(("BEGIN", "SAVEPOINT")):
            # Another process commits between this transaction's first statement and the rest.
            try:
                other.execute("UPDATE django_anarchon_jobstate SET lock_seq = lock_seq + 1")
                wrote.append(True)
            except sqlite3.OperationalError:  # the hand-over holds the write lock: it waits for it
                wrote.append(False)
        return result

    try:
        with connection.execute_wrapper(after_the_first_statement):
            old, new = store.hand_over(run.id, owner="me", detail="stopping", max_attempts=5)
    finally:
        other.close()
    assert wrote == [False], "the other process wrote inside the hand-over's transaction"
    assert old.status == "interrupted" and new is not None and new.attempt == 2


def test_attempts_exhausted_is_public_and_an_anarchon_error() -> None:
    from django_anarchon import AnarchonError
    from django_anarchon import AttemptsExhausted as public

    assert public is AttemptsExhausted and issubclass(public, AnarchonError)


# -- runs of jobs no instance declares any more -------------------------------------------------


def test_waiting_runs_of_a_job_no_instance_declares_are_closed_after_the_grace() -> None:
    gone, here = make_job("gone"), make_job("here")
    store.ensure_jobs([gone, here])
    pending = store.create_manual("gone", None, slot=SLOT)
    [abandoned] = decide([store.Claim(gone, SLOT + 1000)], ttl=0.001).won
    [held] = decide([store.Claim(make_job("gone", overlap="allow"), SLOT + 2000)], ttl=TTL).won
    kept = store.create_manual("here", None, slot=SLOT)
    time.sleep(0.01)
    assert store.close_undeclared(3600) == {}, "declared a moment ago: nothing is closed"
    JobState.objects.filter(name="gone").update(declared_at=timezone.now() - timedelta(hours=4))
    assert store.close_undeclared(3 * 3600) == {"gone": 2}
    assert Run.objects.get(pk=pending.pk).status == "missed"
    closed = Run.objects.get(pk=abandoned.pk)
    assert closed.status == "interrupted" and "no running instance has declared this job" in closed.detail
    assert Run.objects.get(pk=held.pk).status == "running", "a live lease is someone's: left alone"
    assert Run.objects.get(pk=kept.pk).status == "pending"
    store.ensure_jobs([gone])  # an instance declaring it again
    assert JobState.objects.get(name="gone").declared_at > timezone.now() - timedelta(minutes=1)


def test_a_cancelled_pending_run_is_recorded_skipped_and_a_started_one_is_left_alone() -> None:
    job = make_job()
    waiting = store.create_manual("job", None, slot=SLOT)
    [running] = decide([store.Claim(job, SLOT + 1000)]).won
    cancelled = store.cancel_pending([waiting.pk, running.pk], "cancelled by ann in the admin")
    assert [r.pk for r in cancelled] == [waiting.pk]
    row = Run.objects.get(pk=waiting.pk)
    assert row.status == "skipped" and row.detail == "cancelled by ann in the admin" and row.finished_at
    assert Run.objects.get(pk=running.pk).status == "running"


# -- a frozen claimer's locks are bounded --------------------------------------------------------


def test_a_claimer_idle_in_its_transaction_loses_its_locks_after_about_a_lease() -> None:
    """A process frozen inside a multi-statement claim must not hold the job's row for ever."""
    if vendor() == "sqlite":
        pytest.skip(
            "not applicable to SQLite: a frozen writer holds the database file's lock until it resumes, "
            "and nothing in SQLite can time it out (docs/guarantees.md)"
        )
    job = make_job()
    store.ensure_jobs([job])
    locked = threading.Event()
    errors: list[BaseException] = []

    def frozen_claimer() -> None:
        try:
            store.limit_idle_transactions(1.0)
            with transaction.atomic():
                store.lock_jobs(["job"])
                locked.set()
                time.sleep(6)  # frozen: no statement, the transaction left open
        except BaseException as error:  # noqa: B036 - the server ended the session, as it should
            errors.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=frozen_claimer)
    thread.start()
    assert locked.wait(10)
    began = time.monotonic()
    outcome = decide([store.Claim(job, SLOT)])
    waited = time.monotonic() - began
    thread.join(15)
    assert [r.slot for r in outcome.won] == [SLOT]
    assert waited < 4.0, f"the claim waited {waited:.1f}s for a frozen claimer's lock (limit 1 s)"
    assert errors, "the frozen claimer's session was ended by the server"


def test_the_idle_transaction_limit_is_set_once_per_connection() -> None:
    store.limit_idle_transactions(2.5)
    if vendor() == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SHOW idle_in_transaction_session_timeout")
            assert cursor.fetchone()[0] in ("2500ms", "2500")
    elif vendor() == "mariadb":
        with connection.cursor() as cursor:
            cursor.execute("SELECT @@SESSION.idle_transaction_timeout")
            assert int(cursor.fetchone()[0]) == 3
    with connection.execute_wrapper(lambda *a: pytest.fail("a second SET on the same connection")):
        store.limit_idle_transactions(2.5)
