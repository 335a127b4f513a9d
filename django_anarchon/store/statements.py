"""The statements every claim sends, written once as parameterised SQL.

A scheduled claim runs on every slot of every job, so it is the one place
where building querysets cost more than the database work (Django's query
compiler took several times the database's time; docs/performance.md).
Here the SQL text is put together from the models' own table and column
names and each backend's own clauses (``FOR UPDATE``, ``INSERT IGNORE`` /
``ON CONFLICT DO NOTHING``); values go as parameters, adapted by the model
fields; the database clock is :class:`~..dbtime.DbNow` compiled by Django; rows
come back as model instances through ``Model.objects.raw()``, with Django's
converters applied. The rules of the package docstring hold unchanged: these
are the same statements the querysets produced, minus the read-back that
``RETURNING`` makes unnecessary.
"""

from __future__ import annotations

import functools
import itertools
import json
import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

from django.db import ProgrammingError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import DateTimeField, ExpressionWrapper, Model
from django.db.models.constants import OnConflict
from django.db.models.sql import Query

from ..dbtime import DbIn, DbNow, NotBefore, db_in
from ..models import Instance, JobState, Reason, Run, Status
from ..slots import Claim
from .base import (
    UTC,
    Outcome,
    _resolved_data,
    _vendor,
    alias,
    built,
    first_attempt,
    first_attempt_values,
    logger,
    slot_datetime,
)
from .schema import CLAIM_FUNCTION

_ACTIVE = (Status.RUNNING, Status.PENDING)
_NOW_SQL: dict[str, str] = {}  # vendor -> the database clock's SQL
_BUILT: dict[tuple[Any, ...], tuple[str, list[Any]]] = {}  # see _built()
_CLOCK_SQL: dict[tuple[Any, ...], tuple[str, list[Any]]] = {}  # see _clock_sql()
_MOMENT = DateTimeField()  # prepares the moment of a db_not_before() as its compiled Value would
_READERS: dict[tuple[Any, ...], tuple[list[str], list[tuple[int, Any]]]] = {}  # see _read()
# What deciding slots reads of a job's row (see lock_states).
_DECIDING = ("paused", "resumed_at", "pruned_slot", "paused_at")
M = TypeVar("M", bound=Model)
# With skip_locked, how long the one-statement claim waits for a job row another
# transaction holds (most often another instance's claim of the same slot, which takes
# about a millisecond) before answering "busy"; a busy job costs a retry ~20 ms later.
LOCK_WAIT_MS = 10


class _KeptCursors(threading.local):
    def __init__(self) -> None:
        # alias -> (the Django connection, its DB-API connection, queries logged?, the cursor)
        self.by_alias: dict[str, tuple[BaseDatabaseWrapper, Any, bool, CursorWrapper]] = {}


_kept = _KeptCursors()


def _kept_cursor(db: str) -> CursorWrapper:
    """A cursor of this thread's connection ``db``, kept for the next claim.

    Making a cursor (Django's wrapper, psycopg's cursor and the loaders of its
    result columns) was a sizeable part of a lost claim's client CPU; the
    statement itself still goes through Django's wrapper, so users'
    ``execute_wrapper`` instrumentation sees every claim. A new cursor is made
    when the connection was closed or replaced, or when query logging was
    turned on or off (``DEBUG``, ``CaptureQueriesContext``), so that logged
    queries go through Django's debug cursor. Connections are per thread, and
    so are the kept cursors.
    """
    connection = connections[db]
    connection.ensure_connection()
    logged = connection.queries_logged
    kept = _kept.by_alias.get(db)
    if kept is not None and kept[0] is connection and kept[1] is connection.connection and kept[2] == logged:
        return kept[3]
    cursor = connection.cursor()
    _kept.by_alias[db] = (connection, connection.connection, logged, cursor)
    return cursor


def _marks(count: int) -> str:
    return ", ".join(["%s"] * count)


def _ints(values: Iterable[int]) -> str:
    """Integers (ids, slots) for an ``IN (...)``, written into the statement: ``int()`` makes each safe.

    A hundred parameters fewer per statement: MySQLdb escapes each in Python, and
    SQLite's cursor rewrites each placeholder.
    """
    return ", ".join([str(int(value)) for value in values])


def _texts(connection: Any, values: Sequence[str]) -> tuple[str, list[str]]:
    """Strings (job names) for an ``IN (...)``: placeholders and parameters, or MySQLdb's own literals.

    MySQLdb escapes every parameter in Python, one call each, and a claim sends
    its hundred job names in three statements; the literals (the driver's own
    escaping, see :func:`_literal`) are kept per connection and name.
    """
    literal = _literal(connection)
    if literal is None:
        return _marks(len(values)), list(values)
    known = _known_literals(connection)
    return ", ".join([_kept_literal(known, literal, v) for v in values]), []


def _kept_literal(known: dict[str, str], literal: Callable[[Any], str], name: str) -> str:
    """The literal of job name ``name``, from ``known`` (see :func:`_known_literals`), or made and kept there."""
    text = known.get(name)
    if text is None:
        text = known[name] = literal(name)
    return text


_LITERALS_KEPT = 100_000


def _name(connection: Any, model: type[Model], field: str | None = None) -> str:
    """The quoted table name of ``model``, or the quoted column of its ``field``."""
    opts = model._meta
    return connection.ops.quote_name(opts.db_table if field is None else opts.get_field(field).column)  # type: ignore[union-attr]


def _fields(model: type[Model], only: Sequence[str] = ()) -> list[Any]:
    """``model``'s concrete fields, in order; with ``only``, just those (by name) and the primary key."""
    fields = model._meta.concrete_fields
    if not only:
        return list(fields)
    return [f for f in fields if f.primary_key or f.name in only]


def _columns(connection: Any, model: type[Model], only: Sequence[str] = ()) -> str:
    return ", ".join(connection.ops.quote_name(f.column) for f in _fields(model, only))


def _read(model: type[M], sql: str, params: Sequence[Any], only: Sequence[str] = ()) -> list[M]:
    """The instances of ``model`` that ``sql`` selects (``SELECT {_columns(..., only)}``, in that order).

    What ``Model.objects.raw()`` does for such a query (each backend's value
    converters, then ``Model.from_db``), without what it does to map columns
    of any query to fields: that took longer than building the instances.
    With ``only``, the other fields are deferred, as ``QuerySet.only()`` leaves them.
    """
    db = alias()
    connection = connections[db]
    key = (model, db, connection.vendor, tuple(only))
    if key not in _READERS:
        fields = _fields(model, only)
        each = [(i, _converters(connection, model, f)) for i, f in enumerate(fields)]
        _READERS[key] = ([f.attname for f in fields], [(i, c) for i, c in each if c[1]])
    names, converting = _READERS[key]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    found = []
    for row in rows:
        values = list(row)
        for index, converters in converting:
            values[index] = _converted(values[index], converters, connection)
        found.append(built(model, zip(names, values, strict=True), db))
    return found


def compile_expression(connection: Any, expression: Any) -> tuple[str, list[Any]]:
    """SQL and parameters of a query expression (the database clock and what is built on it)."""
    query = Query(Run)
    compiler = query.get_compiler(connection=connection)
    resolved = expression.resolve_expression(query, allow_joins=False, for_save=True)
    sql, params = compiler.compile(resolved)
    return sql, list(params)


