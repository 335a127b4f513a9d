"""Holding a run: takeover of expired leases, hand-over, renewal, progress and the final record."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from django.db import transaction
from django.db.models import Case, F, Value, When

from ..dbtime import DbNow, db_in, db_not_before
from ..exceptions import AttemptsExhausted
from ..models import Reason, Run, Status
from . import statements
from .base import (
    _runs,
    alias,
    notify,
    retry_deadlocks,
    storable_text,
)

E = TypeVar("E")


def _held(owner: str) -> Any:
    """The runs whose lease ``owner`` still holds: ours, running, not expired by the database clock.

    Every write by a runner (renewal, progress, its end, a hand-over) goes
    through this condition, so a runner that lost its lease changes nothing.
    """
    return _runs().filter(owner=owner, status=Status.RUNNING, lease_expires_at__gt=DbNow())


# As a handler's exception is recorded: its module and name.
ATTEMPTS_EXHAUSTED = f"{AttemptsExhausted.__module__}.{AttemptsExhausted.__qualname__}"


def _give_up_values(attempt: int, max_attempts: int, why: str) -> dict[str, Any]:
    """The columns of the last allowed attempt of a run, recorded ``failed`` instead of handed on."""
    message = (
        f"gave up after {attempt} attempt(s) (MAX_ATTEMPTS={max_attempts}): attempt {attempt} was interrupted, {why}"
    )
    return {
        "status": Status.FAILED,
        "finished_at": DbNow(),
        "lease_expires_at": None,
        "error_type": ATTEMPTS_EXHAUSTED,
        "error_message": message,
        "detail": message,
    }


@retry_deadlocks
def take_over(
    run: Run, *, owner: str, instance_id: str, ttl: float, start: bool, max_attempts: int | None = None
) -> tuple[Run, Run | None] | None:
    """Take over a run whose lease expired; return (old attempt, new attempt) or None.

    The conditional UPDATE marks the expired attempt ``interrupted`` only if it
    is still running and its lease is still expired by the database clock; it
    locks the row, so against a concurrent renewal or another backup exactly one
    wins. The winner inserts the next attempt in the same transaction: running
    and owned by ``owner`` if ``start``, else pending for whoever has room.

    An attempt that was the run's ``max_attempts``-th is recorded ``failed``
    (``AttemptsExhausted``) instead, by the same kind of conditional UPDATE,
    and no attempt follows: the new attempt is None.
    """
    why = (
        f"its lease expired: {run.instance_id or 'its instance'} stopped renewing it "
        "(crashed, froze or lost the database)"
    )
    with transaction.atomic(using=alias()):
        expired = _runs().filter(id=run.id, status=Status.RUNNING, lease_expires_at__lt=DbNow())
        if max_attempts is not None and expired.filter(attempt__gte=max_attempts).update(
            **_give_up_values(run.attempt, max_attempts, why)
        ):
            return _runs().get(id=run.id), None
        won = expired.update(status=Status.INTERRUPTED, finished_at=DbNow(), lease_expires_at=None, detail=why)
        if not won:
            return None
        old = _runs().get(id=run.id)
        new = _next_attempt(old, owner=owner, instance_id=instance_id, ttl=ttl, start=start)
    return old, new


def _next_attempt(old: Run, *, owner: str, instance_id: str, ttl: float, start: bool) -> Run:
    new = Run(
        job=old.job,
        slot=old.slot,
        attempt=old.attempt + 1,
        status=Status.RUNNING if start else Status.PENDING,
        reason=Reason.TAKEOVER,
        manual=old.manual,
        scheduled_at=old.scheduled_at,
        data=old.data,
        progress=old.progress,
        created_at=DbNow(),
        detail=f"takes over attempt {old.attempt} from {old.instance_id or 'an instance'}",
    )
    if start:
        new.owner = owner
        new.instance_id = instance_id
        new.started_at = db_not_before(old.scheduled_at)  # the handler starts at the slot, not before
        new.lease_expires_at = db_in(ttl)
    new.save(using=alias(), force_insert=True)
    new.refresh_from_db()
    return new


@retry_deadlocks
def hand_over(
    run_id: int, *, owner: str, detail: str, max_attempts: int | None = None, started: bool = True
) -> tuple[Run, Run | None] | None:
    """Release a run this process holds so that another instance continues it.

    Marks the attempt ``interrupted`` (only if the lease is still ours and
    live) and inserts the next attempt as ``pending`` in the same transaction,
    then notifies the other instances. Returns (old, new) or None if the run
    was no longer ours. The run's ``max_attempts``-th attempt is recorded
    ``failed`` (``AttemptsExhausted``) instead, and new is None. ``started``:
    whether its handler was called (if not, the attempt gets no start time).
    """
    with transaction.atomic(using=alias()):
        # The write comes first: on SQLite it takes the database's write lock, which another
        # process's commit is waited out for (the busy timeout). A read first would have begun a
        # snapshot that such a commit makes stale, and the write after it fail at once with
        # "database is locked" (helper 40: at a stop beside a second instance).
        held = _held(owner).filter(id=run_id)
        won = held.update(
            status=Status.INTERRUPTED,
            finished_at=DbNow(),
            lease_expires_at=None,
            detail=detail,
            # Stopped before its handler was called (``started`` False: before its slot, or while it
            # waited for a worker): it never started, and says so, however late this is recorded.
            started_at=(
                Case(When(started_at__gt=DbNow(), then=Value(None)), default=F("started_at")) if started else None
            ),
        )
        if not won:
            return None
        old = _runs().get(id=run_id)
        if max_attempts is not None and old.attempt >= max_attempts:
            _runs().filter(id=run_id).update(**_give_up_values(old.attempt, max_attempts, "stopped with its instance"))
            return _runs().get(id=run_id), None
        new = _next_attempt(old, owner="", instance_id="", ttl=0, start=False)
        notify("handover")
    return old, new


def renew(ids: Sequence[int], *, owner: str, ttl: float) -> tuple[set[int], list[Run]]:
    """Extend the leases of ``ids``; return (still held, lost rows).

    Only leases that are ours, running and still live are extended; a lease
    that expired stays expired (a backup may already be starting), and a run
    that was replaced or taken over is lost. One UPDATE for all runs; a second
    query only when some were lost, to say why.
    """
    if not ids:
        return set(), []
    ids = list(ids)
    renewed = _held(owner).filter(id__in=ids).update(lease_expires_at=db_in(ttl))
    if renewed == len(ids):
        return set(ids), []
    held = set(_held(owner).filter(id__in=ids).values_list("id", flat=True))
    lost = list(_runs().filter(id__in=[i for i in ids if i not in held]))
    return held, lost


def finish(
    run_id: int,
    *,
    owner: str,
    status: str,
    error_type: str = "",
    error_message: str = "",
    traceback: str = "",
    detail: str = "",
    started_at: datetime | None = None,
    started: bool = True,
) -> bool:
    """Record the outcome of a run we hold; False if it is no longer ours to record.

    ``started_at``: when its handler started, where that was well after the claim's
    ``started_at`` (the run waited for a worker). ``started`` False: its handler was never
    called (withdrawn before its slot), and the start its claim planned is cleared.

    The UPDATE requires our token and status ``running``, so a run that was
    taken over or replaced (marked ``interrupted`` under the row's lock) changes
    nothing; a lease that ran out while the database was unreachable, with
    nobody taking the run over meanwhile, still lets the end be written (see
    ``statements.end_held``). Idempotent: a retry after a lost reply finds the status
    already written by us and still answers True.
    """
    texts = {"error_type": error_type[:255], "error_message": error_message, "traceback": traceback, "detail": detail}
    done = statements.end_held(
        [run_id], owner=owner, status=status, texts=texts, started_at=started_at, clear_start=not started
    )
    return bool(done) or _runs().filter(id=run_id, owner=owner, status=status, lease_expires_at=None).exists()


def finish_many(run_ids: Sequence[int], *, owner: str) -> set[int]:
    """Record ``success`` for runs we hold, in one UPDATE; return the ids recorded.

    Same conditions as :func:`finish`. Only when some were not recorded does a
    second query tell which ones are ours (a row in ``success`` with our token
    can only have been written by us: each attempt ends once).
    """
    ids = list(run_ids)
    done = statements.end_held(ids, owner=owner, status=Status.SUCCESS)
    if done == len(ids):
        return set(ids)
    return set(_runs().filter(id__in=ids, owner=owner, status=Status.SUCCESS).values_list("id", flat=True))


def held_by(owner: str) -> list[Run]:
    """The runs ``owner`` holds running, by the database (whatever their lease says)."""
    return list(_runs().filter(owner=owner, status=Status.RUNNING))


def save_progress(run_id: int, value: Any, *, owner: str, ttl: float) -> bool:
    """Store ``value`` as the run's progress and renew its lease; False if the run is not ours."""
    return bool(_held(owner).filter(id=run_id).update(progress=value, lease_expires_at=db_in(ttl)))


def finish_enqueued(run_id: int, *, owner: str, enqueue: Callable[[], E]) -> E | None:
    """Enqueue a task job's task and record the run ``success`` in one transaction; None if not ours.

    ``enqueue`` runs first, inside the transaction, and returns what was
    enqueued (its ``result_id`` is stored with the run); the run's end is
    written after it, with the same conditions as :func:`finish` (our token,
    ``running``, not taken over). If the run is no longer
    ours the transaction is rolled back, and with it the task's row wherever
    the task backend writes to this database on this thread: a run that a
    takeover decided never enqueues its task, and a run recorded ``success``
    always did. The end's UPDATE locks the run's row, so against a concurrent
    takeover exactly one commits. What ``enqueue`` raises propagates, with the
    transaction rolled back.
    """
    db = alias()
    with transaction.atomic(using=db):
        enqueued = enqueue()
        result_id = storable_text(str(getattr(enqueued, "result_id", "")))[:255]
        done = statements.end_held([run_id], owner=owner, status=Status.SUCCESS, texts={"task_result_id": result_id})
        if not done:
            transaction.set_rollback(True, using=db)
            return None
    return enqueued
