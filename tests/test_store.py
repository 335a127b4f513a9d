"""The queries that decide ownership, tested against the real database.

Times are injected: slots are chosen by the test, and leases are made to expire
by claiming with a lease of a few milliseconds. Concurrency tests use threads,
each with its own database connection, released together by a barrier.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connections
from django.db.models import F
from django.utils import timezone

from django_anarchon import Scheduler, metrics, store
from django_anarchon.models import JobState, Run
from django_anarchon.registry import Job
from django_anarchon.slots import BEHIND_DETAIL

pytestmark = pytest.mark.django_db(transaction=True)

SLOT = 1_800_000_000_000  # 2027-01-15 08:00:00 UTC, a multiple of every interval used here
TTL = 30.0


def make_job(name: str = "job", every: str = "1s", **options: Any) -> Job:
    scheduler = Scheduler()
    scheduler.every(name, every, lambda ctx: None, **options)
    return scheduler.job(name)


def decide(
    claims: list[store.Claim], catch_ups: list[store.CatchUp] = (), owner: str = "me", **kw: Any
) -> store.Outcome:
    kw.setdefault("ttl", TTL)
    kw.setdefault("capacity", 100)
    return store.decide(claims, catch_ups, owner=owner, instance_id=f"i-{owner}", **kw)


def expire(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=5))


def race(count: int, action: Callable[[int], Any]) -> list[Any]:
    """Run ``action(i)`` in ``count`` threads released at once; return their results."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            barrier.wait()
            results[index] = action(index)
        except BaseException as error:  # noqa: B036 - reported below
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


# -- claiming scheduled slots ----------------------------------------------------------------


def test_a_claim_inserts_a_running_row_with_a_lease_on_the_database_clock() -> None:
    job = make_job(data={"k": 1})
    outcome = decide([store.Claim(job, SLOT)])
    [run] = outcome.won
    assert (run.job, run.slot, run.attempt, run.status, run.reason) == ("job", SLOT, 1, "running", "scheduled")
    assert run.owner == "me" and run.instance_id == "i-me" and run.data == {"k": 1}
    assert run.scheduled_at == store.slot_datetime(SLOT)
    db_now = store.database_time()
    assert db_now + timedelta(seconds=TTL - 2) < run.lease_expires_at <= db_now + timedelta(seconds=TTL)
    assert JobState.objects.filter(name="job").exists()


def test_a_slot_already_decided_is_left_alone() -> None:
    job = make_job()
    assert decide([store.Claim(job, SLOT)], owner="a").won
    second = decide([store.Claim(job, SLOT)], owner="b")
    assert second.won == [] and second.skipped == []
    assert Run.objects.count() == 1


@pytest.mark.parametrize("contenders", [8])
def test_exactly_one_winner_among_concurrent_claimers(contenders: int) -> None:
    jobs = [make_job(f"job-{n}", overlap="allow") for n in range(5)]
    claims = [store.Claim(job, SLOT + k * 1000) for job in jobs for k in range(3)]
    outcomes = race(contenders, lambda i: decide(claims, owner=f"o{i}"))
    won = [(r.job, r.slot) for outcome in outcomes for r in outcome.won]
    assert sorted(won) == sorted((c.job.name, c.slot) for c in claims), "every slot won exactly once"
    assert Run.objects.count() == len(claims)


@pytest.mark.parametrize("overlap", ["skip", "allow"])
def test_exactly_one_winner_when_contenders_skip_locked_jobs_and_retry(overlap: str) -> None:
    """What the loop does: jobs another claimer holds come back busy and are tried again."""
    jobs = [make_job(f"job-{n}", overlap=overlap) for n in range(6)]
    store.ensure_jobs(jobs)
    claims = [store.Claim(job, SLOT) for job in jobs]

    def claimer(i: int) -> list[tuple[str, int]]:
        won, todo = [], claims
        for _ in range(500):
            outcome = decide(todo, owner=f"o{i}", skip_locked=True)
            won += [(r.job, r.slot) for r in outcome.won]
            todo = [c for c in todo if c.job.name in outcome.busy]
            if not todo:
                return won
            time.sleep(0.002)
        raise AssertionError(f"still busy after 500 tries: {todo}")

    won = [pair for pairs in race(8, claimer) for pair in pairs]
    assert sorted(won) == sorted((c.job.name, c.slot) for c in claims), "every slot won exactly once"
    assert Run.objects.count() == len(claims)


def test_default_data_is_used_when_the_job_has_none() -> None:
    outcome = decide([store.Claim(make_job(), SLOT)], default_data={"scheduler": True})
    assert outcome.won[0].data == {"scheduler": True}


def test_values_a_claim_writes_into_its_statement_arrive_as_sent() -> None:
    """Quotes, backslashes, percent signs and non-ASCII text in names, instance ids and data.

    On MariaDB the claim's INSERT carries its values escaped in the statement's text
    (as the driver would have), once per distinct value; elsewhere they go as parameters.
    """
    odd = ['50% o\'clock \\ "done" %s %(x)s', "tâche-été ✓ ; DROP TABLE x; --", "plain"]
    jobs = [make_job(name, data={"note": name, "pct": "100%", "n": n}) for n, name in enumerate(odd)]
    owner = "o'wner %s \\"
    outcome = decide([store.Claim(job, SLOT) for job in jobs], owner=owner, default_data={"unused": True})
    assert sorted(r.job for r in outcome.won) == sorted(odd)
    for n, name in enumerate(odd):
        stored = Run.objects.get(job=name, slot=SLOT)
        assert stored.data == {"note": name, "pct": "100%", "n": n}
        assert stored.owner == owner and stored.instance_id == f"i-{owner}" and stored.status == "running"
        assert stored.scheduled_at == store.slot_datetime(SLOT) and stored.lease_expires_at > stored.created_at
        won = next(r for r in outcome.won if r.job == name)
        assert (won.pk, won.data, won.lease_expires_at) == (stored.pk, stored.data, stored.lease_expires_at)


def test_a_paused_job_is_neither_run_nor_recorded() -> None:
    job = make_job()
    JobState.objects.create(name="job", paused=True)
    outcome = decide([store.Claim(job, SLOT)])
    assert outcome.won == [] and Run.objects.count() == 0


def test_claims_beyond_capacity_are_deferred_and_left_for_others() -> None:
    jobs = [make_job(f"j{n}") for n in range(3)]
    outcome = decide([store.Claim(j, SLOT) for j in jobs], capacity=1)
    assert len(outcome.won) == 1 and len(outcome.deferred) == 2
    other = decide(outcome.deferred, owner="other")
    assert len(other.won) == 2


def test_a_won_claim_equals_the_row_on_record() -> None:
    """What a claim returns is what was written: every column, on every path."""
    job = make_job(data={"k": [1, "two"]})
    JobState.objects.create(name="job")
    [run] = decide([store.Claim(job, SLOT)]).won
    stored = Run.objects.get(pk=run.pk)
    for field in Run._meta.concrete_fields:
        assert getattr(run, field.attname) == getattr(stored, field.attname), field.name
    assert run.created_at <= run.started_at and run.started_at >= run.scheduled_at
    assert run.created_at.tzinfo is not None and run.lease_expires_at.utcoffset() == timedelta(0)
    assert not run._state.adding and run._state.db == store.alias()  # saved: run.save() updates, never inserts
    assert run.data is not job.data, "a run's data is its own: a handler changing it changes no other run"
    run.detail = "changed"
    run.save(update_fields=["detail"])  # built without Model.__init__, it is still a model instance like any
    assert Run.objects.get(pk=run.pk).detail == "changed" and Run.objects.count() == 1


def test_deciding_reads_only_the_job_columns_it_uses() -> None:
    """Every column of a hundred job rows cost five datetime parses each on SQLite, per claim; a model
    instance per job was still a tenth of the claim: the lock reads four columns into plain tuples."""
    from django.db import transaction
    from django.test.utils import CaptureQueriesContext

    resumed = timezone.now().replace(microsecond=123000)
    paused_at = resumed - timedelta(minutes=5, microseconds=1000)
    JobState.objects.create(name="job", first_seen=timezone.now(), pause_note="note")
    JobState.objects.create(name="paused", first_seen=timezone.now(), paused=True, pruned_slot=SLOT)
    JobState.objects.create(name="resumed", first_seen=timezone.now(), resumed_at=resumed, paused_at=paused_at)
    connection = connections[store.alias()]
    with transaction.atomic(using=store.alias()), CaptureQueriesContext(connection) as queries:
        states = store.lock_jobs(["job", "paused", "resumed"])
    [select] = [q["sql"] for q in queries if q["sql"].lstrip().upper().startswith("SELECT")]
    table = JobState._meta.db_table
    assert table in select and "first_seen" not in select and "pause_note" not in select, select
    assert tuple(states["job"]) == (False, None, None, None)
    assert states["paused"].paused is True and states["paused"].pruned_slot == SLOT
    assert type(states["paused"].pruned_slot) is int
    assert states["resumed"].paused is False and states["resumed"].resumed_at == resumed
    assert states["resumed"].resumed_at.utcoffset() is not None, "an aware datetime, as the model's field reads"
    assert states["resumed"].paused_at == paused_at and states["resumed"].paused_at.utcoffset() is not None


def test_paused_among_names_the_paused_jobs_of_those_asked_about() -> None:
    odd = ['quo"te', "back\\slash", "{brace,comma}", "NULL"]
    for name, paused in (("a", True), ("b", False), ("it's", True), ("other", True), *((o, True) for o in odd)):
        JobState.objects.create(name=name, first_seen=timezone.now(), paused=paused)
    # What a claim reads of the jobs it lost (see statements.claim_scheduled).
    assert store.statements.paused_among(["a", "b", "it's", "missing"]) == {"a", "it's"}
    assert store.statements.paused_among([*odd, "b"]) == set(odd)
    assert store.statements.paused_among([]) == set()


def test_the_poll_names_the_paused_jobs_of_those_asked_about_beside_what_it_finds() -> None:
    """The loop's look at the pause before runs claimed ahead start is sent with its poll."""
    odd = ['quo"te', "back\\slash", "{brace,comma}", "NULL"]
    for name, paused in (("a", True), ("b", False), ("it's", True), ("other", True), *((o, True) for o in odd)):
        JobState.objects.create(name=name, first_seen=timezone.now(), paused=paused)
    assert store.poll().paused == set(), "not asked: not looked at"
    found = store.poll(paused_among=["a", "b", "it's", "missing"])
    assert found.paused == {"a", "it's"} and found.expiring == [] and found.pending_jobs == []
    assert store.poll(paused_among=[*odd, "b"]).paused == set(odd)
    # Beside runs found: those are read again as runs, and the rows naming paused jobs are not among them.
    [expiring] = decide([store.Claim(make_job("b"), SLOT)], ttl=2.0).won
    store.create_manual("a", None, slot=SLOT + 1)  # a paused job's manual run still runs
    found = store.poll(expiring_within=5.0, paused_among=["a", "b"])
    assert found.paused == {"a"}
    assert [r.pk for r in found.expiring] == [expiring.pk] and found.pending_jobs == ["a"]
    assert all(isinstance(r.lease_expires_at, datetime) for r in found.expiring)


def test_newest_successes_is_when_each_jobs_newest_success_ended() -> None:
    """What job_overdue and the last-success gauge count from; failures, runs still running and manual
    successes of other jobs do not count, and a job that never succeeded is left out."""
    now = timezone.now().replace(microsecond=123000)
    for name in ("a", "b", "never", "it's"):
        JobState.objects.create(name=name, first_seen=now)

    def row(job: str, slot: int, status: str, ended: Any, manual: bool = False) -> Run:
        return Run(
            job=job, slot=slot, status=status, reason="manual" if manual else "scheduled", manual=manual,
            scheduled_at=now, finished_at=ended,
        )  # fmt: skip

    Run.objects.bulk_create(
        [
            row("a", SLOT, "success", now - timedelta(seconds=30)),
            row("a", SLOT + 1000, "success", now - timedelta(seconds=10)),
            row("a", SLOT + 2000, "failed", now),  # newer, but not a success
            row("b", SLOT, "success", now - timedelta(seconds=5), manual=True),
            row("b", SLOT + 1000, "running", None),
            row("never", SLOT, "failed", now),
            row("it's", SLOT, "success", now - timedelta(seconds=1)),
        ]
    )
    assert store.newest_successes(["a", "b", "never", "it's", "missing"]) == {
        "a": now - timedelta(seconds=10),
        "b": now - timedelta(seconds=5),
        "it's": now - timedelta(seconds=1),
    }
    assert store.newest_successes() == store.newest_successes(["a", "b", "never", "it's"])
    assert store.newest_successes([]) == {}


