"""Testing your jobs: run a handler in the test's own thread and database connection.

:func:`run_job` calls a job's handler the way the scheduler would (the same
``Context``, data precedence and outcome rules) but here and now, inside the test:
in Django's ``TestCase`` (or pytest-django's ``db`` fixture) the handler's writes
are part of the test's transaction and rolled back with it. Nothing is claimed
or recorded: no ``Run`` row, no lease, no signal. :func:`make_context` builds a
``Context`` for unit tests of functions that take one.

With pytest, add ``pytest_plugins = ["django_anarchon.testing"]`` to a
``conftest.py`` for the ``run_job`` fixture.

``Scheduler.run_once()`` is something else: it runs a job through a real engine
in this process (its own threads and connections, a recorded manual run), as
``manage.py anarchon --run`` does, and is not meant for ``TestCase``.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from asgiref.sync import async_to_sync
from django.db import DatabaseError, connections, transaction

from . import taskjobs
from .conf import check_json, get_settings
from .context import Context
from .exceptions import Interrupted
from .registry import UNSET, Job, returned_generator
from .signal import AbortSignal
from .taskjobs import TaskArguments

__all__ = ["Outcome", "make_context", "run_job"]


@dataclass
class Outcome:
    """What a handler did: ``status`` (``success``, ``failed``, ``interrupted``), as the run would be recorded."""

    status: str
    error: BaseException | None
    result: Any  # what the handler returned (not stored by the scheduler); a task job: what was enqueued
    progress: Any  # the last value it saved with ctx.save_progress(), or the progress it was given
    context: Context

    def raise_error(self) -> None:
        """Raise the handler's exception, if it raised one (handy in a test that expects success)."""
        if self.error is not None:
            raise self.error


def make_context(
    name: str = "job",
    *,
    slot: int | datetime | None = None,
    data: Any = None,
    attempt: int = 1,
    reason: str = "scheduled",
    manual: bool | None = None,
    progress: Any = None,
    instance_id: str = "test",
    signal: AbortSignal | None = None,
    on_save_progress: Callable[[Any], None] | None = None,
) -> Context:
    """A ``Context`` as a handler receives it, for unit tests.

    ``slot`` is ms since the epoch or an aware datetime (default: now, to the
    millisecond). ``ctx.save_progress()`` checks the value as the scheduler does
    and calls ``on_save_progress`` with it; nothing is written.
    """
    if slot is None:
        slot = int(time.time() * 1000)
    elif isinstance(slot, datetime):
        if slot.tzinfo is None:
            raise ValueError(f"slot {slot!r} is a naive datetime; give an aware one (or ms since the epoch)")
        slot = int(slot.timestamp() * 1000)
    if data is not None:
        check_json(data, f"The data given for job {name!r}")

    def save(value: Any) -> None:
        check_json(value, f"Progress of job {name!r}")
        if on_save_progress is not None:
            on_save_progress(value)

    return Context(
        name=name,
        slot=slot,
        scheduled_at=datetime.fromtimestamp(slot / 1000, tz=timezone.utc),
        instance_id=instance_id,
        attempt=attempt,
        reason=reason,
        manual=(reason == "manual") if manual is None else manual,
        signal=signal or AbortSignal(),
        data=data,
        progress=progress,
        _save=save,
    )


