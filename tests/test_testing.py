"""django_anarchon.testing: a job's handler run inside the test's own transaction, on every database."""

from __future__ import annotations

import contextlib
from datetime import datetime, timezone
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import IntegrityError
from django.test import TestCase

from django_anarchon import AnarchonError, Context, Interrupted, Scheduler
from django_anarchon.models import Run
from django_anarchon.testing import Outcome, make_context, run_job
from tests.testapp.models import Execution


def write_row(ctx: Context) -> str:
    Execution.objects.create(job=ctx.name, slot=ctx.slot, attempt=ctx.attempt, reason=ctx.reason,
                             instance_id=ctx.instance_id, pid=0, event="start", at=0.0, data=ctx.data)  # fmt: skip
    ctx.save_progress({"rows": 1})
    return "done"


async def write_row_async(ctx: Context) -> None:
    await sync_to_async(write_row)(ctx)


def scheduler_with_jobs() -> Scheduler:
    scheduler = Scheduler()
    scheduler.every("writer", "1h", write_row, data={"bucket": "b"})
    scheduler.every("async-writer", "1h", write_row_async)
    scheduler.every("broken", "1h", lambda ctx: 1 / 0)
    scheduler.every("stopped", "1h", lambda ctx: ctx.signal.throw_if_aborted())
    scheduler.every("duplicate", "1h", write_twice)
    scheduler.every("swallowed", "1h", write_twice_quietly)
    scheduler.every("writes-then-fails", "1h", write_then_fail)
    scheduler.every("gives-a-generator", "1h", lambda ctx: (row for row in [ctx.slot]))
    return scheduler


def _execution(pk: int) -> Execution:
    return Execution(pk=pk, job="dup", slot=1, attempt=1, reason="x", instance_id="", pid=0, event="e", at=0.0)


def write_twice(ctx: Context) -> None:
    _execution(7).save(force_insert=True)
    _execution(7).save(force_insert=True)  # IntegrityError: the same primary key


def write_twice_quietly(ctx: Context) -> None:
    _execution(8).save(force_insert=True)
    with contextlib.suppress(IntegrityError):
        _execution(8).save(force_insert=True)


def write_then_fail(ctx: Context) -> None:
    _execution(9).save(force_insert=True)
    raise ValueError("after the row was written")


@pytest.mark.django_db
def test_a_handler_runs_in_the_tests_transaction_with_the_schedulers_context() -> None:
    slot = datetime(2027, 1, 15, 8, tzinfo=timezone.utc)
    outcome = run_job("writer", slot=slot, scheduler=scheduler_with_jobs())
    assert (outcome.status, outcome.error, outcome.result, outcome.progress) == ("success", None, "done", {"rows": 1})
    [row] = Execution.objects.all()
    assert (row.job, row.slot, row.attempt, row.reason, row.data) == ("writer", 1_800_000_000_000, 1, "scheduled",
                                                                      {"bucket": "b"})  # fmt: skip
    assert not Run.objects.exists(), "nothing is claimed or recorded"


@pytest.mark.django_db
def test_an_async_handler_uses_the_tests_connection_too() -> None:
    outcome = run_job("async-writer", data={"given": True}, reason="manual", scheduler=scheduler_with_jobs())
    assert outcome.status == "success", outcome.error
    assert Execution.objects.get().data == {"given": True}
    assert outcome.context.manual is True