def _clock_sql(connection: Any, expression: Any) -> tuple[str, list[Any]]:
    """:func:`compile_expression` for the database clock's expressions a claim sets, each compiled once.

    Django's compiler took ~50 µs for the clock, ~150-220 µs for a lease and the
    start of a run claimed ahead (``db_not_before``), three times per claim.
    The SQL of each depends only on the database (and the lease's length); a
    start's one parameter, its moment, is prepared as the compiler would
    prepare it. Any other expression is compiled as it comes.
    """
    kind = type(expression)
    if kind is DbNow:
        return now_sql(connection), []
    if kind is DbIn:
        key: tuple[Any, ...] = (connection.alias, connection.vendor, "in", expression.seconds)
    elif kind is NotBefore:
        key = (connection.alias, connection.vendor, "not-before")
    else:
        return compile_expression(connection, expression)
    if key not in _CLOCK_SQL:
        sql, params = compile_expression(connection, expression)
        if kind is NotBefore and len(params) != 1:
            return sql, params  # not the one parameter (the moment) expected: compiled each time
        _CLOCK_SQL[key] = sql, params
    sql, params = _CLOCK_SQL[key]
    if kind is NotBefore:
        return sql, [_MOMENT.get_db_prep_save(expression.moment, connection)]
    return sql, list(params)


def now_sql(connection: Any) -> str:
    """The database clock (:class:`DbNow`) as SQL for this connection; it takes no parameters."""
    vendor = str(connection.vendor)
    if vendor not in _NOW_SQL:
        _NOW_SQL[vendor] = compile_expression(connection, DbNow())[0]
    return _NOW_SQL[vendor]


def decided(names: Sequence[str], slots: Sequence[int]) -> set[tuple[str, int]]:
    """The (job, slot) pairs among ``names`` × ``slots`` whose first scheduled attempt is on record.

    Manual runs have a slot space of their own (``manual`` is part of the unique
    constraint): a manual run at the same millisecond decides nothing.
    """
    if not names or not slots:
        return set()
    connection = connections[alias()]
    sql = (
        "SELECT {job}, {slot} FROM {run} WHERE {attempt} = 1 AND {manual} = %s "
        "AND {job} IN ({names}) AND {slot} IN ({slots})"
    ).format(
        run=_name(connection, Run),
        job=_name(connection, Run, "job"),
        slot=_name(connection, Run, "slot"),
        attempt=_name(connection, Run, "attempt"),
        manual=_name(connection, Run, "manual"),
        names=(in_names := _texts(connection, names))[0],
        slots=_ints(slots),
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [False, *in_names[1]])
        return {(str(job), int(slot)) for job, slot in cursor.fetchall()}


class Locked(NamedTuple):
    """What deciding a job's slots reads of its locked JobState row (see :func:`lock_states`)."""

    paused: bool
    resumed_at: datetime | None
    pruned_slot: int | None
    paused_at: datetime | None = None  # when it was last paused (kept after a resume)


# A job as nearly every row reads: running, never resumed, nothing pruned (one object for all of them).
_PLAIN_STATE = Locked(False, None, None)


def lock_states(names: Sequence[str], *, skip_locked: bool) -> dict[str, Locked]:
    """Lock and read the existing JobState rows of ``names`` (see :func:`lock_jobs`).

    Only the columns a decision reads, as :class:`Locked` tuples, not model instances:
    reading every column parsed five datetimes per job on SQLite, and building an instance
    per job (with each column's converters) was still a tenth of a claim's client side.

    PostgreSQL and MariaDB: ``SELECT ... ORDER BY name FOR UPDATE [SKIP LOCKED]``.
    SQLite: an UPDATE of ``lock_seq`` first, which takes the database write lock.
    """
    if not names:
        return {}
    db = alias()
    connection = connections[db]
    table, name = _name(connection, JobState), _name(connection, JobState, "name")
    in_names, params = _texts(connection, names)
    where = f"{name} IN ({in_names})"
    columns = ", ".join(_name(connection, JobState, column) for column in ("name", *_DECIDING))
    select = f"SELECT {columns} FROM {table} WHERE {where} ORDER BY {name}"
    if connection.vendor == "sqlite":
        seq = _name(connection, JobState, "lock_seq")
        with connection.cursor() as cursor:
            cursor.execute(f"UPDATE {table} SET {seq} = {seq} + 1 WHERE {where}", params)
    else:
        select += " " + connection.ops.for_update_sql(skip_locked=skip_locked)
    with connection.cursor() as cursor:
        cursor.execute(select, params)
        rows = cursor.fetchall()
    found: dict[str, Locked] = {}
    converters: dict[str, tuple[Any, list[Any]]] = {}  # per datetime column, looked up when first needed

    def moment(column: str, value: Any) -> datetime | None:
        if value is None:
            return None
        if column not in converters:
            converters[column] = _converters(connection, JobState, JobState._meta.get_field(column))
        return _converted(value, converters[column], connection)

    for job, paused, resumed, pruned, paused_at in rows:
        if not paused and resumed is None and pruned is None:
            found[job] = _PLAIN_STATE
            continue
        found[job] = Locked(
            bool(paused),
            moment("resumed_at", resumed),
            None if pruned is None else int(pruned),
            moment("paused_at", paused_at),
        )
    return found


def paused_among(names: Sequence[str]) -> set[str]:
    """Which of the jobs ``names`` are paused now: one SELECT by primary key, no lock, no ORM compiling."""
    if not names:
        return set()
    connection = connections[alias()]
    sql, params = _select_paused(connection, "{name}", names)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {row[0] for row in cursor.fetchall()}


def _select_paused(connection: Any, columns: str, names: Sequence[str]) -> tuple[str, list[Any]]:
    """``SELECT columns`` (``{name}`` stands for the job name's column) of the paused jobs among ``names``."""
    if connection.vendor == "postgresql":
        # One array parameter: the statement's text stays the same whatever the names, and psycopg
        # parses it once (a hundred placeholders made it parse the text again on every call).
        among, params = "= ANY(%s::text[])", [_text_array(names)]
    else:
        in_names, params = _texts(connection, names)
        among = f"IN ({in_names})"
    name = _name(connection, JobState, "name")
    sql = "SELECT {columns} FROM {table} WHERE {name} {among} AND {paused} = %s".format(
        columns=columns.format(name=name),
        name=name,
        table=_name(connection, JobState),
        among=among,
        paused=_name(connection, JobState, "paused"),
    )
    return sql, [*params, True]


def newest_successes(names: Sequence[str] | None = None) -> dict[str, datetime]:
    """When the newest successful run of each job (of ``names``; of every job by default) ended.

    One lookup per job in the index ``anarchon_run_successes`` (partial): the status is written into
    the statement, as a partial index is used only where the query names its very condition (a
    parameter is not known to be ``'success'`` when the plan is made). A job that never succeeded
    (or whose successes were pruned) is not in the result.
    """
    connection = connections[alias()]
    run, state = _name(connection, Run), _name(connection, JobState)
    name = _name(connection, JobState, "name")
    finished = _name(connection, Run, "finished_at")
    # ORDER BY ... LIMIT 1 rather than MAX(): MariaDB reads every entry of the job for a MAX() in
    # a correlated subquery, and only the last one for this.
    sql = (
        f"SELECT {name}, (SELECT r.{finished} FROM {run} r "  # noqa: S608 - names and a constant
        f"WHERE r.{_name(connection, Run, 'job')} = s.{name} AND r.{_name(connection, Run, 'status')} = "
        f"'{Status.SUCCESS}' AND r.{finished} IS NOT NULL ORDER BY r.{finished} DESC LIMIT 1) FROM {state} s"
    )
    params: list[str] = []
    if names is not None:
        if not names:
            return {}
        in_names, params = _texts(connection, names)
        sql += f" WHERE s.{name} IN ({in_names})"
    converters = _converters(connection, Run, Run._meta.get_field("finished_at"))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {str(job): _converted(at, converters, connection) for job, at in cursor.fetchall() if at is not None}


