"""What the ownership queries share: the database clock, the job locks, the claim types."""

from __future__ import annotations

import functools
import logging
import random
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

from django.db import (
    DatabaseError,
    DataError,
    IntegrityError,
    NotSupportedError,
    OperationalError,
    ProgrammingError,
    connections,
    router,
)
from django.db.models import Max, Model
from django.db.models.base import ModelState

from ..clock import sleep
from ..dbtime import DbNow
from ..models import Run, Status
from ..registry import Job
from ..slots import Claim

M = TypeVar("M", bound=Model)

logger = logging.getLogger("django_anarchon")
UTC = timezone.utc
NOTIFY_CHANNEL = "django_anarchon"
# "all" catch-up runs at most this many missed slots of a job; older ones are
# recorded as missed, with a warning.
CATCH_UP_LIMIT = 100
# Why a catch-up run waits as pending, and what its row says once it has started (a success row
# that still read "waiting for ..." looked, in the admin, as if the run had not started yet).
WAITING_FOR_A_WORKER = "waiting for a free worker (MAX_WORKERS)"
WAITING_FOR_THE_PREVIOUS_RUN = "waiting for the job's previous run to end (a catch-up)"
# A skip job's slot that came due while its catch-up ran or waited after an outage (see claims._behind_catch_up).
WAITING_FOR_THE_CATCH_UP = "waiting for the job's catch-up to end (the slot came due while it ran after an outage)"
STARTED_AFTER_WAITING = {
    WAITING_FOR_A_WORKER: "waited for a free worker (MAX_WORKERS)",
    WAITING_FOR_THE_PREVIOUS_RUN: "waited for the job's previous run to end (a catch-up)",
    WAITING_FOR_THE_CATCH_UP: "waited for the job's catch-up to end (the slot came due while it ran after an outage)",
}


def alias() -> str:
    """The database alias every scheduler query goes to (the router's choice for writes)."""
    return router.db_for_write(Run)


def _runs() -> Any:
    return Run.objects.using(alias())


def _newest_scheduled_slots(runs: Any) -> dict[str, int]:
    """Each job's newest slot among ``runs`` that were not started by ``run_now()``.

    What catch-up counts from: a manual run (or a takeover attempt of one) says
    nothing about which scheduled slots were run. History pruning keeps the
    same figure of what it deletes.
    """
    newest = runs.filter(manual=False).values("job").annotate(newest=Max("slot"))
    return dict(newest.values_list("job", "newest"))


@functools.lru_cache(maxsize=4096)
def slot_datetime(slot: int) -> datetime:
    """The instant of ``slot`` (ms since the epoch), UTC; cached: a run asks for its slot's up to three times."""
    return datetime.fromtimestamp(slot / 1000, tz=UTC)


def _iso(slot: int) -> str:
    return slot_datetime(slot).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


@functools.cache
def _run_defaults() -> dict[str, Any]:
    """Each of a run's columns by attribute name, with its default (none is mutable)."""
    return {f.attname: f.get_default() for f in Run._meta.concrete_fields}


def built(model: type[M], values: Iterable[tuple[str, Any]] | dict[str, Any], db: str | None = None) -> M:
    """An instance of ``model`` from column values by attribute name: read from ``db``, or not saved (None).

    Set as ``Model.from_db`` sets them, without ``Model.__init__``, which walks
    every field for keyword arguments and sends ``pre_init``/``post_init``: a
    claim builds a row per slot and reads one per job, and that was most of its
    client side. Only for the scheduler's own models: none sets anything in
    ``__init__`` or has a field whose descriptor does (no file, no relation). A
    field left out is deferred, as ``from_db`` leaves it (absent from the dict).
    """
    instance = model.__new__(model)
    state = ModelState()
    state.adding = db is None
    state.db = db
    instance._state = state
    instance.__dict__.update(values)
    return instance


def first_attempt_values(status: str, *, instance_id: str, owner: str) -> dict[str, Any]:
    """The column values that every first attempt with ``status`` decided by ``owner`` shares (a copy)."""
    values = _run_defaults().copy()
    values.update(status=status, instance_id=instance_id, owner=owner)
    return values


def first_attempt(claim: Claim, base: dict[str, Any], data: Any, db: str | None = None) -> Run:
    """The row of the first attempt at ``claim``'s slot: ``base`` (:func:`first_attempt_values`, and
    whatever else every row of a batch shares) with the claim's own values; read from ``db``, or not saved."""
    values = base.copy()
    values["job"] = claim.job.name
    values["slot"] = claim.slot
    values["reason"] = claim.reason
    values["scheduled_at"] = slot_datetime(claim.slot)
    values["data"] = data
    return built(Run, values, db)


@dataclass
class Outcome:
    """What a claiming transaction decided. Every list holds committed rows."""

    won: list[Run] = field(default_factory=list)
    skipped: list[Run] = field(default_factory=list)
    interrupted: list[Run] = field(default_factory=list)
    deferred: list[Claim] = field(default_factory=list)
    missed: list[Run] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)  # jobs locked by another transaction: not decided
    early: list[Claim] = field(default_factory=list)  # claimed ahead while the job was busy: not decided