def test_newest_successes_looks_each_job_up_in_the_successes_index() -> None:
    """One lookup per job: without the index (or with a plan that cannot use the partial one, as when
    the status is sent as a parameter) it read every success of the job's history."""
    from django.db import connection

    sent: list[str] = []

    def keep(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(sql % tuple(repr(p) for p in params or ()))
        return execute(sql, params, many, context)

    JobState.objects.create(name="a", first_seen=timezone.now())
    with connection.execute_wrapper(keep):
        store.newest_successes(["a"])
    (sql,) = sent
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("EXPLAIN QUERY PLAN " + sql)
            plan = " ".join(str(r[-1]) for r in cursor.fetchall())
        elif connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")  # a table of one row would be read whole
            cursor.execute("EXPLAIN " + sql)
            plan = " ".join(r[0] for r in cursor.fetchall())
        else:
            cursor.execute("EXPLAIN " + sql)
            plan = " ".join(str(r) for r in cursor.fetchall())
    assert "anarchon_run_successes" in plan, plan


def test_newest_scheduled_is_each_jobs_newest_slot_but_for_manual_runs() -> None:
    """What catch-up counts from: a run_now() run (and its takeover attempts) says nothing of which
    scheduled slots ran, however new; a job with no row in the job table or no run is left out. With
    it, when that slot's first attempt was created if a catch-up decided it (a catch-up run, a
    missed record)."""
    now = timezone.now().replace(microsecond=250000)
    for name in ("a", "b", "c", "only-manual", "none"):
        JobState.objects.create(name=name, first_seen=now)

    def row(
        job: str, slot: int, attempt: int = 1, manual: bool = False, status: str = "success", reason: str = ""
    ) -> Run:
        return Run(
            job=job, slot=slot, attempt=attempt, status=status, manual=manual, scheduled_at=now,
            reason=reason or ("manual" if manual else "scheduled"), created_at=now - timedelta(seconds=slot % 7),
        )  # fmt: skip

    Run.objects.bulk_create(
        [
            row("a", SLOT),
            row("a", SLOT + 1000, status="missed"),
            row("a", SLOT + 1000, attempt=2),
            row("a", SLOT + 9000, manual=True),
            row("a", SLOT + 9000, attempt=2, manual=True),
            row("b", SLOT - 5000, reason="catch-up"),
            row("b", SLOT - 9000),
            row("c", SLOT),
            row("c", SLOT, attempt=2, reason="catch-up"),
            row("only-manual", SLOT, manual=True),
            row("no-state", SLOT),
        ]  # fmt: skip
    )
    found = store.statements.newest_scheduled(["a", "b", "c", "only-manual", "none", "no-state"])
    assert found == {
        "a": (SLOT + 1000, now - timedelta(seconds=(SLOT + 1000) % 7)),  # a missed record
        "b": (SLOT - 5000, now - timedelta(seconds=(SLOT - 5000) % 7)),  # a catch-up run
        "c": (SLOT, None),  # its first attempt was scheduled
    }
    assert store.statements.newest_scheduled([]) == {}


def test_newest_scheduled_reads_a_row_or_two_per_job_however_long_the_history() -> None:
    """PostgreSQL: the MAX() over each job's rows it replaced read the run table whole at every
    start-up's catch-up (a Parallel Seq Scan over 300,000 runs: 52 ms, against 2.5 ms)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("EXPLAIN ANALYZE's row counts are PostgreSQL's; the lookup is the same elsewhere")
    JobState.objects.bulk_create([JobState(name=f"j{n}", first_seen=timezone.now()) for n in range(5)])
    Run.objects.bulk_create(
        [
            Run(job=f"j{n}", slot=SLOT - k * 1000, attempt=1, status="success", reason="scheduled",
                scheduled_at=timezone.now())
            for n in range(5)
            for k in range(2000)
        ]
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_anarchon_run")
    sent: list[tuple[str, Any]] = []

    def keep(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(keep):
        found = store.statements.newest_scheduled([f"j{n}" for n in range(5)])
    assert found == {f"j{n}": (SLOT, None) for n in range(5)}
    ((sql, params),) = sent
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0]

    def scans(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield node
        for child in node.get("Plans", []):
            yield from scans(child)

    runs = [n for n in scans(plan[0]["Plan"]) if n.get("Relation Name") == "django_anarchon_run"]
    assert runs and all(n["Actual Rows"] <= 1 and "Seq Scan" not in n["Node Type"] for n in runs), plan


def test_the_poll_sends_the_same_statement_text_for_any_paused_names_on_postgresql() -> None:
    """The loop asks this every second of the jobs claimed ahead: psycopg parses a text it has seen once only."""
    from django.db import connection

    sent: list[str] = []

    def keep(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "jobstate" in sql:  # not a new connection's own set-up (PRAGMA, SET)
            sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(keep):
        store.poll(1.0, paused_among=["a"])
        store.poll(1.0, paused_among=[f"job-{n}" for n in range(100)])
    assert len(sent) == 2, sent
    if connection.vendor == "postgresql":
        assert sent[0] == sent[1] and "ANY(" in sent[0], sent
    else:
        assert sent[0] != sent[1], "a list of placeholders (SQLite) or literals (MySQLdb) elsewhere"


def test_a_plain_claim_is_one_statement_on_postgresql_and_never_reads_back_elsewhere() -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    jobs = [make_job(f"j{n}") for n in range(3)]
    store.ensure_jobs(jobs)
    with CaptureQueriesContext(connection) as sent:
        outcome = decide([store.Claim(j, SLOT) for j in jobs], now_ms=SLOT - 100)  # claimed ahead, as the loop does
    assert len(outcome.won) == 3
    statements = [
        q["sql"] for q in sent.captured_queries if not q["sql"].startswith(("SAVEPOINT", "RELEASE", "BEGIN", "COMMIT"))
    ]
    if connection.vendor == "postgresql":
        assert len(statements) == 1 and "django_anarchon_claim(" in statements[0], statements
    elif connection.vendor == "sqlite":
        # The first look (no lock), then one INSERT ... SELECT that decides and returns what it won.
        assert len(statements) == 2, statements
        assert statements[0].startswith("SELECT") and "RETURNING" in statements[1], statements
    elif getattr(connection, "mysql_is_mariadb", False) and connection.mysql_version >= (10, 5):
        # The first look (no lock), the jobs' lock, then one INSERT ... SELECT that decides and returns
        # what it won: nothing read back, no look at what the jobs are doing apart from it.
        assert len(statements) == 3, statements
        assert statements[0].startswith("SELECT") and "FOR UPDATE" in statements[1], statements
        assert statements[2].startswith("INSERT IGNORE") and "RETURNING" in statements[2], statements
    else:
        # The first look, the lock, what the jobs are doing, and an INSERT that returns the rows it wrote.
        assert len(statements) <= 4, statements
        assert "RETURNING" in statements[-1] or not connection.features.can_return_rows_from_bulk_insert


def test_the_runs_a_one_statement_claim_hands_back_hold_the_instants_the_database_wrote() -> None:
    """Each database's one-statement claim returns its clock's instants in its own way (PostgreSQL and
    MariaDB as integers, SQLite as text): the runs handed to the engine hold what the rows hold, to the
    microsecond, for a slot claimed ahead (it starts at its slot) and one claimed late (it starts now)."""
    from django_anarchon.store import statements

    ahead, late = make_job("ahead"), make_job("late")
    store.ensure_jobs([ahead, late])
    now_ms = int(time.time() * 1000)
    slots = {"ahead": (now_ms // 1000 + 60) * 1000, "late": (now_ms // 1000 - 1) * 1000}
    claims = [store.Claim(ahead, slots["ahead"]), store.Claim(late, slots["late"])]
    connection = connections[store.alias()]
    if connection.vendor != "mysql" or (connection.mysql_is_mariadb and connection.mysql_version >= (10, 5)):
        assert statements.can_claim_in_one_statement(claims), "plain scheduled claims: the one statement"
    outcome = decide(claims, now_ms=now_ms)
    assert sorted(r.job for r in outcome.won) == ["ahead", "late"], outcome
    for run in outcome.won:
        stored = Run.objects.get(pk=run.pk)
        for name in ("created_at", "started_at", "lease_expires_at", "scheduled_at"):
            assert getattr(run, name) == getattr(stored, name), (run.job, name, getattr(run, name))
            assert getattr(run, name).utcoffset() == timedelta(0), (run.job, name, "aware, in UTC")
    by_job = {r.job: r for r in outcome.won}
    assert by_job["ahead"].started_at == by_job["ahead"].scheduled_at, "claimed ahead: starts at its slot"
    assert by_job["late"].started_at == by_job["late"].created_at, "claimed late: starts when claimed"


def test_a_busy_jobs_slot_handed_back_by_the_claim_function_is_not_looked_at_twice() -> None:
    """PostgreSQL: the function took the unlocked first look; the Python path goes straight to the lock."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    job = make_job(overlap="skip")
    store.ensure_jobs([job])
    assert len(decide([store.Claim(job, SLOT)]).won) == 1
    with CaptureQueriesContext(connection) as sent:
        # At its slot: a busy job's slot claimed ahead is left for then (Outcome.early).
        assert len(decide([store.Claim(job, SLOT + 1000)], owner="b", now_ms=SLOT + 1000).skipped) == 1
    statements = [
        q["sql"] for q in sent.captured_queries if not q["sql"].startswith(("SAVEPOINT", "RELEASE", "BEGIN", "COMMIT"))
    ]
    # A slot already due is first checked against its job's last pause, without a lock (see
    # test_a_slot_due_in_the_jobs_last_pause_is_not_run_by_an_instance_that_comes_to_it_late).
    if connection.vendor == "postgresql" or connection.vendor == "sqlite":
        assert "resumed_at" in statements[0] and "FOR UPDATE" not in statements[0], statements
        statements = statements[1:]
    if connection.vendor != "postgresql":
        assert "FOR UPDATE" not in statements[0], "elsewhere the first look comes before the lock"
        return
    assert "django_anarchon_claim(" in statements[0], statements
    assert "FOR UPDATE" in statements[1], statements
    assert len(statements) == 4, statements  # the function, the lock, what the job is doing, the INSERT


def test_claims_on_one_connection_reuse_one_cursor_which_users_execute_wrappers_still_see() -> None:
    """PostgreSQL: a new cursor per claim was ~15 µs of a lost claim's ~105 µs of client CPU.

    The kept cursor is Django's, so instrumentation sees every claim; a closed
    connection gets a new one (and CaptureQueriesContext a debug one: see the test above).
    """
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's claim function only: SQLite's statement differs from claim to claim")
    job = make_job(overlap="allow")
    store.ensure_jobs([job])
    cursors: list[Any] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        if "django_anarchon_claim(" in sql:
            cursors.append(context["cursor"])
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        assert len(decide([store.Claim(job, SLOT)]).won) == 1
        assert len(decide([store.Claim(job, SLOT + 1000)]).won) == 1
        connection.close()
        assert len(decide([store.Claim(job, SLOT + 2000)]).won) == 1
        assert decide([store.Claim(job, SLOT + 2000)], owner="other").won == [], "decided: lost"
    assert len(cursors) == 4, "every claim went through the user's wrapper"
    assert cursors[0] is cursors[1], "the second claim reused the first one's cursor"
    assert cursors[2] is not cursors[1], "a closed connection's cursor is not used again"
    assert cursors[3] is cursors[2]


def test_claims_still_work_and_say_so_when_the_claim_function_was_not_migrated(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from django.db import connection

    from django_anarchon.store import statements as sql

    job = make_job()
    if connection.vendor != "postgresql":
        one = (connection.vendor == "sqlite" and connection.features.can_return_rows_from_bulk_insert) or (
            getattr(connection, "mysql_is_mariadb", False) and connection.mysql_version >= (10, 5)
        )
        assert sql.can_claim_in_one_statement([store.Claim(job, SLOT)]) is one, "not MySQL, nor MariaDB before 10.5"
        return
    monkeypatch.setattr(sql, "CLAIM_FUNCTION", "django_anarchon_claim_not_migrated")
    monkeypatch.setattr(sql, "_MISSING_FUNCTION", set())
    with caplog.at_level("WARNING", logger="django_anarchon"):
        assert len(decide([store.Claim(job, SLOT)]).won) == 1
        assert len(decide([store.Claim(job, SLOT + 1000)]).skipped) == 1, "the Python path decides the rest"
    warnings = [r.getMessage() for r in caplog.records if "migrate" in r.getMessage()]
    assert len(warnings) == 1 and "django_anarchon_claim_not_migrated" in warnings[0]


def test_names_and_data_with_quotes_backslashes_braces_and_commas_are_claimed_intact() -> None:
    """On PostgreSQL the claim's arrays are written as literals, on SQLite the data and the slots' times
    (in a statement that Django's cursor rewrites, "%s" being its placeholder): every character must survive."""
    names = ['say "hi"', "back\\slash", "{braces},comma", "NULL", "ünï cödé ✓", "trailing\\", "it's 5% %s"]
    data = {"quote": '"', "backslash": "\\", "braces": "{a,b}", "null": None, "text": "NULL", "percent": "5% %s %%s"}
    jobs = [make_job(name, data=data) for name in names]
    store.ensure_jobs(jobs)
    outcome = decide([store.Claim(job, SLOT) for job in jobs])
    assert sorted(r.job for r in outcome.won) == sorted(names)
    stored = {r.job: r for r in Run.objects.filter(slot=SLOT)}
    assert sorted(stored) == sorted(names)
    for run in outcome.won:
        assert run.data == data == stored[run.job].data
        assert (run.job, run.slot, run.status) == (stored[run.job].job, SLOT, "running")


def test_names_that_differ_only_in_case_or_accents_are_different_jobs_on_every_database() -> None:
    """MySQL/MariaDB columns compare case- and accent-insensitively by default: migration 0010 gives the
    name columns a binary collation, or "Sync" shared "sync"'s job state, was skipped while "sync"
    ran, and its claims raised in the loop (helper 28)."""
    names = ["sync", "Sync", "café", "cafe", "nettoyage-été", "nettoyage-ete"]
    jobs = [make_job(name) for name in names]
    store.ensure_jobs(jobs)
    assert sorted(JobState.objects.values_list("name", flat=True)) == sorted(names)
    first = decide([store.Claim(job, SLOT) for job in jobs[::2]])  # sync, café, nettoyage-été run
    assert sorted(r.job for r in first.won) == sorted(names[::2])
    # Their twins are free: neither skipped as "still running" nor left undecided.
    second = decide([store.Claim(job, SLOT + 1000) for job in jobs[1::2]])
    assert sorted(r.job for r in second.won) == sorted(names[1::2]) and not second.skipped
    assert sorted(Run.objects.values_list("job", flat=True)) == sorted(names)
    assert Run.objects.filter(job="Sync").count() == 1 and Run.objects.filter(job="cafe").count() == 1


def test_job_names_are_searched_ignoring_case_on_every_database_though_compared_exactly() -> None:
    """The admin searches with ``icontains``; on MySQL/MariaDB a LIKE follows the column's collation,
    binary since migration 0010, and "SYNC" found neither "sync" nor "Sync" there (helper 30)."""
    from django.db import connection

    from django_anarchon.models import JobNameField

    jobs = [make_job(name) for name in ("sync", "Sync", "café", "other")]
    store.ensure_jobs(jobs)
    decide([store.Claim(job, SLOT) for job in jobs])
    assert sorted(Run.objects.filter(job__icontains="SYNC").values_list("job", flat=True)) == ["Sync", "sync"]
    assert sorted(JobState.objects.filter(name__icontains="yn").values_list("name", flat=True)) == ["Sync", "sync"]
    if connection.vendor != "sqlite":  # SQLite's LIKE folds ASCII letters only, for any Django model
        assert list(JobState.objects.filter(name__icontains="CAFÉ").values_list("name", flat=True)) == ["café"]
    assert list(JobState.objects.filter(name="SYNC")) == []  # equality stays exact
    for lookup, value in (("iexact", "SYNC"), ("istartswith", "SY"), ("iendswith", "YNC")):
        found = JobState.objects.filter(**{f"name__{lookup}": value}).values_list("name", flat=True)
        assert sorted(found) == ["Sync", "sync"], lookup
    # An expression on the right keeps the lookup's pattern ("contains", not "equals"; helper 31).
    from django.db.models.functions import Substr, Upper

    inner = JobState.objects.annotate(part=Upper(Substr("name", 2, 2))).filter(name__icontains=F("part"))
    assert sorted(inner.values_list("name", flat=True)) == ["Sync", "café", "other", "sync"]
    assert not JobState.objects.filter(name__icontains="50%").exists()  # LIKE's wildcards still escaped
    # A table made from the models (a --no-migrations test database) gets the binary collation too.
    collation = JobNameField(max_length=200).db_parameters(connection).get("collation")
    assert collation == ("utf8mb4_bin" if connection.vendor == "mysql" else None)


def _a_job_with_a_long_history_among_busy_ones() -> Job:
    """A job with 3,000 finished runs, and 300 other jobs each with a run running: what a claim's
    lookups must not pass over."""
    job, other = make_job("history-job"), make_job("other-job")
    store.ensure_jobs([job, other])
    old = [
        Run(job=job.name, slot=SLOT - (k + 1) * 1000, attempt=1, status="success", reason="scheduled",
            scheduled_at=timezone.now(), created_at=timezone.now(), finished_at=timezone.now())
        for k in range(3000)
    ]  # fmt: skip
    busy = [
        Run(job=f"{other.name}-{k}", slot=SLOT, attempt=1, status="running", reason="scheduled",
            scheduled_at=timezone.now(), created_at=timezone.now(), owner="x")
        for k in range(300)
    ]  # fmt: skip
    Run.objects.bulk_create(old + busy)
    return job


def test_the_claim_function_plans_its_lookups_once_and_never_reads_a_jobs_history() -> None:
    """PostgreSQL: after a few calls, every statement of the claim runs a cached generic plan
    (parameters, not the values of this call), and every plan finds its rows by index, with
    no pass over a long history of finished runs or over the other jobs' running runs."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's claim function; SQLite's one statement: the test below")
    job = _a_job_with_a_long_history_among_busy_ones()
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_anarchon_run")
    for k in range(8):  # PL/pgSQL plans a statement for its first five calls, then may keep a generic plan
        [won] = decide([store.Claim(job, SLOT + k * 1000)], now_ms=SLOT + k * 1000 - 100).won  # claimed ahead
        store.finish(won.id, owner="me", status="success")
    notices: list[str] = []
    raw = connection.connection
    raw.add_notice_handler(lambda diagnostic: notices.append(diagnostic.message_primary or ""))
    with connection.cursor() as cursor:
        try:
            cursor.execute("LOAD 'auto_explain'")
        except Exception as error:  # noqa: BLE001 - said plainly below
            pytest.fail(f"this test needs PostgreSQL's auto_explain module (postgresql-contrib): {error}")
        cursor.execute(
            "SET auto_explain.log_min_duration = 0; SET auto_explain.log_nested_statements = on; "
            "SET auto_explain.log_analyze = on; SET auto_explain.log_level = notice"
        )
    try:
        assert len(decide([store.Claim(job, SLOT + 8000)], now_ms=SLOT + 7900).won) == 1
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET auto_explain.log_min_duration")
    plans = [n for n in notices if "django_anarchon_run" in n or "django_anarchon_jobstate" in n]
    plans = [p for p in plans if "django_anarchon_claim(" not in p.split("plan:", 1)[1].splitlines()[1]]
    assert len(plans) >= 4, notices  # first look, lock, decided?, active?, insert
    for plan in plans:
        assert "Seq Scan" not in plan and "history-job" not in plan, plan
        removed = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
        assert all(n <= 5 for n in removed), plan


def test_the_sqlite_claim_is_one_statement_that_finds_its_rows_by_index() -> None:
    """SQLite: the claim's INSERT ... SELECT looks each slot up in the unique index and each job's active
    runs up in the partial index anarchon_run_active (its condition written as the index has it), never
    passing over a job's history or the other jobs' running runs."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    if connection.vendor != "sqlite":
        pytest.skip("SQLite's one-statement claim; PostgreSQL's function: the test above")
    job = _a_job_with_a_long_history_among_busy_ones()
    with CaptureQueriesContext(connection) as sent:
        [won] = decide([store.Claim(job, SLOT)]).won
    assert (won.job, won.slot, won.status, won.owner) == (job.name, SLOT, "running", "me")
    (claim,) = [q["sql"] for q in sent.captured_queries if q["sql"].startswith("WITH")]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + claim)
        plan = [str(row[-1]) for row in cursor.fetchall()]
    assert any("sqlite_autoindex_django_anarchon_run" in step for step in plan), plan
    assert any("anarchon_run_active" in step for step in plan), plan
    assert not any(re.match(r"SCAN (r|django_anarchon_run)\b", step) for step in plan), plan


def test_the_one_statement_claim_leaves_to_the_general_path_what_it_cannot_decide() -> None:
    """A job without a row yet, a job's second slot of one batch, and a slot past the capacity are
    decided by the general path after the statement; paused jobs and slots decided by others are not."""
    allow, skip, new, paused, gone = (
        make_job("allow", overlap="allow"),
        make_job("skip", overlap="skip"),
        make_job("new"),
        make_job("paused"),
        make_job("gone"),
    )
    store.ensure_jobs([allow, skip, paused, gone])
    JobState.objects.filter(name="paused").update(paused=True)
    assert len(decide([store.Claim(gone, SLOT)], owner="other").won) == 1
    claims = [
        store.Claim(allow, SLOT), store.Claim(allow, SLOT + 1000),
        store.Claim(skip, SLOT), store.Claim(skip, SLOT + 1000),
        store.Claim(new, SLOT), store.Claim(paused, SLOT), store.Claim(gone, SLOT),
    ]  # fmt: skip
    outcome = decide(claims, now_ms=SLOT + 1000)
    assert sorted((r.job, r.slot) for r in outcome.won) == [
        ("allow", SLOT), ("allow", SLOT + 1000), ("new", SLOT), ("skip", SLOT),
    ]  # fmt: skip
    assert [(r.job, r.slot, r.detail[:12]) for r in outcome.skipped] == [("skip", SLOT + 1000, "the previous")]
    assert not Run.objects.filter(job="paused").exists()
    assert Run.objects.filter(job="gone").values_list("owner", flat=True).get() == "other"
    # Past the capacity: deferred, and nothing recorded for them.
    idle = [make_job(f"idle-{n}") for n in range(3)]
    store.ensure_jobs(idle)
    outcome = decide([store.Claim(j, SLOT + 5000) for j in idle], capacity=1)
    assert [(r.job, r.slot) for r in outcome.won] == [("idle-0", SLOT + 5000)]
    assert sorted(c.job.name for c in outcome.deferred) == ["idle-1", "idle-2"]
    assert not Run.objects.filter(slot=SLOT + 5000).exclude(job="idle-0").exists()


@pytest.fixture(params=["one statement", "general"])
def claim_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test with it twice: as the loop claims (the one-statement claim where the database has
    one: PostgreSQL, SQLite and MariaDB) and by the general transaction alone."""
    if request.param == "general":
        monkeypatch.setattr(store.statements, "can_claim_in_one_statement", lambda claims: False)
    return str(request.param)


def test_a_replace_jobs_older_slot_won_in_the_same_batch_is_replaced_before_it_starts(claim_path: str) -> None:
    """Two due slots of an overlap="replace" job in one batch (the instance came to them late): the
    older is recorded interrupted, replaced by the newer, and is not handed out to run. Helper 23:
    the one-statement claim won it and the general path then marked it interrupted, but the loop
    started it all the same; the general path alone ran both, the older one's row having no id yet."""
    job = make_job("replace", overlap="replace")
    store.ensure_jobs([job])
    outcome = decide([store.Claim(job, SLOT), store.Claim(job, SLOT + 1000)], now_ms=SLOT + 1500)
    assert [(r.job, r.slot, r.status) for r in outcome.won] == [("replace", SLOT + 1000, "running")]
    assert [(r.slot, r.status) for r in outcome.interrupted] == [(SLOT, "interrupted")]
    rows = dict(Run.objects.filter(job="replace").values_list("slot", "status"))
    assert rows == {SLOT: "interrupted", SLOT + 1000: "running"}
    older = Run.objects.get(job="replace", slot=SLOT)
    assert older.detail == "replaced by a newer slot (overlap='replace')"
    assert older.finished_at is not None and older.lease_expires_at is None


def test_a_slot_due_in_the_jobs_last_pause_is_not_run_by_an_instance_that_comes_to_it_late(claim_path: str) -> None:
    """SPEC 8: a paused job's slots are not run. An instance frozen over a slot, while the job was
    paused and resumed, claimed it when it came back, the job no longer paused (helper 23: five times
    out of five). Slots before the pause and after the resume still run."""
    from datetime import datetime
    from datetime import timezone as dt_timezone

    def at(ms: int) -> datetime:
        return datetime.fromtimestamp(ms / 1000, tz=dt_timezone.utc)

    job, legacy = make_job("paused-then", overlap="allow"), make_job("resumed-only", overlap="allow")
    store.ensure_jobs([job, legacy])
    JobState.objects.filter(name=job.name).update(paused_at=at(SLOT - 300), resumed_at=at(SLOT + 300))
    JobState.objects.filter(name=legacy.name).update(paused_at=None, resumed_at=at(SLOT + 300))
    late = SLOT + 2500
    outcome = decide([store.Claim(j, slot) for slot in (SLOT - 1000, SLOT) for j in (job, legacy)], now_ms=late)
    assert sorted((r.job, r.slot) for r in outcome.won) == [("paused-then", SLOT - 1000)]
    assert not Run.objects.filter(slot=SLOT).exists(), "the slot in the pause has no row: it was not decided"
    # After the resume (and ahead of its slot), the job runs as before.
    outcome = decide([store.Claim(j, SLOT + 1000) for j in (job, legacy)], now_ms=late)
    assert sorted(r.job for r in outcome.won) == ["paused-then", "resumed-only"]


def test_a_batch_mixing_idle_and_busy_jobs_is_decided_by_each_jobs_overlap() -> None:
    """On PostgreSQL the idle jobs go through the one-statement claim, the busy ones through Python."""
    skip, queue, allow, idle = (
        make_job(name, overlap=name if name != "idle" else "skip") for name in ("skip", "queue", "allow", "idle")
    )
    store.ensure_jobs([skip, queue, allow, idle])
    first = decide([store.Claim(j, SLOT) for j in (skip, queue, allow)], owner="a").won
    assert len(first) == 3
    nxt = SLOT + 1000
    outcome = decide([store.Claim(j, nxt) for j in (skip, queue, allow, idle)] + [store.Claim(idle, nxt + 1000)])
    assert sorted((r.job, r.slot) for r in outcome.won) == [("allow", nxt), ("idle", nxt)]
    assert sorted((r.job, r.slot) for r in outcome.skipped) == [("idle", nxt + 1000), ("skip", nxt)]
    assert Run.objects.get(job="queue", slot=nxt).status == "pending"
    assert Run.objects.get(job="idle", slot=nxt + 1000).status == "skipped", "busy after its own earlier slot"


def test_capacity_is_shared_between_the_one_statement_claim_and_the_python_path() -> None:
    replace = make_job("replace", overlap="replace")
    idle = [make_job(f"idle{n}") for n in range(3)]
    store.ensure_jobs([replace, *idle])
    [running] = decide([store.Claim(replace, SLOT)], owner="a").won
    claims = [store.Claim(j, SLOT + 1000) for j in (replace, *idle)]
    outcome = decide(claims, capacity=2)
    assert sorted(r.job for r in outcome.won) == ["idle0", "idle1"]
    assert sorted(c.job.name for c in outcome.deferred) == ["idle2", "replace"]
    assert outcome.interrupted == [], "a replacement that cannot start here leaves the active run alone"
    assert Run.objects.get(pk=running.pk).status == "running"


# -- overlap -----------------------------------------------------------------------------------


def test_skip_records_a_skipped_slot_while_the_previous_run_runs() -> None:
    job = make_job(overlap="skip")
    first = decide([store.Claim(job, SLOT)]).won[0]
    outcome = decide([store.Claim(job, SLOT + 1000)], owner="b")
    assert outcome.won == []
    [skipped] = outcome.skipped
    assert skipped.status == "skipped" and skipped.slot == SLOT + 1000 and skipped.finished_at is not None
    assert "still running" in skipped.detail and first.instance_id in skipped.detail
    store.finish(first.id, owner="me", status="success")
    assert decide([store.Claim(job, SLOT + 2000)]).won, "free again once the run ended"


def test_skip_also_waits_for_a_run_whose_lease_expired_until_it_is_taken_over() -> None:
    job = make_job(overlap="skip")
    first = decide([store.Claim(job, SLOT)]).won[0]
    expire(first)
    assert decide([store.Claim(job, SLOT + 1000)]).skipped


def test_allow_runs_every_slot_even_concurrently() -> None:
    job = make_job(overlap="allow")
    decide([store.Claim(job, SLOT)])
    outcome = decide([store.Claim(job, SLOT + 1000)], owner="b")
    assert len(outcome.won) == 1
    assert Run.objects.filter(status="running").count() == 2


def test_queue_keeps_at_most_one_waiting_slot() -> None:
    job = make_job(overlap="queue")
    first = decide([store.Claim(job, SLOT)]).won[0]
    queued = decide([store.Claim(job, SLOT + 1000)], owner="b")
    assert queued.won == [] and queued.skipped == []
    waiting = Run.objects.get(slot=SLOT + 1000)
    assert waiting.status == "pending" and waiting.owner == "" and waiting.detail.startswith("queued: the previous run")
    third = decide([store.Claim(job, SLOT + 2000)], owner="c")
    assert [r.slot for r in third.skipped] == [SLOT + 2000]
    # The queued slot starts as soon as the running one ends.
    store.finish(first.id, owner="me", status="success")
    claimed = store.claim_pending(
        store.poll().pending_jobs, {"job": job}, owner="d", instance_id="i-d", ttl=TTL, capacity=10
    )
    assert [r.slot for r in claimed.won] == [SLOT + 1000]


def test_a_queued_slot_is_not_overtaken_by_a_new_slot_decided_before_it_starts() -> None:
    """The run ends a few ms before the next slot: that slot was claimed fresh and the queued one waited on.

    It ran after the newer one, or (ending just before each slot) never, with every slot in between
    skipped as "a run is already queued" behind it.
    """
    job = make_job(overlap="queue")
    first = decide([store.Claim(job, SLOT)]).won[0]
    decide([store.Claim(job, SLOT + 1000)], owner="b")  # queued behind the first
    store.finish(first.id, owner="me", status="success")  # ends; the queued slot is not started yet
    newer = decide([store.Claim(job, SLOT + 2000)], owner="c")
    assert newer.won == [], "the new slot overtook the one waiting"
    assert [r.slot for r in newer.skipped] == [SLOT + 2000]
    assert "a run is already queued" in Run.objects.get(slot=SLOT + 2000).detail
    claimed = store.claim_pending(
        store.poll().pending_jobs, {"job": job}, owner="d", instance_id="i-d", ttl=TTL, capacity=10
    )
    assert [r.slot for r in claimed.won] == [SLOT + 1000], "the waiting slot runs next"
    after = decide([store.Claim(job, SLOT + 3000)], owner="e")
    assert after.won == [] and Run.objects.get(slot=SLOT + 3000).status == "pending", "queued behind it in turn"


def test_replace_interrupts_the_running_run_and_runs_the_new_slot() -> None:
    job = make_job(overlap="replace")
    first = decide([store.Claim(job, SLOT)]).won[0]
    outcome = decide([store.Claim(job, SLOT + 1000)], owner="b")
    assert [r.slot for r in outcome.won] == [SLOT + 1000]
    assert [r.id for r in outcome.interrupted] == [first.id]
    old = Run.objects.get(pk=first.pk)
    assert old.status == "interrupted" and "replaced" in old.detail
    # Not handed over: no attempt 2, and the replaced owner can no longer record anything.
    assert not Run.objects.filter(slot=SLOT, attempt=2).exists()
    assert store.finish(first.id, owner="me", status="success") is False
    held, lost = store.renew([first.id], owner="me", ttl=TTL)
    assert held == set() and [r.id for r in lost] == [first.id]


# -- catch-up ------------------------------------------------------------------------------


@contextlib.contextmanager
def warned_in_transaction(fragment: str) -> Iterator[list[bool]]:
    """For each warning containing ``fragment`` logged meanwhile: whether a transaction was open."""
    seen: list[bool] = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if fragment in record.getMessage():
                seen.append(connections[store.alias()].in_atomic_block)

    watch = Watch()
    logging.getLogger("django_anarchon").addHandler(watch)
    try:
        yield seen
    finally:
        logging.getLogger("django_anarchon").removeHandler(watch)


def _ran(job: Job, slot: int) -> None:
    run = decide([store.Claim(job, slot)]).won[0]
    store.finish(run.id, owner="me", status="success")


def test_a_catch_up_batch_counts_every_jobs_missed_slots_in_one_update_and_warns_after_commit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Up to 500 jobs come back at once after an outage, each with its own count: one UPDATE per
    job was 500 statements inside the claim's transaction, each warning logged under the locks."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    jobs = [make_job(f"j{i}", every=f"{10 * (1 + i % 3)}s") for i in range(5)] + [make_job("j5", every="10s")]
    for job in jobs:
        _ran(job, SLOT)
    JobState.objects.filter(name="j0").update(missed_count=7)  # earlier outages' count is added to
    JobState.objects.filter(name="j5").update(  # paused and resumed during the outage: two records
        paused_at=store.slot_datetime(SLOT + 25_000), resumed_at=store.slot_datetime(SLOT + 35_000)
    )
    caplog.set_level("WARNING", logger="django_anarchon")
    with warned_in_transaction("slot(s) missed") as in_transaction, CaptureQueriesContext(connection) as sent:
        outcome = decide([], [store.CatchUp(job, until=SLOT + 60_000) for job in jobs], owner="back")
    counts = dict(JobState.objects.values_list("name", "missed_count"))
    # 60 s of 10 s slots: 6 due, 5 not run; of 20 s: 3, 2; of 30 s: 2, 1. j5 (10 s): 10 and 20 s,
    # before its pause, and 40 and 50 s, after its resume at 35 s, are missed (60 s runs).
    assert counts == {"j0": 12, "j1": 2, "j2": 1, "j3": 5, "j4": 2, "j5": 4}
    assert sorted(r.job for r in outcome.missed) == ["j0", "j1", "j2", "j3", "j4", "j5", "j5"]
    table = JobState._meta.db_table
    updates = [q["sql"] for q in sent.captured_queries if q["sql"].lstrip().upper().startswith("UPDATE")]
    assert len([u for u in updates if table in u and "missed_count" in u]) == 1, updates
    # Each job's warning is still said, once, and only after the transaction committed.
    warned = [r for r in caplog.records if "slot(s) missed" in r.getMessage()]
    assert sorted(r.job for r in warned) == ["j0", "j1", "j2", "j3", "j4", "j5", "j5"]  # type: ignore[attr-defined]
    assert sorted(r.missed for r in warned) == [1, 2, 2, 2, 2, 5, 5]  # type: ignore[attr-defined]
    assert in_transaction == [False] * 7, "warned under the job locks"


def test_missed_counts_of_more_jobs_than_one_statement_names_are_all_added() -> None:
    from django_anarchon.store import statements

    names = [f"job-{i:03d}" for i in range(450)]
    JobState.objects.bulk_create([JobState(name=n, missed_count=1) for n in names + ["other"]])
    statements.add_missed({n: 1 + i % 7 for i, n in enumerate(names)})
    counts = dict(JobState.objects.values_list("name", "missed_count"))
    assert counts == {**{n: 2 + i % 7 for i, n in enumerate(names)}, "other": 1}


def test_the_data_check_lets_through_only_floats_every_database_gives_back_as_floats() -> None:
    """PostgreSQL's jsonb gives 1e16 back as the int 10000000000000000; the check refuses floats
    from there on, and what it lets through comes back as it went in on every database."""
    from django_anarchon.conf import check_json

    data = {"floats": [1.0, -0.5, 1e-7, 123456789012345.6, 9.99e15, -9.99e15, 2.0**53 + 2], "int": 10**20}
    check_json(data, "the data")
    run = store.create_manual("job", data)
    back = Run.objects.get(id=run.id).data
    assert back == data and [type(x) for x in back["floats"]] == [float] * 7 and type(back["int"]) is int


def test_a_handed_over_attempt_of_a_slot_still_ahead_is_recorded_started_at_its_slot() -> None:
    """Helper 26: stopped just before a slot it had claimed ahead, a runner handed the attempt over;
    the instance that took it up recorded started_at 13-22 ms before the slot (the handler started
    after it): guarantees.md says started_at is the later of the claim and the slot."""
    job = make_job(every="1s")
    ahead = (int(store.database_time().timestamp()) + 30) * 1000
    scheduled = store.slot_datetime(ahead)
    Run.objects.create(
        job="job", slot=ahead, attempt=1, status="interrupted", reason="scheduled", scheduled_at=scheduled
    )
    Run.objects.create(job="job", slot=ahead, attempt=2, status="pending", reason="takeover", scheduled_at=scheduled)
    [taken] = store.claim_pending(["job"], {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=5).won
    assert taken.attempt == 2 and taken.started_at == scheduled, (taken.started_at, scheduled)


def test_catch_up_latest_runs_the_newest_missed_slot_and_records_the_rest() -> None:
    job = make_job(every="10s")
    _ran(job, SLOT)
    outcome = decide([], [store.CatchUp(job, until=SLOT + 50_000)], owner="back")
    [run] = outcome.won
    assert (run.slot, run.reason, run.status) == (SLOT + 50_000, "catch-up", "running")
    [missed] = outcome.missed
    assert missed.status == "missed" and missed.slot == SLOT + 40_000
    assert missed.detail.startswith("4 slot(s) missed from ")
    assert JobState.objects.get(name="job").missed_count == 4
    # A second instance evaluating the same window finds nothing left to do.
    again = decide([], [store.CatchUp(job, until=SLOT + 50_000)], owner="late")
    assert again.won == [] and again.missed == []
    assert JobState.objects.get(name="job").missed_count == 4


@pytest.mark.parametrize("catch_up", ["latest", "all", "none"])
def test_instances_back_together_catch_up_once_though_they_disagree_about_the_current_slot(catch_up: str) -> None:
    # Real slots: what decides is whether a slot was due when the catch-up was recorded.
    job = make_job(every="1s", catch_up=catch_up)
    base = (int(time.time()) - 10) * 1000
    _ran(job, base)
    # The first instance back: base+6s is still current for it (within its start-up
    # grace), so it catches up to base+5s and claims base+6s as scheduled.
    first = decide([], [store.CatchUp(job, until=base + 5_000)], owner="first")
    for run in first.won:
        store.finish(run.id, owner="first", status="success")
    # The second, a few ms later: base+6s is past its grace, a window of its own.
    second = decide([], [store.CatchUp(job, until=base + 6_000)], owner="second")
    assert [(r.slot, r.reason, r.status) for r in second.won] == [(base + 6_000, "scheduled", "running")]
    assert second.missed == []
    # The first one's scheduled claim of the same slot finds it decided.
    assert decide([store.Claim(job, base + 6_000)], owner="first").won == []
    assert Run.objects.filter(job="job", slot=base + 6_000).count() == 1
    catch_up_runs = {"latest": 1, "all": 5, "none": 0}[catch_up]
    assert Run.objects.filter(reason="catch-up").count() == catch_up_runs


def test_a_slot_due_after_the_catch_up_was_recorded_is_still_caught_up() -> None:
    job = make_job(every="1s")
    base = (int(time.time()) - 10) * 1000
    _ran(job, base)
    [first] = decide([], [store.CatchUp(job, until=base + 5_000)], owner="first").won
    store.finish(first.id, owner="first", status="success")
    Run.objects.filter(pk=first.pk).update(created_at=first.scheduled_at)  # recorded right at its slot
    # Nobody ran base+6s and later: a window of several slots, or of one slot that
    # came after the catch-up was recorded, is caught up as usual.
    later = decide([], [store.CatchUp(job, until=base + 6_000)], owner="later")
    assert [(r.slot, r.reason) for r in later.won] == [(base + 6_000, "catch-up")]
    store.finish(later.won[0].id, owner="later", status="success")
    wider = decide([], [store.CatchUp(job, until=base + 9_000)], owner="wider")
    assert [(r.slot, r.reason) for r in wider.won] == [(base + 9_000, "catch-up")]


def test_catch_up_all_runs_every_missed_slot_in_order_one_at_a_time() -> None:
    job = make_job(every="10s", catch_up="all")
    _ran(job, SLOT)
    outcome = decide([], [store.CatchUp(job, until=SLOT + 30_000)])
    assert [r.slot for r in outcome.won] == [SLOT + 10_000]
    waiting = list(Run.objects.filter(status="pending").order_by("slot"))
    assert [(r.slot, r.reason) for r in waiting] == [(SLOT + 20_000, "catch-up"), (SLOT + 30_000, "catch-up")]
    store.finish(outcome.won[0].id, owner="me", status="success")
    nxt = store.claim_pending(
        store.poll().pending_jobs, {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=10
    )
    assert [r.slot for r in nxt.won] == [SLOT + 20_000], "oldest first, one at a time"


def test_a_second_outages_catch_ups_wait_behind_the_first_outages_still_waiting() -> None:
    """catch_up="all" runs every missed slot oldest first. With the first outage's catch-ups still
    waiting (none running: the cluster went down again before they ran), the second outage's first
    catch-up found the job free and ran at once, ahead of them (helper 41: 5 of 8 tries)."""
    job = make_job(every="10s", catch_up="all")
    _ran(job, SLOT)
    first = decide([], [store.CatchUp(job, until=SLOT + 30_000)])
    store.finish(first.won[0].id, owner="me", status="success")  # ran; SLOT+20s and +30s still wait
    assert list(Run.objects.filter(status="pending").values_list("slot", flat=True).order_by("slot")) == [
        SLOT + 20_000,
        SLOT + 30_000,
    ]
    # The cluster went down again before those ran; the instance back catches up what it missed since.
    second = decide([], [store.CatchUp(job, until=SLOT + 60_000)], owner="back")
    assert second.won == [], "a newer missed slot ran before older ones still waiting"
    waiting = Run.objects.filter(status="pending", reason="catch-up").order_by("slot")
    assert [r.slot for r in waiting] == [SLOT + n * 10_000 for n in (2, 3, 4, 5, 6)]
    order = []
    for _ in range(5):
        [nxt] = store.claim_pending(["job"], {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=10).won
        order.append(nxt.slot)
        store.finish(nxt.id, owner="me", status="success")
    assert order == sorted(order), "oldest first, one at a time"


def test_under_queue_a_catch_up_does_not_wait_behind_a_manual_run_waiting() -> None:
    """A manual run is no slot of the schedule: it holds back no catch-up, under "queue" as under
    the other policies (it did under "queue" alone)."""
    job = make_job(every="10s", overlap="queue")
    [ran] = decide([store.Claim(job, SLOT)]).won
    manual = store.create_manual("job", None, slot=SLOT + 1)  # run_now(): waits for a poll to take it
    assert manual.status == "pending"
    store.finish(ran.id, owner="me", status="success")
    outcome = decide([], [store.CatchUp(job, until=SLOT + 50_000)], owner="back")
    assert [(r.slot, r.reason) for r in outcome.won] == [(SLOT + 50_000, "catch-up")]
    assert Run.objects.get(pk=manual.pk).status == "pending"


def test_a_catch_up_waits_for_a_run_left_from_before_the_outage_rather_than_be_skipped() -> None:
    """Killed mid-run with the whole cluster: the run is still on record as running when the first
    instance comes back. The missed slot is owed a run after it (overlap="skip", catch_up="latest")."""
    job = make_job(every="10s")
    [dead] = decide([store.Claim(job, SLOT)], owner="dead").won
    outcome = decide([], [store.CatchUp(job, until=SLOT + 50_000)], owner="back")
    assert outcome.won == [] and outcome.skipped == []
    [owed] = Run.objects.filter(reason="catch-up")
    assert (owed.slot, owed.status) == (SLOT + 50_000, "pending"), owed.detail
    assert owed.detail == "waiting for the job's previous run to end (a catch-up)"
    assert JobState.objects.get(name="job").missed_count == 4
    store.finish(dead.id, owner="dead", status="success")  # (or taken over and ended)
    nxt = store.claim_pending(["job"], {"job": job}, owner="back", instance_id="i", ttl=TTL, capacity=5)
    assert [(r.slot, r.reason) for r in nxt.won] == [(SLOT + 50_000, "catch-up")]
    # Once started, the row no longer reads as if it were still waiting (it says why it started late).
    assert nxt.won[0].detail == "waited for the job's previous run to end (a catch-up)"
    assert Run.objects.get(id=owed.id).detail == "waited for the job's previous run to end (a catch-up)"


def test_under_replace_catch_ups_run_in_order_and_do_not_replace_one_another() -> None:
    job = make_job(every="10s", catch_up="all", overlap="replace")
    _ran(job, SLOT)
    outcome = decide([], [store.CatchUp(job, until=SLOT + 30_000)])
    [first] = outcome.won
    assert first.slot == SLOT + 10_000
    held = store.claim_pending(["job"], {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=5)
    assert held.won == [] and held.interrupted == [], "a catch-up waits for the one running"
    store.finish(first.id, owner="me", status="success")
    nxt = store.claim_pending(["job"], {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=5)
    assert [r.slot for r in nxt.won] == [SLOT + 20_000] and nxt.interrupted == []
    # A manual run still replaces what runs, as run_now() under replace does.
    manual = store.create_manual("job", None, slot=SLOT + 25_000)
    again = store.claim_pending(["job"], {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=5)
    assert [r.id for r in again.won] == [manual.id] and [r.slot for r in again.interrupted] == [SLOT + 20_000]


def test_under_replace_a_catch_up_the_job_never_leaves_a_turn_is_recorded_replaced(claim_path: str) -> None:
    """A replace job whose runs outlast its interval is never free: the catch-up of an outage, waiting
    for it to be, would stay pending for ever. It waits behind the run from before the outage, and is
    recorded replaced once a newer slot's run is itself replaced."""
    job = make_job(every="10s", overlap="replace")
    decide([store.Claim(job, SLOT)], owner="dead")  # killed mid-run with the whole cluster
    decide([], [store.CatchUp(job, until=SLOT + 50_000)], owner="back")
    [owed] = Run.objects.filter(reason="catch-up", status="pending")
    first = decide([store.Claim(job, SLOT + 60_000)], owner="back", now_ms=SLOT + 60_000)
    assert [r.slot for r in first.won] == [SLOT + 60_000] and [r.slot for r in first.interrupted] == [SLOT]
    assert Run.objects.get(id=owed.id).status == "pending", "behind the run from before the outage it waits"
    second = decide([store.Claim(job, SLOT + 70_000)], owner="back", now_ms=SLOT + 70_000)
    assert [r.slot for r in second.won] == [SLOT + 70_000]
    assert sorted(r.slot for r in second.interrupted) == [SLOT + 50_000, SLOT + 60_000]
    owed.refresh_from_db()
    assert owed.status == "interrupted" and owed.finished_at is not None and owed.started_at is None
    assert owed.detail.startswith("replaced by a newer slot (overlap='replace')"), owed.detail
    assert not store.poll().pending_jobs


def test_under_replace_a_catch_up_waiting_behind_an_older_catch_up_keeps_its_turn(claim_path: str) -> None:
    job = make_job(every="10s", catch_up="all", overlap="replace")
    _ran(job, SLOT)
    [running] = decide([], [store.CatchUp(job, until=SLOT + 30_000)]).won
    assert running.slot == SLOT + 10_000
    current = decide([store.Claim(job, SLOT + 40_000)], now_ms=SLOT + 40_000)
    assert [r.slot for r in current.interrupted] == [SLOT + 10_000], "the slot replaces the running catch-up"
    waiting = Run.objects.filter(reason="catch-up", status="pending").order_by("slot")
    assert [r.slot for r in waiting] == [SLOT + 20_000, SLOT + 30_000], "and leaves the waiting ones their turn"


def test_slots_missed_before_a_pause_made_while_the_cluster_was_down_are_recorded() -> None:
    """Paused during the outage and still paused when an instance comes back: the slots before the
    pause were nobody's to skip, and are recorded missed (the window is not looked at again)."""
    job = make_job(every="10s", catch_up="all")
    _ran(job, SLOT)
    JobState.objects.filter(name="job").update(paused=True, paused_at=store.slot_datetime(SLOT + 25_000))
    outcome = decide([], [store.CatchUp(job, until=SLOT + 50_000)], owner="back")
    assert outcome.won == [] and not Run.objects.filter(reason="catch-up").exists()
    [missed] = outcome.missed
    assert missed.slot == SLOT + 20_000 and missed.detail.startswith("2 slot(s) missed from ")
    assert "paused after them" in missed.detail and JobState.objects.get(name="job").missed_count == 2
    # Resumed later: those slots are counted once, and the paused ones stay unrecorded.
    JobState.objects.filter(name="job").update(paused=False, resumed_at=store.slot_datetime(SLOT + 55_000))
    later = decide([], [store.CatchUp(job, until=SLOT + 60_000)], owner="later")
    assert later.missed == [] and JobState.objects.get(name="job").missed_count == 2
    assert not Run.objects.filter(job="job", slot__in=[SLOT + 30_000, SLOT + 40_000, SLOT + 50_000]).exists()


def test_catch_up_all_is_bounded_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    job = make_job(every="1s", catch_up="all")
    _ran(job, SLOT)
    with warned_in_transaction("missed 150 slots") as in_transaction:
        outcome = decide([], [store.CatchUp(job, until=SLOT + 150_000)])
    assert in_transaction == [False], "warned once, after the commit (a retried transaction would say it twice)"
    assert len(outcome.won) == 1
    assert Run.objects.filter(reason="catch-up").count() == store.CATCH_UP_LIMIT
    assert Run.objects.filter(reason="catch-up").order_by("slot").first().slot == SLOT + 51_000
    [missed] = outcome.missed
    assert missed.detail.startswith("50 slot(s) missed")
    assert "missed 150 slots" in caplog.text


def test_catch_up_none_runs_nothing_but_counts_and_records_the_missed_slots() -> None:
    job = make_job(every="10s", catch_up="none")
    _ran(job, SLOT)
    outcome = decide([], [store.CatchUp(job, until=SLOT + 30_000)])
    assert outcome.won == []
    [missed] = outcome.missed
    assert missed.slot == SLOT + 30_000 and missed.detail.startswith("3 slot(s) missed")
    assert JobState.objects.get(name="job").missed_count == 3


def test_a_job_that_never_ran_has_nothing_to_catch_up() -> None:
    job = make_job(every="10s")
    outcome = decide([], [store.CatchUp(job, until=SLOT + 30_000)])
    assert outcome.won == [] and outcome.missed == [] and Run.objects.count() == 0


def test_slots_an_instance_came_to_late_are_recorded_overtaken_once_the_next_slot_was_decided() -> None:
    # The cluster was behind: nobody claimed 20_000 in time, and 30_000 has been run since.
    job = make_job(every="10s")
    for slot in (SLOT, SLOT + 10_000, SLOT + 30_000):
        _ran(job, slot)
    # At start-up (no ``since``) such a window is the outage rule's: nothing to catch up.
    assert decide([], [store.CatchUp(job, until=SLOT + 20_000)], owner="starting").skipped == []
    # A running instance that comes to 10_000..20_000 late records the one nobody decided.
    outcome = decide([], [store.CatchUp(job, until=SLOT + 20_000, since=SLOT + 10_000)], owner="late")
    assert outcome.won == [] and outcome.missed == []
    [skipped] = outcome.skipped
    assert (skipped.slot, skipped.status, skipped.reason) == (SLOT + 20_000, "skipped", "scheduled")
    assert skipped.detail == BEHIND_DETAIL and metrics.skip_reason(skipped.detail) == "behind"
    assert Run.objects.filter(job="job", slot=SLOT + 10_000).get().status == "success", "a decided slot is left alone"
    assert JobState.objects.get(name="job").missed_count == 0
    # Looking again finds every slot accounted for.
    assert decide([], [store.CatchUp(job, until=SLOT + 20_000, since=SLOT + 10_000)], owner="again").skipped == []


def test_slots_another_instance_recorded_missed_are_not_recorded_again_by_one_that_came_late() -> None:
    """After an outage, the instance back first counts the slots nobody ran in one ``missed``
    record (catch_up='none'); one whose loop was behind since before the outage comes to those
    same slots later: they are accounted for already, and are not recorded skipped besides."""
    job = make_job(every="10s", catch_up="none")
    _ran(job, SLOT)
    [missed] = decide([], [store.CatchUp(job, until=SLOT + 50_000)], owner="first").missed
    assert missed.detail.startswith("5 slot(s) missed")
    _ran(job, SLOT + 60_000)
    outcome = decide([], [store.CatchUp(job, until=SLOT + 40_000, since=SLOT + 10_000)], owner="late")
    assert outcome.skipped == [] and outcome.won == []
    assert JobState.objects.get(name="job").missed_count == 5
    # Slots before the record's range are still recorded overtaken.
    Run.objects.filter(status="missed").update(detail="3 slot(s) missed from ...")
    outcome = decide([], [store.CatchUp(job, until=SLOT + 40_000, since=SLOT + 10_000)], owner="later")
    assert [r.slot for r in outcome.skipped] == [SLOT + 10_000, SLOT + 20_000]


def test_slots_overtaken_in_a_paused_period_stay_unrecorded() -> None:
    job = make_job(every="10s")
    for slot in (SLOT, SLOT + 50_000):
        _ran(job, slot)
    JobState.objects.filter(name="job").update(resumed_at=store.slot_datetime(SLOT + 25_000))
    outcome = decide([], [store.CatchUp(job, until=SLOT + 40_000, since=SLOT + 10_000)], owner="late")
    assert [r.slot for r in outcome.skipped] == [SLOT + 30_000, SLOT + 40_000]
    JobState.objects.filter(name="job").update(paused=True)
    assert decide([], [store.CatchUp(job, until=SLOT + 40_000, since=SLOT + 10_000)]).skipped == []
    assert Run.objects.filter(slot__in=[SLOT + 10_000, SLOT + 20_000]).count() == 0


def test_slots_overtaken_before_a_pause_are_recorded() -> None:
    # Paused from 15_000 to 25_000: a late instance records 10_000, 30_000 and 40_000, not 20_000.
    job = make_job(every="10s")
    for slot in (SLOT, SLOT + 50_000):
        _ran(job, slot)
    JobState.objects.filter(name="job").update(
        paused_at=store.slot_datetime(SLOT + 15_000), resumed_at=store.slot_datetime(SLOT + 25_000)
    )
    outcome = decide([], [store.CatchUp(job, until=SLOT + 40_000, since=SLOT + 10_000)], owner="late")
    assert [r.slot for r in outcome.skipped] == [SLOT + 10_000, SLOT + 30_000, SLOT + 40_000]


def test_slots_missed_before_a_pause_are_recorded_missed_not_run_after_resume() -> None:
    """The whole cluster was down from after SLOT; meanwhile the job was paused (25_000) and
    resumed (35_000). The slots before the pause were missed, not paused: they are counted and
    recorded; the paused period's (30_000) are not; after the resume, catch-up as usual."""
    job = make_job(every="10s")
    _ran(job, SLOT)
    JobState.objects.filter(name="job").update(
        paused_at=store.slot_datetime(SLOT + 25_000), resumed_at=store.slot_datetime(SLOT + 35_000)
    )
    outcome = decide([], [store.CatchUp(job, until=SLOT + 50_000)])
    assert [r.slot for r in outcome.won] == [SLOT + 50_000]
    before, after = sorted(outcome.missed, key=lambda run: run.slot)
    assert (before.slot, before.status, before.reason) == (SLOT + 20_000, "missed", "scheduled")
    assert before.detail.startswith("2 slot(s) missed from ") and "paused" in before.detail, before.detail
    assert (after.slot, after.status) == (SLOT + 40_000, "missed") and after.detail.startswith("1 slot(s) missed")
    assert JobState.objects.get(name="job").missed_count == 3
    assert not Run.objects.filter(slot=SLOT + 30_000).exists()
    # Another instance coming back now finds every slot accounted for.
    again = decide([], [store.CatchUp(job, until=SLOT + 50_000)], owner="other")
    assert again.won == [] and again.missed == [] and JobState.objects.get(name="job").missed_count == 3


def test_slots_of_a_paused_period_are_not_caught_up_after_resume() -> None:
    job = make_job(every="10s")
    _ran(job, SLOT)
    resumed = store.slot_datetime(SLOT + 35_000)
    JobState.objects.filter(name="job").update(paused=False, resumed_at=resumed)
    outcome = decide([], [store.CatchUp(job, until=SLOT + 50_000)])
    assert [r.slot for r in outcome.won] == [SLOT + 50_000]
    assert outcome.missed[0].detail.startswith("1 slot(s) missed from ")  # only 40_000, after the resume


def test_manual_runs_do_not_count_as_the_last_scheduled_slot() -> None:
    job = make_job(every="10s")
    _ran(job, SLOT)
    store.create_manual("job", None, slot=SLOT + 45_000)
    outcome = decide([], [store.CatchUp(job, until=SLOT + 50_000)])
    assert [r.slot for r in outcome.won] == [SLOT + 50_000]


# -- leases, takeover, hand-over ------------------------------------------------------


def test_take_over_needs_an_expired_lease() -> None:
    run = decide([store.Claim(make_job(), SLOT)]).won[0]
    assert store.take_over(run, owner="b", instance_id="i-b", ttl=TTL, start=True) is None
    expire(run)
    old, new = store.take_over(run, owner="b", instance_id="i-b", ttl=TTL, start=True)
    assert old.status == "interrupted" and "stopped renewing" in old.detail
    assert (new.slot, new.attempt, new.reason, new.status, new.owner) == (SLOT, 2, "takeover", "running", "b")


def test_concurrent_takeovers_have_one_winner() -> None:
    run = decide([store.Claim(make_job(), SLOT)]).won[0]
    expire(run)
    results = race(8, lambda i: store.take_over(run, owner=f"b{i}", instance_id="x", ttl=TTL, start=True))
    assert sum(r is not None for r in results) == 1
    assert Run.objects.filter(slot=SLOT).count() == 2


def test_an_expired_lease_is_never_revived_but_its_end_is_recorded_until_a_takeover() -> None:
    """A renewal or a progress note needs a live lease; the end of a handler that returned needs the run
    still running under our token only (an outage longer than the lease, helper 32): a takeover marks it
    interrupted under the row's lock, after which the end changes nothing."""
    job = make_job(overlap="allow")
    run, taken = (r for r in decide([store.Claim(job, SLOT), store.Claim(job, SLOT + 1000)]).won)
    for row in (run, taken):
        expire(row)
    held, lost = store.renew([run.id], owner="me", ttl=TTL)
    assert held == set() and [r.id for r in lost] == [run.id]
    assert store.save_progress(run.id, {"page": 3}, owner="me", ttl=TTL) is False
    assert store.finish(run.id, owner="me", status="success") is True
    assert Run.objects.get(pk=run.pk).status == "success"
    assert store.take_over(run, owner="b", instance_id="i-b", ttl=TTL, start=True) is None, "nothing to take over"
    old, new = store.take_over(taken, owner="b", instance_id="i-b", ttl=TTL, start=True)  # type: ignore[misc]
    assert store.finish(taken.id, owner="me", status="success") is False
    assert Run.objects.get(pk=taken.pk).status == "interrupted" and new.attempt == 2


def test_renewal_and_takeover_race_has_one_outcome() -> None:
    """Many rounds of a renewal racing a takeover right at expiry: never both win."""
    job = make_job(overlap="allow")
    for round_ in range(15):
        run = decide([store.Claim(job, SLOT + round_ * 1000)], ttl=0.05).won[0]
        time.sleep(0.045)

        def act(i: int, run: Run = run) -> Any:
            if i == 0:
                return store.renew([run.id], owner="me", ttl=TTL)[0]
            return store.take_over(run, owner="b", instance_id="i-b", ttl=TTL, start=True)

        renewed, taken = race(2, act)
        fresh = Run.objects.get(pk=run.pk)
        if renewed:
            assert taken is None and fresh.status == "running"
        else:
            assert fresh.status in ("running", "interrupted")
            if taken is not None:
                assert fresh.status == "interrupted"
        if fresh.status == "running" and not renewed:
            store.take_over(run, owner="b", instance_id="i-b", ttl=TTL, start=False)
        assert not (renewed and taken)


def test_owner_writes_need_the_token() -> None:
    run = decide([store.Claim(make_job(), SLOT)]).won[0]
    assert store.finish(run.id, owner="someone-else", status="success") is False
    assert store.save_progress(run.id, 1, owner="someone-else", ttl=TTL) is False
    assert store.save_progress(run.id, {"page": 2}, owner="me", ttl=TTL) is True
    assert Run.objects.get(pk=run.pk).progress == {"page": 2}
    assert store.finish(run.id, owner="me", status="failed", error_type="ValueError", error_message="x") is True
    done = Run.objects.get(pk=run.pk)
    assert (done.status, done.error_type, done.lease_expires_at) == ("failed", "ValueError", None)


def test_hand_over_leaves_the_next_attempt_pending_with_data_and_progress() -> None:
    job = make_job()
    manual = store.create_manual("job", {"m": 1}, slot=SLOT)
    [run] = store.claim_pending([manual.job], {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=1).won
    store.save_progress(run.id, {"page": 7}, owner="me", ttl=TTL)
    old, new = store.hand_over(run.id, owner="me", detail="stopping")
    assert old.status == "interrupted" and old.detail == "stopping"
    assert (new.attempt, new.status, new.reason, new.manual) == (2, "pending", "takeover", True)
    assert (new.data, new.progress, new.owner) == ({"m": 1}, {"page": 7}, "")
    assert store.hand_over(run.id, owner="me", detail="again") is None
    [third] = store.claim_pending(
        store.poll().pending_jobs, {"job": job}, owner="b", instance_id="ib", ttl=TTL, capacity=1
    ).won
    assert (third.attempt, third.owner, third.progress) == (2, "b", {"page": 7})


def test_an_attempt_handed_over_before_its_slot_never_started() -> None:
    """Claimed ahead and stopped before its slot: no start time later than its end (nor a duration)."""
    second = int(time.time()) * 1000
    ahead = decide([store.Claim(make_job(), second + 60_000)]).won[0]
    assert Run.objects.get(pk=ahead.pk).started_at is not None, "claimed ahead: to start at its slot"
    old, _ = store.hand_over(ahead.id, owner="me", detail="stopping")
    assert (old.status, old.started_at, old.duration) == ("interrupted", None, None)
    started = decide([store.Claim(make_job("past"), second - 1_000)]).won[0]
    started_at = Run.objects.get(pk=started.pk).started_at
    old, _ = store.hand_over(started.id, owner="me", detail="stopping")
    assert started_at is not None and old.started_at == started_at, "it started: its start is kept"
    assert old.duration is not None and old.duration >= timedelta(0)
    # Stopped a few ms before its slot, the hand-over recorded just after it (the stop waits for the
    # runs): the runner says the handler was never called, so no start time either.
    late = decide([store.Claim(make_job("late"), second - 1_000)]).won[0]
    old, _ = store.hand_over(late.id, owner="me", detail="stopping", started=False)
    assert (old.status, old.started_at, old.duration) == ("interrupted", None, None)


def test_a_handed_over_attempt_keeps_the_job_busy_for_skip() -> None:
    job = make_job(overlap="skip")
    run = decide([store.Claim(job, SLOT)]).won[0]
    store.hand_over(run.id, owner="me", detail="stopping")
    assert decide([store.Claim(job, SLOT + 1000)]).skipped


# -- pending runs --------------------------------------------------------------------------


def test_a_manual_run_waits_while_the_job_runs_under_skip() -> None:
    job = make_job(overlap="skip")
    first = decide([store.Claim(job, SLOT)]).won[0]
    manual = store.create_manual("job", None, slot=SLOT + 500)
    assert store.claim_pending([manual.job], {"job": job}, owner="b", instance_id="ib", ttl=TTL, capacity=5).won == []
    store.finish(first.id, owner="me", status="success")
    [won] = store.claim_pending([manual.job], {"job": job}, owner="b", instance_id="ib", ttl=TTL, capacity=5).won
    assert won.id == manual.id and won.reason == "manual" and won.manual


def test_concurrent_pending_claims_have_one_winner() -> None:
    job = make_job(overlap="allow")
    manual = store.create_manual("job", None, slot=SLOT)
    results = race(
        8,
        lambda i: store.claim_pending([manual.job], {"job": job}, owner=f"o{i}", instance_id="x", ttl=TTL, capacity=5),
    )
    assert sum(len(r.won) for r in results) == 1


def test_pending_catch_up_of_a_paused_job_is_skipped_but_manual_runs_still_run() -> None:
    job = make_job(every="10s", catch_up="all")
    _ran(job, SLOT)
    decide([], [store.CatchUp(job, until=SLOT + 30_000)])
    Run.objects.filter(status="running").update(status="success")
    JobState.objects.filter(name="job").update(paused=True)
    manual = store.create_manual("job", None, slot=SLOT + 31_000)
    outcome = store.claim_pending(
        store.poll().pending_jobs, {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=5
    )
    assert [r.id for r in outcome.won] == [manual.id]
    assert sorted(r.slot for r in outcome.skipped) == [SLOT + 20_000, SLOT + 30_000]


def test_a_paused_jobs_handed_over_attempt_runs_only_if_its_handler_had_started() -> None:
    """Stopped before its slot, a run is handed over never started; the job paused since, its next
    attempt still ran, the first run of that slot, while the job was paused (helper 41). It is
    recorded skipped now, as the run would have been withdrawn had its instance lived. An attempt
    whose handler had started before the pause carries on its work, as a takeover after a crash does."""
    job, other = make_job(every="10s"), make_job("other", every="10s")
    due = (int(time.time()) - 5) * 1000  # due already: "began" started its handler at the slot
    [never, began] = decide([store.Claim(job, due), store.Claim(other, due)]).won
    jobs = {"job": job, "other": other}
    store.hand_over(never.id, owner="me", detail="stopping", started=False)
    store.hand_over(began.id, owner="me", detail="stopping")
    JobState.objects.filter(name__in=["job", "other"]).update(paused=True)
    outcome = store.claim_pending(["job", "other"], jobs, owner="b", instance_id="ib", ttl=TTL, capacity=5)
    assert [(r.job, r.attempt) for r in outcome.won] == [("other", 2)]
    assert [(r.job, r.attempt, r.detail) for r in outcome.skipped] == [("job", 2, "the job is paused")]
    assert Run.objects.get(job="job", attempt=2).status == "skipped"


def test_manual_runs_in_the_same_millisecond_get_distinct_slots() -> None:
    first = store.create_manual("job", None, slot=SLOT)
    second = store.create_manual("job", None, slot=SLOT)
    assert (first.slot, second.slot) == (SLOT, SLOT + 1)


def test_claim_manual_waits_under_skip_and_replaces_under_replace() -> None:
    skip = make_job("s", overlap="skip")
    decide([store.Claim(skip, SLOT)])
    assert store.claim_manual(skip, None, SLOT + 5, owner="me", instance_id="i", ttl=TTL) is None
    replace = make_job("r", overlap="replace")
    old = decide([store.Claim(replace, SLOT)]).won[0]
    run = store.claim_manual(replace, {"x": 1}, SLOT, owner="me", instance_id="i", ttl=TTL)
    # Manual runs have a slot space of their own: the scheduled row at SLOT does not push it on.
    assert run is not None and run.slot == SLOT and run.status == "running" and run.reason == "manual"
    assert Run.objects.get(pk=old.pk).status == "interrupted"


# -- housekeeping ----------------------------------------------------------------------


def test_prune_deletes_only_old_finished_runs() -> None:
    job = make_job(overlap="allow")
    old = decide([store.Claim(job, SLOT)]).won[0]
    store.finish(old.id, owner="me", status="success")
    Run.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(days=10))
    recent = decide([store.Claim(job, SLOT + 1000)]).won[0]
    store.finish(recent.id, owner="me", status="success")
    running = decide([store.Claim(job, SLOT + 2000)]).won[0]
    assert store.prune_batch(7 * 86400, 500) == 1
    assert set(Run.objects.values_list("id", flat=True)) == {recent.id, running.id}


def test_a_job_whose_whole_history_was_pruned_still_catches_up() -> None:
    # A monthly job with a week's retention: by its next slot no run is on record.
    job = make_job(every="10s")
    _ran(job, SLOT)
    _ran(job, SLOT + 10_000)
    manual = store.claim_manual(job, None, SLOT + 15_000, owner="me", instance_id="i", ttl=TTL)
    assert manual is not None
    store.finish(manual.id, owner="me", status="success")
    Run.objects.update(finished_at=timezone.now() - timedelta(days=10))
    assert store.prune_batch(7 * 86400, 500) == 3
    assert not Run.objects.exists()
    # The newest scheduled slot, not the later manual one, is the floor.
    assert JobState.objects.get(name="job").pruned_slot == SLOT + 10_000
    outcome = decide([], [store.CatchUp(job, until=SLOT + 40_000)], owner="back")
    [run] = outcome.won
    assert (run.slot, run.reason) == (SLOT + 40_000, "catch-up")
    [missed] = outcome.missed
    assert missed.detail.startswith("2 slot(s) missed from ")


def test_pruning_never_moves_the_catch_up_floor_back() -> None:
    job = make_job(every="10s")
    _ran(job, SLOT)
    JobState.objects.filter(name="job").update(pruned_slot=SLOT + 90_000)
    Run.objects.update(finished_at=timezone.now() - timedelta(days=10))
    assert store.prune_batch(7 * 86400, 500) == 1
    assert JobState.objects.get(name="job").pruned_slot == SLOT + 90_000


def test_instances_register_heartbeat_and_unregister() -> None:
    store.register_instance("tok", "node-1", "host", 42)
    store.heartbeat("tok", "node-1", "host", 42)
    from django_anarchon.models import Instance

    assert Instance.objects.get(token="tok").instance_id == "node-1"
    store.unregister_instance("tok")
    store.heartbeat("tok", "node-1", "host", 42)  # re-registers if pruned meanwhile
    assert Instance.objects.filter(token="tok").exists()


def test_skip_locked_leaves_a_job_held_elsewhere_undecided_instead_of_waiting() -> None:
    from django.db import transaction

    job = make_job()
    JobState.objects.create(name="job")
    held, release = threading.Event(), threading.Event()

    def hold_the_job() -> None:
        with transaction.atomic():
            store.lock_jobs(["job"])
            held.set()
            release.wait(5)
        connections.close_all()

    holder = threading.Thread(target=hold_the_job)
    holder.start()
    assert held.wait(5)
    try:
        if connections["default"].vendor == "sqlite":
            # SQLite has one write lock and no SKIP LOCKED: the claim waits for it, then wins.
            threading.Timer(0.3, release.set).start()
            outcome = decide([store.Claim(job, SLOT)], skip_locked=True)
            assert outcome.busy == [] and len(outcome.won) == 1
        else:
            outcome = decide([store.Claim(job, SLOT)], skip_locked=True)
            assert outcome.busy == ["job"] and outcome.won == [] and not Run.objects.exists()
            release.set()
            holder.join(5)
            assert len(decide([store.Claim(job, SLOT)], skip_locked=True).won) == 1
    finally:
        release.set()
        holder.join(5)


# -- PostgreSQL: how a claim waits for another instance's claim of the same job --------------


@contextlib.contextmanager
def _holding(action: Callable[[], Any], release_after: float = 0.3) -> Iterator[list[Any]]:
    """Run ``action`` in a transaction on another connection, open until ``release_after`` s into the block.

    Yields a list that holds what ``action`` returned once the block has ended.
    """
    from django.db import transaction

    held, release = threading.Event(), threading.Event()
    result: list[Any] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                result.append(action())
                held.set()
                release.wait(10)
        finally:
            held.set()
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        threading.Timer(release_after, release.set).start()
        yield result
    finally:
        release.set()
        holder.join(10)


def _wait_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a claim wait seconds for a held job instead of LOCK_WAIT_MS, so that no timing decides the test."""
    from django_anarchon.store import statements as sql

    if connections["default"].vendor != "postgresql":
        pytest.skip("the claim function and its lock wait exist on PostgreSQL only; elsewhere see the tests above")
    monkeypatch.setattr(sql, "LOCK_WAIT_MS", 10_000)


def test_a_claim_that_waited_for_the_winner_of_its_slot_loses_without_locking_or_writing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loser waits on the advisory lock and looks again: no row lock, no transaction id, no flushed commit."""
    from django.db import connection, transaction

    _wait_long(monkeypatch)
    job = make_job()
    store.ensure_jobs([job])
    holding = _holding(lambda: decide([store.Claim(job, SLOT)], owner="holder", skip_locked=True).won)
    with holding as holder_won, transaction.atomic():
        outcome = decide([store.Claim(job, SLOT)], owner="loser", skip_locked=True)
        with connection.cursor() as cursor:
            cursor.execute("SELECT txid_current_if_assigned()")
            xid = cursor.fetchone()[0]
    assert len(holder_won[0]) == 1, "the holder won the slot"
    assert outcome.won == [] and outcome.busy == [], "the loser waited for the holder and lost, not busy"
    assert xid is None, f"the losing claim locked or wrote something (transaction id {xid})"
    assert list(Run.objects.values_list("owner", flat=True)) == ["holder"]


def test_a_claim_that_waited_for_another_slot_of_its_job_still_wins_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    _wait_long(monkeypatch)
    job = make_job(overlap="allow")
    store.ensure_jobs([job])
    with _holding(lambda: decide([store.Claim(job, SLOT)], owner="holder", skip_locked=True)):
        outcome = decide([store.Claim(job, SLOT + 1000)], owner="waiter", skip_locked=True)
    assert [(r.slot, r.owner) for r in outcome.won] == [(SLOT + 1000, "waiter")]
    assert Run.objects.count() == 2


def test_a_claim_that_waited_for_a_job_row_held_by_no_claim_wins_once_it_is_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder without the advisory lock (a pause, the Python path): the claim waits for the row itself."""
    _wait_long(monkeypatch)
    job = make_job()
    store.ensure_jobs([job])
    with _holding(lambda: store.lock_jobs(["job"])):
        started = time.monotonic()
        outcome = decide([store.Claim(job, SLOT)], owner="waiter", skip_locked=True)
        waited = time.monotonic() - started
    assert [r.owner for r in outcome.won] == ["waiter"] and outcome.busy == []
    assert waited >= 0.25, f"the claim did not wait for the row lock ({waited:.3f} s)"


@pytest.mark.parametrize("seconds", [30.0, 0.25, -1.5])
def test_a_lease_is_the_database_clock_plus_its_ttl_with_no_python_per_row(seconds: float) -> None:
    """``db_in`` is the database clock shifted; on SQLite a date modifier, not Django's date arithmetic.

    Django computes ``datetime + timedelta`` on SQLite with a Python function that SQLite calls
    for every row: a claim's INSERT sets a lease per row.
    """
    from django_anarchon.store.statements import compile_expression

    connection = connections[store.alias()]
    sql, params = compile_expression(connection, store.db_in(seconds))
    if connection.vendor == "sqlite":
        assert "django_" not in sql, sql
    now = store.database_time()
    Run.objects.create(job="lease", slot=SLOT, attempt=1, status="running", reason="scheduled",
                       scheduled_at=now, lease_expires_at=store.db_in(seconds))  # fmt: skip
    stored = Run.objects.get(job="lease").lease_expires_at
    assert stored is not None
    assert abs((stored - now).total_seconds() - seconds) < 1.0, (stored, now)
    # and it compares with stored datetimes as the database clock does
    assert Run.objects.filter(job="lease", lease_expires_at__gt=store.db_in(seconds - 2)).exists()
    assert not Run.objects.filter(job="lease", lease_expires_at__gt=store.db_in(seconds + 2)).exists()


def test_job_names_with_quotes_percent_signs_and_backslashes_are_decided_and_ended() -> None:
    """Job names in IN lists are written as the driver's literals on MariaDB, ids and slots as numbers."""
    from django.db import transaction

    from django_anarchon.store import statements

    names = ["it's 100% done", 'a "quoted" \\ name %s', "naïve — ünïcode", "plain"]
    jobs = [make_job(name) for name in names]
    outcome = decide([store.Claim(job, SLOT) for job in jobs], capacity=10)
    assert sorted(r.job for r in outcome.won) == sorted(names)
    for won in outcome.won:  # what the claim returned is what the database holds (the clock's columns too)
        stored = Run.objects.get(id=won.id)
        for column in ("created_at", "started_at", "lease_expires_at", "scheduled_at", "finished_at"):
            assert getattr(won, column) == getattr(stored, column), column
    assert statements.decided(names, [SLOT, SLOT + 1000]) == {(name, SLOT) for name in names}
    assert statements.decided(names[:1], [SLOT + 1000]) == set()
    rows = statements.runs_for_decision(names, [SLOT])
    assert sorted(r.job for r in rows if r.status == "running") == sorted(names)
    with transaction.atomic(using=store.alias()):
        states = statements.lock_jobs(names)
    assert sorted(states) == sorted(names)
    ids = [r.id for r in outcome.won]
    assert statements.end_held(ids, owner="me", status="success") == len(names)
    assert set(Run.objects.filter(id__in=ids).values_list("status", flat=True)) == {"success"}
    # and a second claim of the next slot still sees the names (the literals kept per connection)
    again = decide([store.Claim(job, SLOT + 1000) for job in jobs], capacity=10)
    assert sorted(r.job for r in again.won) == sorted(names)


def test_a_claims_insert_on_mariadb_and_sqlite_sends_each_shared_value_once() -> None:
    """MariaDB's claim INSERT carries no parameters (MySQLdb escapes each in Python): names, statuses, data
    and the lease's and start's arithmetic are the driver's literals. SQLite's binds the values every row
    shares once (a SELECT over a VALUES list of what differs). What the database stores is what parameters
    would have stored (quotes, % signs, backslashes, escapes in JSON, non-ASCII), and the instants it
    returns as text are the ones it holds."""
    connection = connections[store.alias()]
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL claims in one statement (see test_claim_function_*)")
    data = {"note": "it's 100% done \\ %s", "tab": "a\tb", "n": 12, "ok": True, "none": None, "ü": 1.5}
    names = ["it's 50%", 'say "%%s" \\', "naïve"]
    jobs = [make_job(name, data=data) for name in names]
    sent: list[tuple[str, Any]] = []

    def watch(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(watch):
        outcome = decide([store.Claim(job, SLOT) for job in jobs], capacity=10, default_data={"unused": 1})
    [(insert, params)] = [(sql, p) for sql, p in sent if sql.startswith("INSERT") and Run._meta.db_table in sql[:60]]
    if connection.vendor == "mysql":
        assert not params, params
    else:
        # SQLite binds what the rows share once, and per row only what differs (the job's name).
        assert "FROM (VALUES" in insert, insert
        columns = len([f for f in Run._meta.concrete_fields if not f.primary_key])
        assert len(params) < columns + 2 * len(names), params
    assert sorted(r.job for r in outcome.won) == sorted(names)
    for won in outcome.won:
        stored = Run.objects.get(id=won.id)
        assert (stored.job, stored.data, stored.status, stored.attempt, stored.manual) == (
            won.job, data, "running", 1, False
        )  # fmt: skip
        for column in ("created_at", "started_at", "lease_expires_at", "scheduled_at"):
            assert getattr(won, column) == getattr(stored, column), column
        assert timedelta(seconds=TTL - 5) < stored.lease_expires_at - stored.created_at <= timedelta(seconds=TTL + 1)


def test_an_expressions_parameters_are_written_in_with_their_percent_signs_kept() -> None:
    from django_anarchon.store import statements

    def literal(value: Any) -> str:  # as _literal's: quoted, % doubled
        return "'" + str(value).replace("'", "''").replace("%", "%%") + "'"

    assert statements._inlined("MAX(%s, %s, '%%Y')", ["it's 5%", 3], literal) == (
        "MAX('it''s 5%%', '3', '%%Y')", []
    )  # fmt: skip
    assert statements._inlined("NOW()", [], literal) == ("NOW()", [])


def test_a_claims_clock_expressions_are_compiled_once_and_still_say_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Django's compiler took ~0.4 ms of every claim for the database clock, the lease and the start of a run
    claimed ahead: each is compiled once per database (a start's moment prepared as its own parameter), and
    what the database stores is what the compiled expressions said: a start at its slot if that is still
    ahead, else at the claim's own instant; a lease TTL after it."""
    from django_anarchon.store import statements

    compiled: list[str] = []
    real = statements.compile_expression

    def counting(connection: Any, expression: Any) -> tuple[str, list[Any]]:
        compiled.append(type(expression).__name__)
        return real(connection, expression)

    monkeypatch.setattr(statements, "compile_expression", counting)
    monkeypatch.setattr(statements, "_CLOCK_SQL", {})
    job = make_job("clocked", overlap="allow")
    past = (int(time.time()) - 3600) * 1000
    for turn in range(2):
        compiled.clear()
        slots = [SLOT + turn * 1000, past + turn * 1000]
        # wait=True: the Python path on every database (PostgreSQL's claim function takes plain claims)
        outcome = decide([store.Claim(job, slot, wait=True) for slot in slots], capacity=10)
        assert sorted(r.slot for r in outcome.won) == sorted(slots)
        if turn == 1:
            assert compiled == [], "the second claim compiled its clock expressions again"
        else:
            assert "DbIn" in compiled and "NotBefore" in compiled, compiled
        for slot in slots:
            stored = Run.objects.get(job="clocked", slot=slot)
            if slot > past + 10_000:
                assert stored.started_at == stored.scheduled_at, "claimed ahead: starts at its slot"
            else:
                assert stored.started_at == stored.created_at, "claimed late: starts when claimed"
            assert timedelta(seconds=TTL - 1) < stored.lease_expires_at - stored.created_at
            assert stored.lease_expires_at - stored.created_at <= timedelta(seconds=TTL + 1)


def test_an_instance_alone_claims_without_the_unlocked_first_look() -> None:
    """The first look (a SELECT before the transaction) can only find something when another instance
    decides too: one that knows of none leaves it out, and the locked decision still leaves a slot
    someone else decided alone (no second row, nothing won)."""
    from django.test.utils import CaptureQueriesContext

    jobs = [make_job(f"alone-{n}") for n in range(3)]
    decide([store.Claim(jobs[0], SLOT)], owner="other")
    connection = connections[store.alias()]
    # wait=True: the Python path on every database (PostgreSQL's claim function takes plain claims)
    claims = [store.Claim(job, SLOT, wait=True) for job in jobs]
    with CaptureQueriesContext(connection) as queries:
        outcome = decide(claims, first_look=False)
    sqls = [q["sql"] for q in queries]
    assert not any(sql.lstrip().upper().startswith("SELECT") for sql in sqls[: _begin(sqls)]), sqls
    assert sorted(r.job for r in outcome.won) == ["alone-1", "alone-2"], "decided elsewhere: left alone"
    assert Run.objects.filter(job="alone-0", slot=SLOT).count() == 1
    with CaptureQueriesContext(connection) as queries:
        decide([store.Claim(job, SLOT + 1000, wait=True) for job in jobs])
    sqls = [q["sql"] for q in queries]
    assert any(sql.lstrip().upper().startswith("SELECT") for sql in sqls[: _begin(sqls)]), "the default looks first"


def _begin(sqls: list[str]) -> int:
    """The index of the claim's first locking statement (what comes before it ran outside the transaction)."""
    for index, sql in enumerate(sqls):
        text = sql.lstrip().upper()
        if text.startswith(("BEGIN", "SAVEPOINT", "UPDATE")) or "FOR UPDATE" in text:
            return index
    raise AssertionError(f"no locking statement in {sqls}")


def test_a_current_slot_decided_with_a_catch_up_of_its_skip_job_waits_behind_it_not_skipped() -> None:
    """After an outage of the whole cluster, the first instance back claims the newest missed slot as a
    catch-up and the current slot in one transaction. The current slot was recorded skipped behind
    the catch-up, a run that had not even started (helpers 29, 32, 34, 35: after almost every outage).
    It now waits behind the catch-up as a pending run, and runs as scheduled once the catch-up has ended."""
    job = make_job(every="1s")
    base = (int(time.time()) - 10) * 1000
    _ran(job, base)
    current = base + 8_000
    outcome = decide([store.Claim(job, current)], [store.CatchUp(job, until=base + 7_000)], now_ms=current + 30)
    [caught] = outcome.won
    assert (caught.slot, caught.reason) == (base + 7_000, "catch-up")
    assert outcome.skipped == [] and outcome.busy == []
    waiting = Run.objects.get(slot=current)
    assert (waiting.status, waiting.reason, waiting.attempt) == ("pending", "scheduled", 1)
    assert waiting.detail.startswith("waiting for the job's catch-up to end"), waiting.detail
    assert store.poll().pending_jobs == ["job"]
    held = store.claim_pending(["job"], {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=5)
    assert held.won == [], "not while the catch-up runs"
    store.finish(caught.id, owner="me", status="success")
    [run] = store.claim_pending(["job"], {"job": job}, owner="me", instance_id="i", ttl=TTL, capacity=5).won
    assert (run.slot, run.reason, run.status) == (current, "scheduled", "running")
    assert run.detail.startswith("waited for the job's catch-up to end"), run.detail


def test_a_current_slot_finds_a_catch_up_still_running_from_an_earlier_batch_and_waits_behind_it() -> None:
    """The same when the catch-up was decided first (an instance decides its catch-ups as it starts, and its
    current slot at its first loop turn): the slot waits, and the one after it is skipped as usual."""
    job = make_job(every="1s")
    base = (int(time.time()) - 10) * 1000
    _ran(job, base)
    [caught] = decide([], [store.CatchUp(job, until=base + 7_000)], now_ms=base + 8_000).won
    assert caught.reason == "catch-up"
    outcome = decide([store.Claim(job, base + 8_000)], now_ms=base + 8_030)
    assert outcome.won == [] and outcome.skipped == []
    assert Run.objects.get(slot=base + 8_000).status == "pending"
    later = decide([store.Claim(job, base + 9_000)], now_ms=base + 9_030)
    assert [r.slot for r in later.skipped] == [base + 9_000], "one slot waits, as under queue"
    assert "was still running" in later.skipped[0].detail


def test_a_slot_of_a_job_busy_with_a_scheduled_run_is_still_skipped() -> None:
    """Only catch-ups make a slot wait: a job whose scheduled run runs skips its next slot as ever."""
    job = make_job(every="1s")
    base = (int(time.time()) - 10) * 1000
    [running] = decide([store.Claim(job, base)], now_ms=base).won
    assert running.reason == "scheduled"
    outcome = decide([store.Claim(job, base + 1_000)], now_ms=base + 1_030)
    assert [r.slot for r in outcome.skipped] == [base + 1_000]
