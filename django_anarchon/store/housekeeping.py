"""Job rows, live instances, the database clock and history pruning."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from django.db import connections, transaction
from django.db.models import DateTimeField, ExpressionWrapper, Q

from ..models import Instance, JobState, Status
from ..registry import Job
from .base import (
    UTC,
    DbNow,
    _newest_scheduled_slots,
    _runs,
    _vendor,
    alias,
)


def ensure_jobs(jobs: Iterable[Job]) -> None:
    """Create the JobState rows of declared jobs and keep their schedule text current."""
    db = alias()
    rows = [JobState(name=j.name, schedule=j.schedule.describe()[:300], first_seen=DbNow()) for j in jobs]
    for start in range(0, len(rows), 500):
        JobState.objects.using(db).bulk_create(rows[start : start + 500], ignore_conflicts=True)
    known = dict(JobState.objects.using(db).values_list("name", "schedule"))
    stale = [r for r in rows if known.get(r.name) != r.schedule]
    for row in stale:
        JobState.objects.using(db).filter(name=row.name).update(schedule=row.schedule)


def register_instance(token: str, instance_id: str, host: str, pid: int) -> None:
    """Record this process as a live instance (its token is unique, so no race to decide)."""
    # Write first: update_or_create() reads then writes in one transaction, which
    # SQLite refuses at once ("database is locked") when another process writes.
    values = {"instance_id": instance_id, "host": host[:255], "pid": pid, "last_heartbeat": DbNow()}
    instances = Instance.objects.using(alias())
    if not instances.filter(token=token).update(**values):
        instances.bulk_create([Instance(token=token, started_at=DbNow(), **values)], ignore_conflicts=True)


def heartbeat(token: str, instance_id: str, host: str, pid: int) -> None:
    """Refresh this instance's heartbeat (re-registering if its row was pruned)."""
    if not Instance.objects.using(alias()).filter(token=token).update(last_heartbeat=DbNow()):
        register_instance(token, instance_id, host, pid)


def unregister_instance(token: str) -> None:
    Instance.objects.using(alias()).filter(token=token).delete()


def live_instances(within: float) -> list[str]:
    """The tokens of the instances heard from in the last ``within`` seconds (database clock)."""
    fresh = ExpressionWrapper(DbNow() - timedelta(seconds=within), output_field=DateTimeField())
    return list(Instance.objects.using(alias()).filter(last_heartbeat__gte=fresh).values_list("token", flat=True))


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


def prune(retention: float | None, batch: int = 1000) -> int:
    """Delete finished runs older than ``retention`` seconds (None keeps them) and instances silent for a day.

    What catch-up needs of the deleted runs, each job's newest scheduled slot,
    is kept in ``JobState.pruned_slot``, so that a job whose last run is older
    than the retention (a monthly job, a week's retention) still catches up.
    """
    db = alias()
    deleted = 0
    cutoff = ExpressionWrapper(DbNow() - timedelta(seconds=retention or 0), output_field=DateTimeField())
    while retention is not None:
        ids = list(
            _runs()
            .filter(finished_at__lt=cutoff)
            .exclude(status__in=[Status.RUNNING, Status.PENDING])
            .values_list("id", flat=True)[:batch]
        )
        if not ids:
            break
        newest = _newest_scheduled_slots(_runs().filter(id__in=ids))
        with transaction.atomic(using=db):
            # Catch-up counts from a job's newest scheduled slot on record: keep
            # it on the job's row before the runs that hold it go (job rows
            # first, in name order, like every claim).
            for name in sorted(newest):
                JobState.objects.using(db).filter(name=name).filter(
                    Q(pruned_slot__isnull=True) | Q(pruned_slot__lt=newest[name])
                ).update(pruned_slot=newest[name])
            deleted += _runs().filter(id__in=ids).delete()[0]
    stale = ExpressionWrapper(DbNow() - timedelta(days=1), output_field=DateTimeField())
    Instance.objects.using(db).filter(last_heartbeat__lt=stale).delete()
    return deleted