@dataclass
class Poll:
    """What a poll found: runs whose lease has expired (or is about to), jobs with pending runs,
    and the paused jobs among those it was asked about."""

    expiring: list[Run] = field(default_factory=list)
    pending_jobs: list[str] = field(default_factory=list)
    paused: set[str] = field(default_factory=set)


def _vendor() -> str:
    return str(connections[alias()].vendor)


Fn = TypeVar("Fn", bound=Callable[..., Any])
_DEADLOCK_CODES = {1213, 1205, "40P01", "40001"}  # MySQL deadlock/lock wait timeout; PostgreSQL


def _is_deadlock(error: BaseException) -> bool:
    cause = error.__cause__ or error
    code = getattr(cause, "sqlstate", None) or (cause.args[0] if getattr(cause, "args", None) else None)
    return code in _DEADLOCK_CODES


# MySQL/MariaDB errors about a value, not the connection: incorrect string value (a
# character the column's charset lacks), data too long, out of range, invalid JSON.
_MYSQL_VALUE_ERRORS = {1366, 1406, 1264, 1265, 3140, 4025}


def retry_cannot_fix(error: BaseException) -> bool:
    """Whether writing the same values again would fail the same way, whatever the database's health.

    A refused value (``DataError``, a MySQL "incorrect string value"), a broken
    constraint, or an error that is not the database's at all (a string the
    driver cannot encode). Connection trouble, timeouts and deadlocks are not:
    those are retried.
    """
    if isinstance(error, (DataError, IntegrityError, NotSupportedError, ProgrammingError)):
        return True
    if isinstance(error, OperationalError):
        cause = error.__cause__ or error
        code = cause.args[0] if getattr(cause, "args", None) else None
        return code in _MYSQL_VALUE_ERRORS
    return not isinstance(error, DatabaseError)


def storable_text(text: str) -> str:
    """``text`` as every supported database stores it: NUL and lone surrogates escaped.

    PostgreSQL refuses NUL in text columns and no driver can encode a lone
    surrogate; both become visible escapes (``\\x00``, ``\\ud800``), so the
    message still says what the handler raised.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def retry_deadlocks(function: Fn) -> Fn:
    """Run a claiming transaction again when the database chose it as a deadlock victim.

    The database rolled it back entirely, so running it again is safe; it
    decides afresh from what is committed then.
    """

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(5):
            try:
                return function(*args, **kwargs)
            except OperationalError as error:
                if attempt == 4 or not _is_deadlock(error):
                    raise
                sleep(random.uniform(0.001, 0.02) * (attempt + 1))  # noqa: S311
        return None  # pragma: no cover - the loop returns or raises

    return wrapper  # type: ignore[return-value]


def notify(payload: str = "") -> None:
    """Wake the other instances at once (PostgreSQL LISTEN/NOTIFY; elsewhere they poll).

    Inside a transaction the notification is delivered at COMMIT, never before.
    """
    if _vendor() != "postgresql":
        return
    with connections[alias()].cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [NOTIFY_CHANNEL, payload])


def _resolved_data(job: Job, default: Any) -> Any:
    return job.data if job.has_data else default


class _JobView:
    """What one locked job is doing right now, kept current while a batch is decided."""

    def __init__(self) -> None:
        self.active: list[Run] = []  # running, or handed over and waiting for its next attempt
        self.queued: list[Run] = []  # pending first attempts (manual, queued, catch-up)


def _views(names: Iterable[str]) -> dict[str, _JobView]:
    rows = _runs().filter(job__in=list(names), status__in=[Status.RUNNING, Status.PENDING]).order_by("slot", "id")
    return _views_of(rows)


def _views_of(rows: Iterable[Run]) -> dict[str, _JobView]:
    """Group running and pending rows (oldest slot first) by job."""
    views: dict[str, _JobView] = defaultdict(_JobView)
    for row in rows:
        view = views[row.job]
        if row.is_active:
            view.active.append(row)
        else:
            view.queued.append(row)
    return views


def _busy_detail(active: Run) -> str:
    where = f" on {active.instance_id}" if active.instance_id else ""
    return f"the previous run (slot {_iso(active.slot)}, attempt {active.attempt}) was still running{where}"


def _interrupt(ids: list[int], detail: str) -> list[Run]:
    """Mark the given running or handed-over runs interrupted (caller holds the job locks)."""
    rows = list(_runs().filter(id__in=ids, status__in=[Status.RUNNING, Status.PENDING]))
    _runs().filter(id__in=[r.id for r in rows], status__in=[Status.RUNNING, Status.PENDING]).update(
        status=Status.INTERRUPTED, finished_at=DbNow(), lease_expires_at=None, detail=detail
    )
    for row in rows:
        row.status = Status.INTERRUPTED
        row.detail = detail
    return rows