def newest_scheduled(names: Sequence[str]) -> dict[str, tuple[int, datetime | None]]:
    """What catch-up counts from, for each of the jobs ``names``: its newest slot on record but for
    ``run_now()``'s, and, if that slot's first attempt was decided by a catch-up (a catch-up run or
    a ``missed`` record), when that row was created (see :func:`.claims._expand_catch_ups`).

    One lookup per job in the unique index (job, slot, ...), read backwards to its first row that is
    not manual, and one more for that slot's first attempt: a ``MAX()`` over the job's rows read
    every one of them (PostgreSQL read the table whole) at every start-up's catch-up, and asking
    for the rows of every job at every job's newest slot made as many lookups as jobs times slots.
    Jobs with no JobState row or no such run are left out.
    """
    if not names:
        return {}
    connection = connections[alias()]
    run, name = _name(connection, Run), _name(connection, JobState, "name")
    job, slot, manual = (_name(connection, Run, f) for f in ("job", "slot", "manual"))
    in_names, params = _texts(connection, names)
    newest = (
        f"SELECT s.{name} AS name, (SELECT r.{slot} FROM {run} r WHERE r.{job} = s.{name} AND r.{manual} = %s "
        f"ORDER BY r.{slot} DESC LIMIT 1) AS newest FROM {_name(connection, JobState)} s WHERE s.{name} IN ({in_names})"
    )
    sql = (
        f"SELECT t.name, t.newest, (SELECT d.{_name(connection, Run, 'created_at')} FROM {run} d "  # noqa: S608
        f"WHERE d.{job} = t.name AND d.{slot} = t.newest AND d.{_name(connection, Run, 'attempt')} = 1 "
        f"AND d.{manual} = %s AND (d.{_name(connection, Run, 'reason')} = %s "
        f"OR d.{_name(connection, Run, 'status')} = %s)) FROM ({newest}) t"
    )
    converters = _converters(connection, Run, Run._meta.get_field("created_at"))
    with connection.cursor() as cursor:
        cursor.execute(sql, [False, Reason.CATCH_UP, Status.MISSED, False, *params])
        return {
            str(job_name): (int(slot_value), None if created is None else _converted(created, converters, connection))
            for job_name, slot_value, created in cursor.fetchall()
            if slot_value is not None
        }


def last_pauses(names: Sequence[str]) -> dict[str, tuple[int | None, int]]:
    """When each of the jobs ``names`` was last paused and resumed, in ms: (paused_at, resumed_at).

    ``paused_at`` is None where no pause time is on record. Jobs paused now, or never resumed,
    are left out. One SELECT by primary key, no lock. (What the two make a pause of:
    ``claims._last_pause``.)
    """
    if not names:
        return {}
    connection = connections[alias()]
    in_names, params = _texts(connection, names)
    name, paused_at, resumed_at = (_name(connection, JobState, f) for f in ("name", "paused_at", "resumed_at"))
    sql = (
        f"SELECT {name}, {paused_at}, {resumed_at} FROM {_name(connection, JobState)} "  # noqa: S608 - names
        f"WHERE {name} IN ({in_names}) AND {_name(connection, JobState, 'paused')} = %s AND {resumed_at} IS NOT NULL"
    )
    converters = _converters(connection, JobState, JobState._meta.get_field("resumed_at"))
    found: dict[str, tuple[int | None, int]] = {}
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, False])
        for job, since, until in cursor.fetchall():
            resumed = int(_converted(until, converters, connection).timestamp() * 1000)
            paused = None if since is None else int(_converted(since, converters, connection).timestamp() * 1000)
            found[str(job)] = (paused, resumed)
    return found


# Jobs a missed-count UPDATE names, twice each: SQLite before 3.32 takes at most 999 parameters.
_COUNT_CHUNK = 400


def add_missed(counts: dict[str, int]) -> None:
    """Add ``counts`` (job: slots missed) to the jobs' ``missed_count``, in one UPDATE per 400 jobs.

    A catch-up batch after an outage holds up to 500 jobs, each with its own count: one UPDATE
    per job was 500 statements inside the claim's transaction (and Django's ``Case``/``When`` took
    longer to build than the statements took to run).
    """
    if not counts:
        return
    connection = connections[alias()]
    name, missed = _name(connection, JobState, "name"), _name(connection, JobState, "missed_count")
    names = sorted(counts)
    with connection.cursor() as cursor:
        for start in range(0, len(names), _COUNT_CHUNK):
            chunk = names[start : start + _COUNT_CHUNK]
            by_count: dict[int, list[str]] = {}
            for job in chunk:
                by_count.setdefault(int(counts[job]), []).append(job)
            whens, params = [], []
            for count, jobs in by_count.items():
                in_jobs, job_params = _texts(connection, jobs)
                whens.append(f"WHEN {name} IN ({in_jobs}) THEN {count}")
                params.extend(job_params)
            in_chunk, chunk_params = _texts(connection, chunk)
            cursor.execute(
                f"UPDATE {_name(connection, JobState)} SET {missed} = {missed} + CASE {' '.join(whens)} ELSE 0 END "  # noqa: S608 - names, ints
                f"WHERE {name} IN ({in_chunk})",
                [*params, *chunk_params],
            )


def runs_for_decision(names: Sequence[str], slots: Sequence[int]) -> list[Run]:
    """What the jobs ``names`` are doing (running and pending rows) and which of ``slots`` they decided.

    One query for both, oldest slot first.
    """
    if not names:
        return []
    db = alias()
    connection = connections[db]
    attempt, slot = _name(connection, Run, "attempt"), _name(connection, Run, "slot")
    wanted = f"{_name(connection, Run, 'status')} IN (%s, %s)"
    decided: list[Any] = []
    if slots:
        wanted += f" OR ({attempt} = 1 AND {_name(connection, Run, 'manual')} = %s AND {slot} IN ({_ints(slots)}))"
        decided = [False]
    in_names, params = _texts(connection, names)
    sql = "SELECT {cols} FROM {run} WHERE {job} IN ({names}) AND ({wanted}) ORDER BY {slot}, {id}".format(
        cols=_columns(connection, Run),
        run=_name(connection, Run),
        job=_name(connection, Run, "job"),
        names=in_names,
        wanted=wanted,
        slot=slot,
        id=_name(connection, Run, "id"),
    )
    return _read(Run, sql, [*params, *_ACTIVE, *decided])


# The status in the poll's rows that name a paused job (see poll_rows): no run has it.
POLL_PAUSED = "paused"


