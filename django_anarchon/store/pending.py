"""Runs that wait: the poll for them, claiming pending runs, manual runs, cancelling."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from django.db import IntegrityError, transaction

from ..dbtime import DbNow, db_in, db_not_before
from ..models import JobState, Reason, Run, Status
from ..registry import Job
from . import statements
from .base import (
    STARTED_AFTER_WAITING,
    Outcome,
    Poll,
    _interrupt,
    _runs,
    _views,
    alias,
    notify,
    retry_deadlocks,
    slot_datetime,
)
from .housekeeping import database_time


def poll(expiring_within: float = 0.0, paused_among: Iterable[str] = ()) -> Poll:
    """What needs someone: running runs whose lease has expired, and the jobs with pending runs.

    With ``expiring_within`` (seconds), also the running runs whose lease expires
    within that time by the database clock, so that the caller can come back
    for them when it does instead of a poll later. A healthy runner renews long
    before that, so these are the runs of a runner that has stopped renewing.

    Every such running run is returned, however many pending runs wait: a
    backlog (hundreds of manual runs queued behind a long job, an outage's
    catch-up) must never hide a crashed runner's lease from takeover. Pending
    runs come as one name per job: :func:`claim_pending` re-reads them under
    the job locks anyway. With ``paused_among`` (job names), also which of
    those jobs are paused now. One statement; a read only, nothing is decided here.
    """
    rows, paused = statements.poll_rows(expiring_within, sorted(set(paused_among)))
    result = Poll(paused=paused)
    for row in rows:
        if row.status == Status.RUNNING:
            result.expiring.append(row)
        else:
            result.pending_jobs.append(row.job)
    return result


@retry_deadlocks
def claim_pending(
    names: Iterable[str], jobs: dict[str, Job], *, owner: str, instance_id: str, ttl: float, capacity: int
) -> Outcome:
    """Claim pending runs (manual, queued, catch-up, handed-over) that may start now.

    Under the job locks, re-reads what each job is doing: a handed-over attempt
    (attempt > 1) always may start; a first attempt starts if the job's overlap
    allows it now (``allow``: always; ``skip``/``queue``: when nothing of the job
    is active, oldest first, one at a time; ``replace``: a manual run interrupts
    what runs, a catch-up waits for it). Queued and catch-up runs of a paused job are skipped; manual runs
    and takeovers still run. The claim is a conditional UPDATE
    ``pending -> running``; rowcount 1 means won.
    """
    outcome = Outcome()
    names = sorted({name for name in names if name in jobs})
    if not names or capacity <= 0:
        return outcome
    db = alias()
    with transaction.atomic(using=db):
        states = statements.lock_jobs(names)
        views = _views(names)
        budget = capacity
        chosen: list[Run] = []
        pause_skips: list[int] = []
        replace_ids: list[int] = []
        for name in names:
            job, view, paused = jobs[name], views[name], states[name].paused
            for row in view.active:
                if row.status != Status.PENDING:
                    continue
                if paused and not row.manual and not _previous_attempt_started(row):
                    # Handed over before its handler started (stopped before its slot): the first
                    # run of its slot would start while the job is paused (helper 41), where its
                    # instance, had it lived, would have withdrawn it. One whose handler had
                    # started carries on its work, as a takeover after a crash does.
                    pause_skips.append(row.id)  # type: ignore[arg-type]
                elif budget > 0:  # handed over: already admitted
                    chosen.append(row)
                    budget -= 1
            started_here = False
            for row in view.queued:  # oldest first
                if paused and not row.manual:
                    pause_skips.append(row.id)  # type: ignore[arg-type]
                    continue
                if budget <= 0:
                    break
                if job.overlap != "allow":
                    if started_here:
                        break  # one at a time
                    if view.active:
                        if job.overlap != "replace" or not row.manual:
                            # Waits until the active run ends. Under replace only a manual
                            # run replaces: catch-ups of an outage are older than what runs,
                            # and would replace one another (and the current slot) in turn.
                            break
                        replace_ids.extend(r.id for r in view.active if r.id is not None)
                    started_here = True
                chosen.append(row)
                budget -= 1
        if pause_skips:
            _runs().filter(id__in=pause_skips, status=Status.PENDING).update(
                status=Status.SKIPPED, finished_at=DbNow(), detail="the job is paused"
            )
            outcome.skipped = list(_runs().filter(id__in=pause_skips, status=Status.SKIPPED))
        if replace_ids:
            outcome.interrupted = _interrupt(replace_ids, "replaced by a manual or queued run (overlap='replace')")
        for row in chosen:
            won = (
                _runs()
                .filter(id=row.id, status=Status.PENDING)
                .update(
                    status=Status.RUNNING,
                    owner=owner,
                    instance_id=instance_id,
                    # A handed-over attempt of a slot still ahead starts at its slot, not before.
                    started_at=db_not_before(row.scheduled_at),
                    lease_expires_at=db_in(ttl),
                    detail=STARTED_AFTER_WAITING.get(row.detail, row.detail),
                )
            )
            if won:
                outcome.won.append(_runs().get(id=row.id))
    return outcome


def _previous_attempt_started(row: Run) -> bool:
    """Whether the attempt before ``row`` (a handed-over attempt) called its handler (a hand-over of
    one that did not leaves it no start time; see :func:`.leases.hand_over`)."""
    previous = _runs().filter(job=row.job, slot=row.slot, attempt=row.attempt - 1, manual=row.manual)
    return previous.filter(started_at__isnull=False).exists()


def cancel_pending(ids: Iterable[int], detail: str) -> list[Run]:
    """Record the given pending runs ``skipped`` with ``detail``; return the ones that were still pending.

    One conditional UPDATE per run (``pending`` to ``skipped``): a run an
    instance claimed meanwhile is running and stays as it is.
    """
    cancelled = []
    for run_id in ids:
        if (
            _runs()
            .filter(id=run_id, status=Status.PENDING)
            .update(status=Status.SKIPPED, finished_at=DbNow(), detail=detail)
        ):
            cancelled.append(_runs().get(id=run_id))
    return cancelled


def create_manual(job: str, data: Any, slot: int | None = None, schedule: str = "") -> Run:
    """Record a pending manual run of ``job`` and notify; return it.

    Its slot is the database clock's millisecond (``slot`` overrides it), bumped
    by 1 ms until no other manual run of the job has it: manual runs have a slot
    space of their own (the unique constraint includes ``manual``), so a manual
    run never takes the row of a scheduled slot, and a caller whose host clock
    is off does not date it wrongly.
    """
    db = alias()
    JobState.objects.using(db).bulk_create(
        [JobState(name=job, schedule=schedule[:300], first_seen=DbNow())], ignore_conflicts=True
    )
    json.dumps(data)  # the caller validated it; this guards the column
    if slot is None:
        slot = int(database_time().timestamp() * 1000)
    for bump in range(1000):
        run = Run(
            job=job,
            slot=slot + bump,
            attempt=1,
            status=Status.PENDING,
            reason=Reason.MANUAL,
            manual=True,
            scheduled_at=slot_datetime(slot + bump),
            data=data,
            created_at=DbNow(),
        )
        try:
            with transaction.atomic(using=db):
                run.save(using=db, force_insert=True)
                notify(f"manual:{run.pk}")
        except IntegrityError:
            continue
        run.refresh_from_db()
        return run
    raise RuntimeError(f"could not find a free slot for a manual run of {job!r}")  # pragma: no cover


@retry_deadlocks
def claim_manual(job: Job, data: Any, slot: int, *, owner: str, instance_id: str, ttl: float) -> Run | None:
    """Start a manual run of ``job`` here and now (``manage.py anarchon --run``).

    Under the job lock: if the job's overlap policy makes it wait (``skip`` or
    ``queue`` while a run of the job is active) nothing is written and None is
    returned; ``replace`` interrupts the active run; otherwise a ``running`` row
    owned by ``owner`` is inserted, at ``slot`` or the next free millisecond.
    """
    db = alias()
    with transaction.atomic(using=db):
        statements.lock_jobs([job.name])
        view = _views([job.name])[job.name]
        if view.active and job.overlap in ("skip", "queue"):
            return None
        if view.active and job.overlap == "replace":
            _interrupt([r.id for r in view.active if r.id is not None], "replaced by a manual run (overlap='replace')")
        taken = set(
            _runs()
            .filter(job=job.name, slot__gte=slot, slot__lt=slot + 1000, attempt=1, manual=True)
            .values_list("slot", flat=True)
        )
        free = next(s for s in range(slot, slot + 1001) if s not in taken)
        run = Run(
            job=job.name,
            slot=free,
            attempt=1,
            status=Status.RUNNING,
            reason=Reason.MANUAL,
            manual=True,
            scheduled_at=slot_datetime(free),
            data=data,
            instance_id=instance_id,
            owner=owner,
            created_at=DbNow(),
            started_at=DbNow(),
            lease_expires_at=db_in(ttl),
        )
        run.save(using=db, force_insert=True)
    run.refresh_from_db()
    return run