@pytest.mark.django_db
def test_failures_and_interruptions_are_outcomes_not_exceptions() -> None:
    scheduler = scheduler_with_jobs()
    failed = run_job("broken", scheduler=scheduler)
    assert failed.status == "failed" and isinstance(failed.error, ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        failed.raise_error()
    ctx_signal = make_context("stopped").signal
    ctx_signal.abort(Interrupted("stopping"))
    stopped = run_job("stopped", signal=ctx_signal, scheduler=scheduler)
    assert stopped.status == "interrupted" and isinstance(stopped.error, Interrupted)


def test_a_run_past_the_jobs_timeout_fails_with_timeout_error_as_the_scheduler_records_it() -> None:
    scheduler = Scheduler()
    seen: list[Any] = []

    def honours(ctx: Context) -> None:
        ctx.sleep(5)  # raises TimeoutError once the timeout passes

    def ignores(ctx: Context) -> None:
        seen.append(ctx.signal.wait(1))  # the signal aborts at 0.2 s; it returns anyway

    scheduler.every("honours", "1m", honours, timeout="200ms")
    scheduler.every("ignores", "1m", ignores, timeout="200ms")
    scheduler.every("quick", "1m", lambda ctx: "done", timeout="5s")
    for name in ("honours", "ignores"):
        outcome = run_job(name, scheduler=scheduler)
        assert outcome.status == "failed", (name, outcome)
        assert isinstance(outcome.error, TimeoutError)
        assert str(outcome.error) == f"Job {name!r} ran past its timeout of 0.2s"
    assert seen == [True]
    quick = run_job("quick", scheduler=scheduler)
    assert (quick.status, quick.result) == ("success", "done")
    assert not quick.context.signal.aborted, "the timer is cancelled once the handler returns"


def test_make_context_checks_what_the_scheduler_checks() -> None:
    saved: list[Any] = []
    ctx = make_context("report", slot=1_800_000_000_000, data={"a": 1}, attempt=2, reason="takeover",
                       progress={"page": 3}, on_save_progress=saved.append)  # fmt: skip
    assert ctx.scheduled_at == datetime(2027, 1, 15, 8, tzinfo=timezone.utc)
    assert (ctx.attempt, ctx.reason, ctx.manual, ctx.progress) == (2, "takeover", False, {"page": 3})
    ctx.save_progress({"page": 4})
    assert saved == [{"page": 4}] and ctx.progress == {"page": 4}
    with pytest.raises(TypeError, match="JSON"):
        ctx.save_progress({1, 2})
    with pytest.raises(ValueError, match="naive"):
        make_context(slot=datetime(2027, 1, 1))


@pytest.mark.django_db
def test_the_fixture(run_job: Any) -> None:
    assert run_job("writer", scheduler=scheduler_with_jobs()).status == "success"


class InDjangoTestCase(TestCase):
    def test_writes_are_rolled_back_with_the_test(self) -> None:
        outcome: Outcome = run_job("writer", scheduler=scheduler_with_jobs())
        self.assertEqual(outcome.status, "success")
        self.assertEqual(Execution.objects.count(), 1)

    def test_and_the_next_test_starts_clean(self) -> None:
        self.assertEqual(Execution.objects.count(), 0)
        self.assertEqual(run_job("async-writer", scheduler=scheduler_with_jobs()).status, "success")

    def test_run_once_refuses_the_tests_transaction_and_leaves_its_connection_alone(self) -> None:
        # run_once() (and `--run`) records its run on connections of its own: inside the test's
        # transaction it would wait on SQLite's lock or lose the run, and it closed this connection.
        Execution.objects.create(job="mine", slot=1, attempt=1, reason="x", instance_id="", pid=0, event="e", at=0.0)
        with self.assertRaisesRegex(AnarchonError, r"cannot run inside a transaction .*run_job\('writer'\)"):
            scheduler_with_jobs().run_once("writer")
        self.assertEqual(Execution.objects.count(), 1)  # the test's connection still answers

    def test_the_next_test_still_has_its_connection(self) -> None:
        self.assertEqual(Execution.objects.count(), 0)

    def test_a_handlers_database_error_leaves_the_test_able_to_query(self) -> None:
        """It raised TransactionManagementError at the test's next query (helper 29): the handler's
        writes are rolled back to where it began when a database error spoiled the transaction."""
        Execution.objects.create(job="mine", slot=1, attempt=1, reason="x", instance_id="", pid=0, event="e", at=0.0)
        outcome = run_job("duplicate", scheduler=scheduler_with_jobs())
        self.assertEqual(outcome.status, "failed")
        self.assertIsInstance(outcome.error, IntegrityError)
        self.assertEqual(list(Execution.objects.values_list("job", flat=True)), ["mine"])
        quiet = run_job("swallowed", scheduler=scheduler_with_jobs())  # caught the error and returned
        self.assertEqual(quiet.status, "success")
        self.assertEqual(list(Execution.objects.values_list("job", flat=True)), ["mine"])

    def test_writes_before_an_error_that_is_not_the_databases_are_kept_as_in_the_scheduler(self) -> None:
        outcome = run_job("writes-then-fails", scheduler=scheduler_with_jobs())
        self.assertEqual((outcome.status, str(outcome.error)), ("failed", "after the row was written"))
        self.assertEqual(list(Execution.objects.values_list("pk", flat=True)), [9])


@pytest.mark.django_db
def test_a_handler_returning_a_generator_fails_as_in_the_scheduler() -> None:
    """The scheduler fails such a run (none of the generator's body ran); run_job called it a success
    (helper 31)."""
    outcome = run_job("gives-a-generator", scheduler=scheduler_with_jobs())
    assert outcome.status == "failed" and isinstance(outcome.error, TypeError)
    assert "returned a generator, so none of its body ran" in str(outcome.error)


@pytest.mark.django_db
def test_without_a_slot_the_run_is_the_jobs_newest_slot_as_the_schedulers_would_be() -> None:
    """It was now to the millisecond, a slot the scheduler never gives a scheduled run (helper 29)."""
    import time

    before = int(time.time() * 1000)
    scheduled = run_job("writer", scheduler=scheduler_with_jobs()).context
    assert scheduled.slot % 3_600_000 == 0 and before - 3_600_000 < scheduled.slot <= before
    manual = run_job("writer", reason="manual", scheduler=scheduler_with_jobs()).context
    assert before <= manual.slot <= int(time.time() * 1000) and manual.manual