def poll_rows(expiring_within: float, paused_among: Sequence[str] = ()) -> tuple[list[Run], set[str]]:
    """Running runs whose lease ends within ``expiring_within`` s (database clock); one row per job with pending runs;
    and which of the jobs ``paused_among`` are paused now.

    One statement, its parts joined by ``UNION ALL``: the running ones with
    the columns a takeover needs, the pending ones grouped by job (the lowest
    id and slot stand for them), so that a backlog of pending rows is one row
    per job, and, with ``paused_among``, a row for each of those jobs that is
    paused (status ``POLL_PAUSED``): the loop's look at the pause before runs
    it claimed ahead start goes with its poll, not as a statement of its own.
    The other columns are deferred. An idle instance sends this every poll,
    and nearly always finds nothing: the SQL is built once per connection and
    horizon, and sent on a plain cursor; only runs found are read again
    (through ``raw()``, which converts each backend's datetimes).
    """
    db = alias()
    connection = connections[db]

    def build() -> tuple[str, list[Any]]:
        expiring = db_in(expiring_within) if expiring_within > 0 else DbNow()
        lease_sql, lease_params = compile_expression(connection, expiring)
        names = {f: _name(connection, Run, f) for f in ("id", "job", "slot", "attempt", "status", "instance_id")}
        lease = _name(connection, Run, "lease_expires_at")
        sql = (
            "SELECT {id}, {job}, {slot}, {attempt}, {status}, {instance_id}, {lease} FROM {run} "
            "WHERE {status} = %s AND {lease} < {until} "
            "UNION ALL "
            "SELECT MIN({id}), {job}, MIN({slot}), MIN({attempt}), {status}, '', NULL FROM {run} "
            "WHERE {status} = %s GROUP BY {job}, {status}"
        ).format(run=_name(connection, Run), lease=lease, until=lease_sql, **names)
        return sql, [Status.RUNNING, *lease_params, Status.PENDING]

    sql, params = _built(("poll", db, connection.vendor, expiring_within), build)
    if paused_among:
        paused_sql, paused_params = _select_paused(
            connection, f"0, {{name}}, 0, 0, '{POLL_PAUSED}', '', NULL", paused_among
        )
        sql, params = f"{sql} UNION ALL {paused_sql}", [*params, *paused_params]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    paused = {row[1] for row in rows if row[4] == POLL_PAUSED}
    if len(paused) == len(rows):
        return [], paused
    return [run for run in Run.objects.using(db).raw(sql, params) if run.status != POLL_PAUSED], paused


def live_tokens(within: float) -> list[str]:
    """The tokens of the instances heard from in the last ``within`` seconds (database clock)."""
    db = alias()
    connection = connections[db]

    def build() -> tuple[str, list[Any]]:
        fresh = ExpressionWrapper(DbNow() - timedelta(seconds=within), output_field=DateTimeField())
        fresh_sql, fresh_params = compile_expression(connection, fresh)
        sql = "SELECT {token} FROM {instance} WHERE {heartbeat} >= {fresh}".format(
            token=_name(connection, Instance, "token"),
            instance=_name(connection, Instance),
            heartbeat=_name(connection, Instance, "last_heartbeat"),
            fresh=fresh_sql,
        )
        return sql, fresh_params

    sql, params = _built(("live", db, connection.vendor, within), build)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return [token for (token,) in cursor.fetchall()]


def _built(key: tuple[Any, ...], build: Callable[[], tuple[str, list[Any]]]) -> tuple[str, list[Any]]:
    """A statement the loop sends again and again, built once (Django's SQL compiler costs more than the query)."""
    if key not in _BUILT:
        _BUILT[key] = build()
    return _BUILT[key]


def insert_runs(rows: Sequence[Run]) -> list[Run] | None:
    """INSERT ``rows``, leaving out any whose (job, slot, attempt) is taken.

    Returns the rows inserted, as the database stored them (``RETURNING``:
    PostgreSQL, SQLite ≥ 3.35, MariaDB ≥ 10.5), or None where the database
    cannot say (MySQL, older SQLite): the caller reads them back then.
    Field values that are expressions (the database clock) are compiled once
    per distinct expression object, and plain values prepared once per
    distinct value: a batch of a hundred runs repeats most of them. Only what
    identifies a row and what the database's clock set comes back; the rest
    of each returned run is what was sent.
    """
    if not rows:
        return []
    db = alias()
    connection = connections[db]
    fields, read_row = _insert_columns()
    literal = _literal(connection)
    known = _known_literals(connection) if literal is not None else None
    pieces: dict[Any, tuple[str, list[Any]]] = {}  # SQL and parameters, by expression or plain value
    computed: set[str] = set()  # the fields some row sets to an expression

    def piece_of(field: Any, value: Any) -> tuple[str, list[Any]]:
        if field.attname == "job" and type(value) is str:
            # A job name: the value itself (what CharField prepares), its literal kept per connection.
            if literal is None or known is None:
                return "%s", [value]
            return _kept_literal(known, literal, value), []
        if type(value) not in _PLAIN and hasattr(value, "resolve_expression"):
            computed.add(field.attname)
            key: Any = id(value)  # the rows hold the expression: its id stays its own meanwhile
            if key not in pieces:
                sql, found = _clock_sql(connection, value)
                pieces[key] = (sql, found) if literal is None else _inlined(sql, found, literal)
            return pieces[key]
        key = (field.attname, type(value), value)
        try:
            return pieces.get(key) or pieces.setdefault(key, _plain(connection, field, value, literal))
        except TypeError:  # an unhashable value (JSON data): prepared each time
            return _plain(connection, field, value, literal)

    # Column by column: most hold the very same object in every row (the defaults, the
    # owner, the database clock's expression), prepared once for the whole column.
    shared: list[tuple[str, list[Any]] | None] = []  # by column: its one piece, or None where the rows differ
    varying_sql: list[list[str]] = []
    varying_params: list[list[list[Any]]] = []
    count = len(rows)
    for field, values in zip(fields, zip(*map(read_row, rows), strict=True), strict=True):
        first = values[0]
        if all(map(operator.is_, values, itertools.repeat(first, count))):
            shared.append(piece_of(field, first))
        else:
            shared.append(None)
            each = [piece_of(field, value) for value in values]
            varying_sql.append([sql for sql, _ in each])
            varying_params.append([found for _, found in each])
    params: list[Any] = []
    if connection.vendor == "sqlite" and varying_sql and len(varying_sql) < len(fields):
        # SQLite binds each parameter of each row: the columns every row shares are written
        # (and bound) once, in a SELECT over a VALUES list of what differs (the job, mostly).
        select, k = [], 0
        for piece in shared:
            if piece is None:
                k += 1
                select.append(f"v.column{k}")
            else:
                select.append(piece[0])
                params.extend(piece[1])
        body = f"SELECT {', '.join(select)} FROM ({_values(varying_sql, varying_params, params)}) AS v"
    else:
        sql_of, params_of = iter(varying_sql), iter(varying_params)
        column_sql = [[piece[0]] * count if piece is not None else next(sql_of) for piece in shared]
        column_params = [[piece[1]] * count if piece is not None else next(params_of) for piece in shared]
        body = _values(column_sql, column_params, params)
    statement = "{insert} {run} ({cols}) {body} {suffix}".format(
        insert=connection.ops.insert_statement(on_conflict=OnConflict.IGNORE),
        run=_name(connection, Run),
        cols=", ".join(connection.ops.quote_name(str(f.column)) for f in fields),
        body=body,
        suffix=connection.ops.on_conflict_suffix_sql(fields, OnConflict.IGNORE, None, None) or "",
    ).rstrip()
    if not connection.features.can_return_rows_from_bulk_insert:
        with connection.cursor() as cursor:
            cursor.execute(statement, params)
        return None
    if not computed <= set(_RETURNED):
        return _read(Run, f"{statement} RETURNING {_columns(connection, Run)}", params)
    returned = [Run._meta.get_field(name) for name in _RETURNED]
    # MySQLdb, and Python's sqlite3 for a column declared as a datetime, turn every datetime
    # they read into a datetime in Python; as text, each of the few distinct instants is
    # parsed once below.
    as_text = {
        name for name, field in zip(_RETURNED, returned, strict=True)
        if connection.vendor in ("mysql", "sqlite") and isinstance(field, DateTimeField)
    }  # fmt: skip
    statement += " RETURNING " + ", ".join(
        f"CAST({_name(connection, Run, name)} AS CHAR)" if name in as_text else _name(connection, Run, name)
        for name in _RETURNED
    )
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        found = cursor.fetchall()
    converters = [_converters(connection, Run, field) for field in returned]
    converting = [
        (i, name, (c[0], [_from_text, *c[1]]) if name in as_text else c)
        for i, (name, c) in enumerate(zip(_RETURNED, converters, strict=True))
        if c[1] or name in as_text
    ]
    if not found:
        return []
    # Column by column. The database's clock reads the same for every row of one statement:
    # each distinct value is converted once (datetimes are immutable, so the rows may share them).
    columns: list[Sequence[Any]] = list(zip(*found, strict=True))
    for index, _, functions in converting:
        distinct = {raw: _converted(raw, functions, connection) for raw in set(columns[index])}
        columns[index] = [distinct[raw] for raw in columns[index]]
    sent = {(r.job, r.slot, r.attempt, r.manual): r for r in rows}
    texts: dict[int, str] = {}  # the JSON of each distinct data object sent
    stored = []
    for values in zip(*columns, strict=True):
        row = sent[values[1:5]]  # (job, slot, attempt, manual): see _RETURNED
        row.__dict__.update(zip(_RETURNED, values, strict=True))
        if row.data is not None:
            # Its own copy, as read from the database: rows of one job were sent the job's own object.
            text = texts.get(id(row.data)) or texts.setdefault(id(row.data), json.dumps(row.data))
            row.data = json.loads(text)
        row._state.adding = False
        row._state.db = db
        stored.append(row)
    return stored