def run_job(
    job: str | Job,
    *,
    slot: int | datetime | None = None,
    data: Any = UNSET,
    attempt: int = 1,
    reason: str = "scheduled",
    progress: Any = None,
    signal: AbortSignal | None = None,
    scheduler: Any = None,
) -> Outcome:
    """Call ``job``'s handler here, in this thread and on this thread's database connection.

    ``job`` is a name declared on ``scheduler`` (default: the project's) or a
    ``Job``. ``data`` defaults to what the scheduler would give (the job's, else
    ``ANARCHON["DATA"]``). An ``async def`` handler runs to completion here too
    (its ``sync_to_async`` calls use this thread's connection). The outcome is
    what the run would be recorded as: ``success`` if the handler returned,
    ``interrupted`` if it raised ``Interrupted``, ``failed`` if it raised
    anything else, or ran past the job's ``timeout`` (the signal aborts with
    ``TimeoutError`` then, as in the scheduler). Nothing is recorded. A task job's task is enqueued instead
    (with ``slot=`` and, where it takes it, ``data=``); the outcome's ``result``
    says what was enqueued, and a task the immediate backend ran and saw raise
    is ``failed`` with :class:`TaskFailed`.
    """
    if isinstance(job, str):
        if scheduler is None:
            from .scheduler import scheduler as default

            scheduler = default
        found: Job = scheduler.job(job)
    else:
        found = job
    job = found
    if data is UNSET:
        data = job.data if job.has_data else get_settings().data
    else:
        job.refuse_data_for_dataless_task(data, "run_job")  # as run_now() and --run: not dropped
    if slot is None and reason != "manual":
        # What the scheduler would be running now: the job's newest slot (a manual run's is any instant).
        slot = job.schedule.latest_at_or_before(int(time.time() * 1000))
    saved: list[Any] = []
    ctx = make_context(
        job.name,
        slot=slot,
        data=data,
        attempt=attempt,
        reason=reason,
        progress=progress,
        signal=signal,
        on_save_progress=saved.append,
    )
    if job.task is not None:
        # A task job's run enqueues its task (here: on the test's connection, in its transaction).
        arguments = job.task_arguments or TaskArguments(data=False)
        try:
            # In a transaction of its own (a savepoint in the test's), as the scheduler enqueues:
            # a task the immediate backend ran and saw raise leaves none of its writes.
            from .store import alias  # not at import: pytest loads this module before Django is set up

            with transaction.atomic(using=alias()):
                enqueued = taskjobs.enqueue(job.task, arguments, ctx.slot, data)
        except BaseException as error:  # noqa: B036 - as the scheduler does: every ending is an outcome
            return Outcome("failed", error, None, progress, ctx)
        return Outcome("success", None, enqueued, progress, ctx)
    handler = job.handler
    # The job's timeout, as the scheduler applies it: the signal aborts with TimeoutError when it
    # passes, and a handler still running then is failed with it, whatever it does afterwards.
    timer, timed_out = None, job.timeout_error()
    if job.timeout_ms:
        timer = threading.Timer(job.timeout_ms / 1000, ctx.signal.abort, (timed_out,))
        timer.daemon = True
        timer.start()
    taken = _savepoints()
    ended: BaseException | None = None
    try:
        if job.is_async:
            result = async_to_sync(handler)(ctx)
        else:
            result = handler(ctx)
            if (refused := returned_generator(job.name, result)) is not None:
                raise refused
            if inspect.isawaitable(result):  # a callable object that returned a coroutine
                result = async_to_sync(_await)(result)
    except Interrupted as raised:
        ended = raised
        outcome = Outcome("interrupted", raised, None, saved[-1] if saved else progress, ctx)
    except BaseException as raised:  # noqa: B036 - as the scheduler does: every ending is an outcome
        ended = raised
        outcome = Outcome("failed", raised, None, saved[-1] if saved else progress, ctx)
    else:
        outcome = Outcome("success", None, result, saved[-1] if saved else progress, ctx)
    finally:
        _settle(taken, ended)
    if timer is not None:
        timer.cancel()
        if ctx.signal.reason is timed_out:
            return Outcome("failed", timed_out, None, outcome.progress, ctx)
    return outcome


def _savepoints() -> list[tuple[Any, Any]]:
    """A savepoint on each of this thread's connections that is inside a transaction (a test's)."""
    return [(c, c.savepoint()) for c in connections.all(initialized_only=True) if c.in_atomic_block]


def _settle(taken: list[tuple[Any, Any]], error: BaseException | None) -> None:
    """After the handler: keep its writes, unless a database error left the transaction unusable.

    In the scheduler a handler runs in autocommit, and a failed query spoils nothing after it.
    Inside a test's transaction it would (PostgreSQL refuses every later query; Django's
    ``atomic`` marks the block for rollback): the handler's writes are rolled back to where it
    began, so that the test can query on and look at the outcome.
    """
    for connection, savepoint in taken:
        if not connection.needs_rollback and not isinstance(error, DatabaseError):
            try:
                connection.savepoint_commit(savepoint)
                continue
            except DatabaseError:  # a failed query the handler caught and swallowed (PostgreSQL)
                pass
        connection.needs_rollback = False
        try:
            connection.savepoint_rollback(savepoint)
        except DatabaseError:  # the connection itself was lost: the test meets that at its next query
            connection.needs_rollback = True


async def _await(awaitable: Any) -> Any:
    return await awaitable


try:
    import pytest
except ImportError:  # pragma: no cover - only pytest users load this as a plugin
    pass
else:

    @pytest.fixture(name="run_job")
    def run_job_fixture() -> Callable[..., Outcome]:
        """:func:`run_job`, as a fixture (``pytest_plugins = ["django_anarchon.testing"]``)."""
        return run_job
