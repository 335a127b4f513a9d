"""Job rows, live instances, the database clock and history pruning."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models import DateTimeField, ExpressionWrapper, Q

from ..dbtime import DbNow
from ..models import Instance, JobState, Run, Status
from ..registry import Job
from . import statements
from .base import (
    UTC,
    _newest_scheduled_slots,
    _runs,
    _vendor,
    alias,
)


def ensure_jobs(jobs: Iterable[Job]) -> None:
    """Create the JobState rows of declared jobs, keep their schedule text current, stamp ``declared_at``.

    Called at start and hourly: ``declared_at`` tells :func:`close_undeclared`
    which jobs some running instance still declares.
    """
    db = alias()
    states = JobState.objects.using(db)
    rows = [JobState(name=j.name, schedule=j.schedule.describe()[:300], first_seen=DbNow()) for j in jobs]
    for start in range(0, len(rows), 500):
        batch = rows[start : start + 500]
        states.bulk_create(batch, ignore_conflicts=True)
        states.filter(name__in=[r.name for r in batch]).update(declared_at=DbNow())
    known = dict(states.values_list("name", "schedule"))
    stale = [r for r in rows if known.get(r.name) != r.schedule]
    for row in stale:
        states.filter(name=row.name).update(schedule=row.schedule)


def close_undeclared(grace: float) -> dict[str, int]:
    """Close the waiting and abandoned runs of jobs no running instance has declared for ``grace`` seconds.

    Their pending runs are recorded ``missed`` and their running runs whose
    lease has expired ``interrupted``, each with the reason: no instance would
    ever pick them up or take them over, and a pile of them would wait in
    every poll for good. A running run whose lease is live is left alone (an
    instance holds it). Each row changes by a conditional UPDATE on its
    status, so a run claimed meanwhile stays as it is. Returns the number of
    runs closed per job.
    """
    states = JobState.objects.using(alias())
    cutoff = ExpressionWrapper(DbNow() - timedelta(seconds=grace), output_field=DateTimeField())
    stale = states.filter(Q(declared_at__lt=cutoff) | Q(declared_at__isnull=True, first_seen__lt=cutoff))
    waiting = (
        _runs()
        .filter(job__in=stale.values("name"))
        .filter(Q(status=Status.PENDING) | Q(status=Status.RUNNING, lease_expires_at__lt=DbNow()))
    )
    closed: dict[str, int] = {}
    rows = list(waiting.values_list("id", "job", "status")[:1000])
    for status, new_status in ((Status.PENDING, Status.MISSED), (Status.RUNNING, Status.INTERRUPTED)):
        ids = [i for i, _, s in rows if s == status]
        if not ids:
            continue
        changed = _runs().filter(id__in=ids, status=status)
        if status == Status.RUNNING:
            changed = changed.filter(lease_expires_at__lt=DbNow())
        done = set(changed.values_list("id", flat=True))
        changed.update(
            status=new_status,
            finished_at=DbNow(),
            lease_expires_at=None,
            detail=f"no running instance has declared this job for {grace / 3600:g} hour(s); "
            f"closed instead of waiting for ever",
        )
        for i, job, _ in rows:
            if i in done:
                closed[job] = closed.get(job, 0) + 1
    return closed


def register_instance(token: str, instance_id: str, host: str, pid: int) -> None:
    """Record this process as a live instance (its token is unique, so no race to decide)."""
    # Write first: update_or_create() reads then writes in one transaction, which
    # SQLite refuses at once ("database is locked") when another process writes.
    values = {"instance_id": instance_id, "host": host[:255], "pid": pid, "last_heartbeat": DbNow()}
    instances = Instance.objects.using(alias())
    if not instances.filter(token=token).update(**values):
        instances.bulk_create([Instance(token=token, started_at=DbNow(), **values)], ignore_conflicts=True)


def heartbeat(token: str, instance_id: str, host: str, pid: int, clock_offset_ms: float | None = None) -> None:
    """Refresh this instance's heartbeat and its clock's offset (re-registering if its row was pruned).

    The loop writes it, so a fresh heartbeat also says the loop turns and reaches the database.
    """
    values = {"last_heartbeat": DbNow(), "clock_offset_ms": clock_offset_ms}
    if not Instance.objects.using(alias()).filter(token=token).update(**values):
        register_instance(token, instance_id, host, pid)


def unregister_instance(token: str) -> None:
    Instance.objects.using(alias()).filter(token=token).delete()


def live_instances(within: float) -> list[str]:
    """The tokens of the instances heard from in the last ``within`` seconds (database clock)."""
    return statements.live_tokens(within)


def namesakes(token: str, instance_id: str, within: float) -> list[tuple[str, int]]:
    """The other live instances (heard from in the last ``within`` seconds) named ``instance_id``: (host, pid)."""
    cutoff = ExpressionWrapper(DbNow() - timedelta(seconds=within), output_field=DateTimeField())
    rows = Instance.objects.using(alias()).filter(instance_id=instance_id, last_heartbeat__gte=cutoff)
    return list(rows.exclude(token=token).order_by("host", "pid").values_list("host", "pid"))


def orphaned_holder(job: str) -> Any:
    """The run holding ``job`` that only a running scheduler can move on, or None.

    A ``running`` run whose lease has expired (its instance stopped or froze) is taken over,
    and a handed-over attempt waiting as ``pending`` is run, by a scheduler instance's loop.
    """
    runs = Run.objects.using(alias()).filter(job=job)
    expired = runs.filter(status=Status.RUNNING, lease_expires_at__lt=DbNow())
    handed_over = runs.filter(status=Status.PENDING, attempt__gt=1)
    return expired.order_by("slot").first() or handed_over.order_by("slot").first()


def database_time() -> datetime:
    """The database clock, read once."""
    vendor = _vendor()
    if vendor == "postgresql":
        sql = "SELECT STATEMENT_TIMESTAMP()"
    elif vendor == "mysql":
        sql = "SELECT UTC_TIMESTAMP(6)"
    else:
        sql = "SELECT STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')"
    with connections[alias()].cursor() as cursor:
        cursor.execute(sql)
        raw = cursor.fetchone()[0]
    if isinstance(raw, str):
        raw = datetime.fromisoformat(raw)
    if raw.tzinfo is None:
        raw = raw.replace(tzinfo=UTC)
    return raw  # type: ignore[no-any-return]


def prune_batch(retention: float, batch: int) -> int:
    """Delete up to ``batch`` finished runs older than ``retention`` seconds; how many were deleted (0: none left).

    The scheduler calls it a batch at a time, with pauses between (see ``Engine._run_pruner``).

    What catch-up needs of the deleted runs, each job's newest scheduled slot,
    is kept in ``JobState.pruned_slot`` first, so that a job whose last run is
    older than the retention (a monthly job, a week's retention) still catches
    up. That write takes the job rows' locks (which claims take too), so it is
    a transaction of its own, over in a moment; the runs are deleted after it
    commits, holding no job lock. A crash in between leaves the runs and a
    floor that is no newer than they are: nothing is lost, the next prune
    deletes them.
    """
    db = alias()
    cutoff = ExpressionWrapper(DbNow() - timedelta(seconds=retention), output_field=DateTimeField())
    ids = list(
        _runs()
        .filter(finished_at__lt=cutoff)
        .exclude(status__in=[Status.RUNNING, Status.PENDING])
        .values_list("id", flat=True)[:batch]
    )
    if not ids:
        return 0
    newest = _newest_scheduled_slots(_runs().filter(id__in=ids))
    if newest:
        with transaction.atomic(using=db):
            # Job rows in name order, like every claim.
            for name in sorted(newest):
                JobState.objects.using(db).filter(name=name).filter(
                    Q(pruned_slot__isnull=True) | Q(pruned_slot__lt=newest[name])
                ).update(pruned_slot=newest[name])
    return int(_runs().filter(id__in=ids).delete()[0])


def prune_instances() -> None:
    """Remove instances that have sent no heartbeat for a day from the instance list."""
    stale = ExpressionWrapper(DbNow() - timedelta(days=1), output_field=DateTimeField())
    Instance.objects.using(alias()).filter(last_heartbeat__lt=stale).delete()


class _Guarded(threading.local):
    def __init__(self) -> None:
        self.connections: dict[str, Any] = {}  # alias -> the DB-API connection already limited


_guarded = _Guarded()


def limit_idle_transactions(seconds: float) -> None:
    """Have the server end this thread's session if it sits idle inside a transaction for ``seconds``.

    A process frozen (SIGSTOP, a suspended VM) in the middle of a claim holds
    the job rows it locked until it resumes: no other instance could decide
    those jobs' slots meanwhile. With this limit the server drops the frozen
    session and its locks after about one lease (the frozen process finds its
    connection gone when it wakes, and reconnects). Set once per connection
    (PostgreSQL ``idle_in_transaction_session_timeout``, MariaDB
    ``idle_transaction_timeout``); MySQL and SQLite have no such limit (a
    frozen SQLite writer holds the file's lock until it resumes).
    """
    db = alias()
    connection = connections[db]
    connection.ensure_connection()
    raw = connection.connection
    if _guarded.connections.get(db) is raw:
        return
    vendor = connection.vendor
    with connection.cursor() as cursor:
        if vendor == "postgresql":
            cursor.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
                [str(max(1, math.ceil(seconds * 1000)))],
            )
        elif vendor == "mysql" and getattr(connection, "mysql_is_mariadb", False):
            cursor.execute("SET SESSION idle_transaction_timeout = %s", [max(1, math.ceil(seconds))])
    _guarded.connections[db] = raw


@dataclass(frozen=True)
class Overdue:
    """A job that has had no success for longer than its ``alert_after``."""

    job: str
    last_success: datetime | None
    without_success: timedelta  # since the last success (or the job's first sighting, or its resume if later)


def overdue_since(
    last_success: datetime | None, first_seen: datetime | None, resumed_at: datetime | None
) -> datetime | None:
    """Since when a job has gone without a success, as ``job_overdue`` and the age gauge count it.

    Its last success; if it never succeeded (or that success was pruned), when it was first
    seen; and its resume, if later (paused meanwhile, its slots were not run).
    """
    since = last_success or first_seen
    if resumed_at is not None and (since is None or resumed_at > since):
        return resumed_at
    return since


def claim_overdue_alerts(jobs: Iterable[Job]) -> list[Overdue]:
    """The jobs among ``jobs`` (those with ``alert_after``) now overdue whose alert this caller is to send.

    A job is overdue when its last success (or, if it never succeeded, when it was
    first seen; or its resume, if it was paused since) is older than its
    ``alert_after`` by the database clock; a paused job is never overdue. The alert
    is claimed by a conditional UPDATE of the job's ``overdue_alerted_at`` (only
    if no alert was sent since the last success), so one instance of the
    cluster sends it, once per lapse; a success afterwards arms it again.
    """
    wanted = {job.name: job for job in jobs if job.alert_after_ms}
    if not wanted:
        return []
    db = alias()
    now = database_time()
    last = statements.newest_successes(sorted(wanted))
    states = JobState.objects.using(db).filter(name__in=list(wanted), paused=False)
    found = []
    rows = states.values_list("name", "first_seen", "resumed_at", "overdue_alerted_at")
    for name, first_seen, resumed_at, alerted in rows:
        since = overdue_since(last.get(name), first_seen, resumed_at)
        if since is None:
            continue
        silent = now - since
        if silent <= timedelta(milliseconds=wanted[name].alert_after_ms or 0):
            continue
        if alerted is not None and alerted >= since:
            continue  # sent for this lapse already
        armed = Q(overdue_alerted_at__isnull=True) | Q(overdue_alerted_at__lt=since)
        if JobState.objects.using(db).filter(armed, name=name).update(overdue_alerted_at=DbNow()):
            found.append(Overdue(name, last.get(name), silent))
    return found