def _values(column_sql: list[list[str]], column_params: list[list[list[Any]]], params: list[Any]) -> str:
    """``VALUES (...), ...`` of rows given column by column; their parameters, row by row, go onto ``params``."""
    params.extend(itertools.chain.from_iterable(itertools.chain.from_iterable(zip(*column_params, strict=True))))
    return "VALUES " + ", ".join(["(" + ", ".join(row_sql) + ")" for row_sql in zip(*column_sql, strict=True)])


def _literal(connection: Any) -> Callable[[Any], str] | None:
    """Where the driver writes each parameter into the statement's text itself (MySQLdb), the way it does it.

    MySQLdb sends no parameters: it escapes each one in Python, one call per
    value, and formats them into the text. A claim's INSERT repeats most of
    its values in every row (a hundred rows, twenty-odd columns), so the
    values are escaped here as the driver would (its own ``literal()`` on the
    same connection, so the same character set and SQL mode), once per
    distinct value. None elsewhere: the values go as parameters (on SQLite,
    literals made the INSERT slower to run: SQLite parses and copies each).
    """
    if connection.vendor != "mysql":
        return None
    raw = connection.connection
    literal, encoding = getattr(raw, "literal", None), getattr(raw, "encoding", None)
    if literal is None or encoding is None:
        return None

    def text(value: Any) -> str:
        # The statement is still formatted with what parameters remain: keep its % signs.
        return literal(value).decode(encoding).replace("%", "%%")

    return text


def _inlined(sql: str, params: list[Any], literal: Callable[[Any], str]) -> tuple[str, list[Any]]:
    """An expression's SQL with its parameters written in as the driver's literals (see :func:`_literal`)."""
    if not params:
        return sql, params
    # The literals double their % signs, as the statement does: undo it for the formatting, redo it after.
    return (sql % tuple(literal(p).replace("%%", "%") for p in params)).replace("%", "%%"), []


@functools.cache
def _insert_columns() -> tuple[list[Any], Callable[[Run], tuple[Any, ...]]]:
    """The columns a run's INSERT writes (all but the primary key), and what reads a run's values of them."""
    fields = [f for f in Run._meta.concrete_fields if not f.primary_key]
    return fields, operator.attrgetter(*(f.attname for f in fields))


def _known_literals(connection: Any) -> dict[str, str]:
    """The literals of the job names written on this connection so far (see ``_literal``)."""
    raw = connection.connection
    cache = getattr(connection, "_anarchon_literals", None)
    if cache is None or cache[0] is not raw:
        cache = (raw, {})
        connection._anarchon_literals = cache
    known: dict[str, str] = cache[1]
    if len(known) > _LITERALS_KEPT:
        known.clear()
    return known


def _plain(connection: Any, field: Any, value: Any, literal: Callable[[Any], str] | None) -> tuple[str, list[Any]]:
    """A plain value of ``field``: a parameter, or written into the statement (see ``_literal``)."""
    prepared = field.get_db_prep_save(value, connection)
    if literal is None:
        return "%s", [prepared]
    return literal(prepared), []


# Values that are never expressions (insert_runs asks the others whether they are).
_PLAIN = frozenset({str, int, bool, float, type(None), datetime, dict, list})
# What a claim's INSERT returns: what identifies a row, and the columns the database's clock sets.
# insert_runs finds the row it sent by the second to fifth (job, slot, attempt, manual).
_RETURNED = ("id", "job", "slot", "attempt", "manual", "created_at", "started_at", "finished_at", "lease_expires_at")


def _converters(connection: Any, model: type[Model], field: Any) -> tuple[Any, list[Any]]:
    """The column of ``field`` and what turns its raw values into Python ones (as a query's compiler does)."""
    column = field.get_col(model._meta.db_table)
    return column, [*connection.ops.get_db_converters(column), *column.get_db_converters(connection)]


def _from_text(value: Any, expression: Any, connection: Any) -> Any:
    """A datetime read as text (``CAST(... AS CHAR)``), as the driver would have returned it: naive."""
    if isinstance(value, bytes):
        value = value.decode()
    return datetime.fromisoformat(value) if isinstance(value, str) else value


def _from_microseconds(value: Any, expression: Any, connection: Any) -> Any:
    """A datetime read as microseconds since 1970-01-01 00:00 of its stored value, as the driver would
    have returned it: naive, in the database's own time (``_mariadb_claim_sql``'s ``RETURNING``)."""
    return None if value is None else _NAIVE_EPOCH + timedelta(microseconds=value)


def _converted(value: Any, converters: tuple[Any, list[Any]], connection: Any) -> Any:
    column, functions = converters
    for function in functions:
        value = function(value, column, connection)
    return value


def end_held(
    ids: Iterable[int],
    *,
    owner: str,
    status: str,
    texts: dict[str, str] | None = None,
    started_at: datetime | None = None,
    clear_start: bool = False,
) -> int:
    """Mark the runs ``ids`` that ``owner`` still holds as ended with ``status``; the number changed.

    Held: ours and ``running``, whether or not the lease has run out by the database clock. A
    backup takes a run over by marking it ``interrupted`` under the row's lock (``leases.take_over``),
    so the end and a takeover are decided by the row, and exactly one of them is written: a handler
    that returned during an outage longer than its lease is recorded when the database comes back,
    unless a backup took the run over first. ``texts`` sets error and detail columns too,
    ``started_at`` that column (``clear_start``: to NULL, for a run whose handler never started).
    """
    ids = list(ids)
    if not ids:
        return 0
    connection = connections[alias()]
    now = now_sql(connection)
    columns: list[tuple[str, Any]] = [("status", status), *(texts or {}).items()]
    if started_at is not None:
        columns.append(("started_at", _MOMENT.get_db_prep_save(started_at, connection)))
    elif clear_start:
        columns.append(("started_at", None))
    sets = ", ".join(f"{_name(connection, Run, field)} = %s" for field, _ in columns)
    id_params: list[Any]
    if connection.vendor == "postgresql":
        # One array parameter, written here: the statement's text is the same for any
        # number of runs (psycopg converts it once), and a hundred ids are one value
        # to adapt instead of a hundred.
        id_sql, id_params = "= ANY(%s::bigint[])", ["{" + ",".join(str(int(i)) for i in ids) + "}"]
    else:
        id_sql, id_params = f"IN ({_ints(ids)})", []
    sql = (
        "UPDATE {run} SET {sets}, {finished} = {now}, {lease} = NULL "
        "WHERE {id} {ids} AND {owner} = %s AND {status} = %s"
    ).format(
        run=_name(connection, Run),
        sets=sets,
        finished=_name(connection, Run, "finished_at"),
        lease=_name(connection, Run, "lease_expires_at"),
        id=_name(connection, Run, "id"),
        owner=_name(connection, Run, "owner"),
        status=_name(connection, Run, "status"),
        now=now,
        ids=id_sql,
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*(value for _, value in columns), *id_params, owner, Status.RUNNING])
        return int(cursor.rowcount)


class NoClaimFunction(Exception):
    """``django_anarchon_claim()`` is not in the database: migration 0003 has not been applied."""


_MISSING_FUNCTION: set[str] = set()  # aliases found without the function (warned once)
_CLAIM_INSTANTS = ("created_at", "started_at", "lease_expires_at")
# The columns the one-statement claims of SQLite and MariaDB write, in their SELECT's order.
_CLAIM_COLUMNS = (
    "job, slot, attempt, status, reason, manual, scheduled_at, instance_id, owner, lease_expires_at, "
    "created_at, started_at, finished_at, data, progress, error_type, error_message, traceback, detail"
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = datetime(1970, 1, 1)  # noqa: DTZ001 - a stored value's own time, whatever its zone


def can_claim_in_one_statement(claims: Sequence[Claim]) -> bool:
    """Whether :func:`claim_scheduled` can decide ``claims``: on PostgreSQL (``django_anarchon_claim()``,
    migration 0003), on SQLite with ``RETURNING`` (3.35 and later) and on MariaDB 10.5 and later.

    Scheduled claims only: catch-up claims and waiting ones need the Python path.
    """
    db = alias()
    connection = connections[db]
    if connection.vendor == "postgresql":
        if db in _MISSING_FUNCTION:
            return False
    elif connection.vendor == "mysql":
        if not _mariadb_returning(connection):
            return False
    elif connection.vendor != "sqlite" or not connection.features.can_return_rows_from_bulk_insert:
        return False
    return all(c.reason == Reason.SCHEDULED and not c.wait and not c.shed for c in claims)


def _text_array(values: Iterable[str | None]) -> str:
    """A PostgreSQL ``text[]`` literal of ``values`` (``None`` is NULL), every element quoted."""
    return (
        "{"
        + ",".join("NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        + "}"
    )


def claim_scheduled(
    claims: Sequence[Claim],
    *,
    owner: str,
    instance_id: str,
    ttl: float,
    capacity: int,
    default_data: Any,
    skip_locked: bool,
    first_look: bool = True,
) -> tuple[Outcome, list[Claim]]:
    """Decide scheduled ``claims`` in one statement; return the outcome and the undecided.

    What the statement leaves undecided (a busy job, whose overlap policy
    decides; a job with no row yet) is for :func:`.claims.decide`'s Python path.
    The call runs in autocommit unless the caller holds a transaction, so what
    it returns is committed when it returns. PostgreSQL: one call of
    ``django_anarchon_claim()``; SQLite and MariaDB: see :func:`_claim_by_insert`.
    """
    db = alias()
    if connections[db].vendor != "postgresql":
        return _claim_by_insert(
            claims,
            owner=owner,
            instance_id=instance_id,
            ttl=ttl,
            capacity=capacity,
            default_data=default_data,
            skip_locked=skip_locked,
            first_look=first_look,
        )
    ordered = sorted(claims, key=lambda c: (c.slot, c.job.name))
    by_key = {(c.job.name, c.slot): c for c in ordered}
    texts = _data_texts(ordered, default_data)
    params: list[Any] = [
        # Array literals written here: adapting Python lists took psycopg longer than the
        # rest of the call's client side.
        _text_array(c.job.name for c in ordered),
        "{" + ",".join(str(int(c.slot)) for c in ordered) + "}",
        "{" + ",".join("t" if c.job.overlap == "allow" else "f" for c in ordered) + "}",
        _text_array(texts[c.job.name] for c in ordered),
        owner,
        instance_id,
        float(ttl),
        int(capacity),
        bool(skip_locked),
        LOCK_WAIT_MS,
    ]
    outcome = Outcome()
    undecided: list[Claim] = []
    seen: dict[int | None, datetime | None] = {}  # one datetime per instant: a batch's rows share the claim's clock
    try:
        cursor = _kept_cursor(db)
        # The instants as microseconds since the epoch: turning them into datetimes
        # here costs a fraction of psycopg's parsing of timestamptz text.
        cursor.execute(
            "SELECT kind, job, slot, run_id, "
            + ", ".join(f"(EXTRACT(EPOCH FROM {c}) * 1000000)::bigint" for c in _CLAIM_INSTANTS)
            + f" FROM {CLAIM_FUNCTION}(%s::text[], %s::bigint[], %s::boolean[], %s::text[], %s, %s, %s, %s, %s, %s)",
            params,
        )
        rows = cursor.fetchall()
    except ProgrammingError as error:
        if getattr(error.__cause__, "sqlstate", None) != "42883":  # undefined_function
            raise
        # The package is newer than the database's migrations: claim the slow way, and say so once.
        _MISSING_FUNCTION.add(db)
        logger.warning(
            "Database %r has no %s() function: run `manage.py migrate django_anarchon`. "
            "Claims take the slower general path meanwhile.",
            db,
            CLAIM_FUNCTION,
        )
        raise NoClaimFunction from error
    # Every won row: the same columns but for a few (first_attempt()'s, and what the database set).
    base = first_attempt_values(Status.RUNNING, instance_id=instance_id, owner=owner)
    for kind, job, slot, run_id, created_at, started_at, lease_expires_at in rows:
        if kind == "busy":
            outcome.busy.append(job)
            continue
        claim = by_key[(job, slot)]
        if kind == "undecided":
            undecided.append(claim)
        elif kind == "deferred":
            outcome.deferred.append(claim)
        elif kind == "won":
            for us in (created_at, started_at, lease_expires_at):
                if us not in seen:
                    seen[us] = None if us is None else _EPOCH + timedelta(microseconds=us)
            own = None if (text := texts[job]) is None else json.loads(text)  # each run its own copy of the data
            row = first_attempt(claim, base, own, db)
            row.id = run_id
            row.created_at = seen[created_at]
            row.started_at = seen[started_at]
            row.lease_expires_at = seen[lease_expires_at]
            outcome.won.append(row)
    outcome.busy.sort()
    return outcome, undecided


def _mariadb_returning(connection: Any) -> bool:
    """Whether ``connection`` is MariaDB 10.5 or later: ``INSERT ... SELECT ... RETURNING`` (MySQL has none)."""
    if not getattr(connection, "mysql_is_mariadb", False) or connection.mysql_version < (10, 5):
        return False
    connection.ensure_connection()  # _literal() asks the driver's connection
    return _literal(connection) is not None


def _claim_by_insert(
    claims: Sequence[Claim],
    *,
    owner: str,
    instance_id: str,
    ttl: float,
    capacity: int,
    default_data: Any,
    skip_locked: bool,
    first_look: bool,
) -> tuple[Outcome, list[Claim]]:
    """:func:`claim_scheduled` on SQLite and MariaDB: one ``INSERT ... SELECT ... RETURNING``.

    SQLite, in autocommit: a writing statement takes SQLite's write lock before it reads
    anything (and waits for it within the busy timeout), so the statement decides alone, from
    everything committed before it, as a claim under the job locks does. MariaDB: the jobs'
    rows are locked first (``FOR UPDATE``, ``SKIP LOCKED`` with ``skip_locked``: the jobs held
    elsewhere are returned busy), paused jobs left out, then the statement runs in the same
    transaction; under ``READ COMMITTED`` it reads what was committed before it, after the locks.

    The statement inserts the ``running`` row of each claim (in slot, job order, up to
    ``capacity``) whose job has a row, is not paused and, unless its overlap is ``allow``, has
    no active run, and whose slot nobody decided; the unique constraint still turns away a slot
    taken meanwhile (``ON CONFLICT DO NOTHING``, MariaDB's ``INSERT IGNORE``). The general
    claim took a transaction of five statements.

    With ``first_look``, slots already decided are looked up first, without a lock
    (:func:`.claims.decide`): a statement of an instance that lost them would take it.
    What it did not win is looked at again, without a lock: slots someone else decided and
    jobs paused are left alone; the rest (a busy job, a job with no row yet, a claim past
    ``capacity``) is returned undecided, for the Python path. So is every claim of a job but
    its first in the batch, unless the job allows overlaps: a statement does not see its own
    rows, and the first one may make the job busy.
    """
    db = alias()
    connection = connections[db]
    ordered = sorted(claims, key=lambda c: (c.slot, c.job.name))
    if first_look:
        done = decided(sorted({c.job.name for c in ordered}), sorted({c.slot for c in ordered}))
        ordered = [c for c in ordered if (c.job.name, c.slot) not in done]
    outcome = Outcome()
    sent: list[Claim] = []
    undecided: list[Claim] = []
    seen_jobs: set[str] = set()
    for claim in ordered:
        name = claim.job.name
        if claim.job.overlap != "allow" and name in seen_jobs:
            undecided.append(claim)
            continue
        seen_jobs.add(name)
        sent.append(claim)
    if not sent:
        return outcome, undecided

    texts = _data_texts(sent, default_data)
    if connection.vendor != "sqlite":
        literal = _literal(connection)
        if literal is None:  # not MySQLdb: can_claim_in_one_statement() said no; the Python path decides
            return outcome, sorted(ordered, key=lambda c: (c.slot, c.job.name))
        outcome, left = _claim_by_insert_locked(
            connection,
            sent,
            texts,
            literal,
            owner=owner,
            instance_id=instance_id,
            ttl=ttl,
            capacity=capacity,
            skip_locked=skip_locked,
        )
        return outcome, sorted(undecided + left, key=lambda c: (c.slot, c.job.name))
    data_sql = {name: "NULL" if value is None else _sqlite_text(value) for name, value in texts.items()}
    # Per distinct slot (a batch is mostly one or two): adapting a datetime the field's way is slow.
    moments = {
        slot: _sqlite_text(str(_MOMENT.get_db_prep_save(slot_datetime(slot), connection)))
        for slot in {c.slot for c in sent}
    }
    rows = ", ".join(
        f"(%s, {int(c.slot)}, {moments[c.slot]}, {data_sql[c.job.name]}, {1 if c.job.overlap == 'allow' else 0})"
        for c in sent
    )
    insert, lease_params = _built(("sqlite claim", db, ttl), lambda: _sqlite_claim_sql(connection, ttl))
    sql = f"WITH c(job, slot, scheduled_at, data, allow) AS (VALUES {rows}) {insert}"
    params = [
        *(c.job.name for c in sent),
        Status.RUNNING,
        Reason.SCHEDULED,
        instance_id,
        owner,
        *lease_params,
        int(max(capacity, 0)),
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchall()
    outcome.won, lost = _won_rows(found, sent, texts, _from_text, connection, owner=owner, instance_id=instance_id)
    if lost:
        # Decided by someone else, or paused: nothing to do. The rest is for the Python path.
        taken = decided(sorted({c.job.name for c in lost}), sorted({c.slot for c in lost}))
        lost = [c for c in lost if (c.job.name, c.slot) not in taken]
        paused = paused_among(sorted({c.job.name for c in lost}))
        undecided.extend(c for c in lost if c.job.name not in paused)
    return outcome, sorted(undecided, key=lambda c: (c.slot, c.job.name))


def _claim_by_insert_locked(
    connection: Any,
    sent: list[Claim],
    texts: dict[str, str | None],
    literal: Callable[[Any], str],
    *,
    owner: str,
    instance_id: str,
    ttl: float,
    capacity: int,
    skip_locked: bool,
) -> tuple[Outcome, list[Claim]]:
    """:func:`_claim_by_insert` on MariaDB: the job locks, then the statement, in one transaction.

    Returns the outcome and the claims it left undecided (busy job, past ``capacity``), in no order.
    """
    outcome = Outcome()
    names = sorted({c.job.name for c in sent})
    skip = skip_locked and connection.features.has_select_for_update_skip_locked
    with transaction.atomic(using=connection.alias):
        states = lock_jobs(names, skip_locked=skip)
        outcome.busy = [n for n in names if n not in states]
        open_claims = [c for c in sent if c.job.name in states and not states[c.job.name].paused]
        found: list[Any] = []
        if open_claims:
            # MySQLdb writes every parameter into the text in Python: the values go in as its own
            # literals, each distinct one escaped once (see _literal), the names kept per connection.
            known = _known_literals(connection)
            data_sql = {name: "NULL" if v is None else literal(v) for name, v in texts.items()}
            moments = {
                slot: literal(_MOMENT.get_db_prep_save(slot_datetime(slot), connection))
                for slot in {c.slot for c in open_claims}
            }
            rows = ", ".join(
                f"({_kept_literal(known, literal, c.job.name)}, {int(c.slot)}, "
                f"{moments[c.slot]}, {data_sql[c.job.name]}, {1 if c.job.overlap == 'allow' else 0})"
                for c in open_claims
            )
            insert, _ = _built(
                ("mariadb claim", connection.alias, ttl, owner, instance_id),
                lambda: _mariadb_claim_sql(connection, ttl, owner=owner, instance_id=instance_id, literal=literal),
            )
            sql = insert.replace("(VALUES)", f"(VALUES {rows})", 1).replace(
                "LIMIT %s", f"LIMIT {int(max(capacity, 0))}"
            )
            params: list[Any] = []
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                found = cursor.fetchall()
    outcome.won, lost = _won_rows(
        found, open_claims, texts, _from_microseconds, connection, owner=owner, instance_id=instance_id
    )
    if not lost:
        return outcome, []
    taken = decided(sorted({c.job.name for c in lost}), sorted({c.slot for c in lost}))
    return outcome, [c for c in lost if (c.job.name, c.slot) not in taken]


def _won_rows(
    found: Sequence[Any],
    sent: Sequence[Claim],
    texts: dict[str, str | None],
    read_instant: Callable[[Any, Any, Any], Any],
    connection: Any,
    *,
    owner: str,
    instance_id: str,
) -> tuple[list[Run], list[Claim]]:
    """The runs a claim's ``INSERT ... RETURNING`` wrote (id, job, slot, then the instants), in (slot, job)
    order, and the claims of ``sent`` it did not win.

    ``read_instant`` turns a returned instant into what the driver returns for the column (the
    database's statement returns it as text or integer); Django's converters do the rest, each
    distinct instant once.
    """
    by_key = {(c.job.name, c.slot): c for c in sent}
    base = first_attempt_values(Status.RUNNING, instance_id=instance_id, owner=owner)
    # Per instant: its converters and the values converted so far (a batch's rows share a few).
    instants: list[tuple[str, tuple[Any, list[Any]], dict[Any, Any]]] = []
    for name in _CLAIM_INSTANTS:
        column, functions = _converters(connection, Run, Run._meta.get_field(name))
        instants.append((name, (column, [read_instant, *functions]), {}))
    alias = connection.alias
    won: set[tuple[str, int]] = set()
    rows: list[Run] = []
    for run_id, job, slot, *moments_found in found:
        key = (job, slot)
        won.add(key)
        own = None if (kept := texts[job]) is None else json.loads(kept)  # each run its own copy of the data
        row = first_attempt(by_key[key], base, own, alias)
        values = row.__dict__  # plain fields, set as built() sets them
        values["id"] = run_id
        for (name, convert, seen), raw in zip(instants, moments_found, strict=True):
            value = seen.get(raw, seen)  # the dict itself: not converted yet (None is a value)
            if value is seen:
                value = seen[raw] = _converted(raw, convert, connection)
            values[name] = value
        rows.append(row)
    rows.sort(key=lambda r: (r.slot, r.job))
    return rows, [c for c in sent if (c.job.name, c.slot) not in won]


def _mariadb_claim_sql(
    connection: Any, ttl: float, *, owner: str, instance_id: str, literal: Callable[[Any], str]
) -> tuple[str, list[Any]]:
    """MariaDB's claim statement, its claims' ``VALUES`` left empty (see :func:`_sqlite_claim_sql`), built once."""
    q = connection.ops.quote_name
    now = now_sql(connection)
    lease_sql, lease_params = _clock_sql(connection, db_in(ttl))
    columns = _CLAIM_COLUMNS
    run = _name(connection, Run)
    active = f"({q('status')} = 'running' OR ({q('attempt')} > 1 AND {q('status')} = 'pending'))"
    sql = (
        f"INSERT IGNORE INTO {run} ({', '.join(q(c.strip()) for c in columns.split(','))}) "
        "WITH c(job, slot, scheduled_at, data, allow) AS (VALUES) "
        f"SELECT c.job, c.slot, 1, %s, %s, 0, c.scheduled_at, %s, %s, {lease_sql}, {now}, "  # noqa: S608 - names
        f"GREATEST({now}, c.scheduled_at), NULL, c.data, NULL, '', '', '', '' FROM c "
        f"WHERE NOT EXISTS (SELECT 1 FROM {run} r WHERE r.{q('job')} = c.job AND r.{q('slot')} = c.slot "
        f"AND r.{q('attempt')} = 1 AND r.{q('manual')} = 0) "
        f"AND (c.allow OR NOT EXISTS (SELECT 1 FROM {run} r WHERE r.{q('job')} = c.job AND {active})) "
        f"ORDER BY c.slot, c.job LIMIT %s "
        f"RETURNING {q('id')}, {q('job')}, {q('slot')}, "
        # The instants as integers: MySQLdb parses each datetime it returns in Python, 300 a claim
        # of 100 slots; an integer it converts in C (each distinct one becomes a datetime once).
        + ", ".join(f"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {q(name)})" for name in _CLAIM_INSTANTS)
    )
    # Everything but the claims' VALUES and the LIMIT is the same for every claim of this instance.
    head, limit = sql.split("LIMIT %s")
    head, _ = _inlined(head, [Status.RUNNING, Reason.SCHEDULED, instance_id, owner, *lease_params], literal)
    return head + "LIMIT %s" + limit, []


def _data_texts(claims: Sequence[Claim], default_data: Any) -> dict[str, str | None]:
    """Each claimed job's run data as the column stores it (``None`` for none), by job name.

    The column's own encoding (JSONField with no encoder): ``json.dumps``, once per job for the
    statement and for the copies handed back alike.
    """
    texts: dict[str, str | None] = {}
    for claim in claims:
        if claim.job.name not in texts:
            value = _resolved_data(claim.job, default_data)
            texts[claim.job.name] = None if value is None else json.dumps(value)
    return texts


def _sqlite_text(value: str) -> str:
    """``value`` as a literal in a statement's text, which Django's cursor rewrites (``%s`` is a placeholder)."""
    return "'" + value.replace("'", "''").replace("%", "%%") + "'"


def _sqlite_claim_sql(connection: Any, ttl: float) -> tuple[str, list[Any]]:
    """What follows the claims' VALUES in :func:`_claim_by_insert`, built once: SQL and the lease's parameters.

    Its parameters, after the job names of the VALUES: status, reason, instance, owner, the
    lease's, and the LIMIT (``MAX_WORKERS`` free).
    """
    q = connection.ops.quote_name
    now = now_sql(connection)
    lease_sql, lease_params = _clock_sql(connection, db_in(ttl))
    columns = _CLAIM_COLUMNS
    run, state = _name(connection, Run), _name(connection, JobState)
    # The active runs' condition as the partial index anarchon_run_active has it (models.ACTIVE),
    # written out: SQLite uses a partial index only for a query that names its very condition.
    active = f"({q('status')} = 'running' OR ({q('attempt')} > 1 AND {q('status')} = 'pending'))"
    sql = (
        f"INSERT INTO {run} ({', '.join(q(c.strip()) for c in columns.split(','))}) "  # noqa: S608 - names
        f"SELECT c.job, c.slot, 1, %s, %s, 0, c.scheduled_at, %s, %s, {lease_sql}, {now}, "
        f"MAX({now}, c.scheduled_at), NULL, c.data, NULL, '', '', '', '' "
        f"FROM c JOIN {state} s ON s.{q('name')} = c.job "
        f"WHERE NOT s.{q('paused')} "
        f"AND NOT EXISTS (SELECT 1 FROM {run} r WHERE r.{q('job')} = c.job AND r.{q('slot')} = c.slot "
        f"AND r.{q('attempt')} = 1 AND r.{q('manual')} = 0) "
        f"AND (c.allow OR NOT EXISTS (SELECT 1 FROM {run} r WHERE r.{q('job')} = c.job AND {active})) "
        f"ORDER BY c.slot, c.job LIMIT %s "
        f"ON CONFLICT DO NOTHING RETURNING {q('id')}, {q('job')}, {q('slot')}, "
        + ", ".join(f"CAST({q(name)} AS CHAR)" for name in _CLAIM_INSTANTS)
    )
    return sql, list(lease_params)


def lock_jobs(names: Sequence[str], *, skip_locked: bool = False) -> dict[str, Locked]:
    """Lock the JobState rows of ``names`` (creating missing ones) and return the locked ones.

    Must be the first statement of its transaction (see the module docstring).
    With ``skip_locked`` (PostgreSQL and MariaDB only), rows another
    transaction holds are left out instead of waited for: the caller leaves
    those jobs to be retried, rather than queueing behind an instance that is
    deciding the very same slots.
    """
    names = sorted(set(names))
    db = alias()
    states = JobState.objects.using(db)
    skip = skip_locked and _vendor() != "sqlite" and connections[db].features.has_select_for_update_skip_locked
    found = lock_states(names, skip_locked=skip)
    missing = [n for n in names if n not in found]
    if skip and missing:
        held_elsewhere = set(states.filter(name__in=missing).values_list("name", flat=True))
        missing = [n for n in missing if n not in held_elsewhere]
    if missing:
        states.bulk_create([JobState(name=n, first_seen=DbNow()) for n in missing], ignore_conflicts=True)
        found.update(lock_states(missing, skip_locked=skip))
    return found
