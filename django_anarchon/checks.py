"""System checks: configuration mistakes that would break the scheduler's guarantees.

=================  ==========================================================
``anarchon.E001``  ``USE_TZ`` is False (leases and slots are compared in UTC).
``anarchon.E002``  a MySQL/MariaDB connection whose session time zone is not UTC.
``anarchon.E003``  ``LEASE_TTL`` shorter than three ``POLL_INTERVAL`` s.
``anarchon.E004``  the ``ANARCHON`` settings dict has an unknown key or a bad value.
``anarchon.E005``  a ``jobs.py`` declares a bad job.
``anarchon.E006``  a task job's task backend cannot enqueue its task (unknown, ``DummyBackend``, refuses it).
``anarchon.W001``  an in-memory SQLite database (instances cannot share it).
``anarchon.W002``  a SQLite database not in WAL mode (instances block each other).
``anarchon.W003``  a task job's backend stores tasks outside the scheduler's database (at least once).
``anarchon.W004``  MySQL/MariaDB cannot convert times to ``TIME_ZONE`` (no time zone tables: no date bar).
=================  ==========================================================
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DatabaseError, connections, router

from .conf import parse, problems
from .dbtime import converts_to
from .exceptions import SettingsError


@register("anarchon")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    if not settings.USE_TZ:
        messages.append(
            Error(
                "django-anarchon needs USE_TZ = True.",
                hint="Leases and slots are compared with the database clock in UTC; with USE_TZ = False "
                "Django stores and reads local times (on SQLite, MySQL and MariaDB), so leases would look "
                "hours fresh or stale. Set USE_TZ = True.",
                id="anarchon.E001",
            )
        )
    try:
        parsed = parse(getattr(settings, "ANARCHON", None))
    except SettingsError as error:
        messages.append(
            Error(str(error), hint="See the settings page of the django-anarchon docs.", id="anarchon.E004")
        )
    else:
        for problem in problems(parsed):
            messages.append(Error(problem, hint="Raise LEASE_TTL or lower POLL_INTERVAL.", id="anarchon.E003"))
    for alias in connections:
        engine = connections.settings[alias]["ENGINE"]
        name = str(connections.settings[alias].get("NAME", ""))
        if "sqlite" in engine and (name == ":memory:" or "mode=memory" in name):
            messages.append(
                Warning(
                    f"Database {alias!r} is an in-memory SQLite database.",
                    hint="Scheduler instances coordinate through the database; they cannot share one "
                    "that lives in a single process. Use a file.",
                    id="anarchon.W001",
                )
            )
    return messages


@register("anarchon")
def check_jobs(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from .scheduler import scheduler

    return [
        Error(
            str(error),
            hint=f"Fix the declaration in {module}; until then none of its jobs are registered.",
            obj=module,
            id="anarchon.E005",
        )
        for module, error in scheduler.registry.errors
    ]


@register("anarchon")
def check_task_jobs(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Every task job's task can be enqueued by its backend, and what holds where the enqueue is not atomic."""
    from . import store, taskjobs
    from .scheduler import scheduler

    messages: list[CheckMessage] = []
    for job in scheduler.jobs:
        if job.task is None:
            continue
        task = job.task
        where = f"Job {job.name!r}: its task {taskjobs.task_name(task)}"
        alias = getattr(task, "backend", "default")
        try:
            backend = taskjobs.backend_of(task)
        except Exception as error:
            messages.append(
                Error(
                    f"{where} uses the task backend {alias!r}, which cannot be loaded: {error}",
                    hint="Add the backend to the TASKS setting, or give the task a backend that is there "
                    "(@task(backend=...)).",
                    obj=job.origin,
                    id="anarchon.E006",
                )
            )
            continue
        kind = type(backend).__name__
        if taskjobs.is_dummy(backend):
            messages.append(
                Error(
                    f"{where} uses the task backend {alias!r} ({kind}), "
                    "which keeps tasks in memory and never runs them.",
                    hint="Use a backend with a worker, such as django-tasks-db's DatabaseBackend, or the "
                    "ImmediateBackend to run the task in the scheduler's worker.",
                    obj=job.origin,
                    id="anarchon.E006",
                )
            )
            continue
        try:
            backend.validate_task(task)
        except Exception as error:
            messages.append(
                Error(
                    f"{where} cannot be enqueued by the task backend {alias!r} ({kind}): {error}",
                    hint="Change the task's options (priority, run_after, async) or its backend.",
                    obj=job.origin,
                    id="anarchon.E006",
                )
            )
            continue
        model = taskjobs.result_model(backend)
        if taskjobs.runs_at_once(backend):
            continue  # the task runs inside the run's transaction
        if model is None or router.db_for_write(model) != store.alias():
            place = "a database other than the scheduler's" if model is not None else "outside the database"
            messages.append(
                Warning(
                    f"{where} is enqueued to the task backend {alias!r} ({kind}), which stores tasks in {place}: "
                    "the enqueue and the run's record cannot commit together, so an instance that dies between "
                    "them leaves the slot to a takeover that enqueues the task again.",
                    hint="Make the task idempotent on its slot= argument (the same on every attempt), or use "
                    "django-tasks-db's DatabaseBackend on the scheduler's database for exactly one enqueue per "
                    "slot. Silence this with SILENCED_SYSTEM_CHECKS once the task is idempotent.",
                    obj=job.origin,
                    id="anarchon.W003",
                )
            )
    return messages


_UTC_NAMES = {"+00:00", "-00:00", "00:00", "UTC", "ETC/UTC", "GMT", "ETC/GMT", "Z", "UNIVERSAL", "ZULU"}


@register(Tags.database)
def check_mysql_time_zone(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Runs only when databases are given (``check --database``, ``migrate``, ``manage.py anarchon``)."""
    messages: list[CheckMessage] = []
    for alias in databases or []:
        connection = connections[alias]
        if connection.vendor == "sqlite":
            messages.extend(_sqlite_journal(alias))
            continue
        if connection.vendor != "mysql":
            continue
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT TIMESTAMPDIFF(SECOND, UTC_TIMESTAMP(), NOW()), @@session.time_zone, @@system_time_zone"
                )
                offset, zone, system_zone = cursor.fetchone()
        except DatabaseError:
            continue  # an unreachable database is reported by the scheduler itself
        # A named zone such as 'Europe/London' is +0 in winter only: require a zone that is UTC all year.
        effective = system_zone if str(zone).upper() == "SYSTEM" else zone
        if offset or str(effective).upper() not in _UTC_NAMES:
            messages.append(
                Error(
                    f"Database {alias!r}: the MySQL session time zone is {zone!r} ({offset:+d}s from UTC).",
                    hint='Add "init_command": "SET time_zone=\'+00:00\'" to the database\'s OPTIONS, so '
                    "that database times are UTC like Django's.",
                    id="anarchon.E002",
                )
            )
        messages.extend(_mysql_time_zone_tables(alias))
    return messages


def _mysql_time_zone_tables(alias: str) -> list[CheckMessage]:
    """A warning when the server cannot convert times to ``TIME_ZONE`` (its time zone tables are not loaded)."""
    zone = str(settings.TIME_ZONE or "UTC")
    try:
        if not settings.USE_TZ or converts_to(connections[alias], zone):
            return []
    except DatabaseError:
        return []
    return [
        Warning(
            f"Database {alias!r}: the MySQL/MariaDB server cannot convert times to TIME_ZONE {zone!r}: "
            "its time zone tables are not loaded.",
            hint="Django converts times to the current time zone in SQL for the admin's date bar (which "
            "fails without them: the run history leaves it out meanwhile) and for __year/__month/__day "
            "lookups (which find nothing). Load them with: "
            "mariadb-tzinfo-to-sql /usr/share/zoneinfo | mariadb -u root mysql (mysql_tzinfo_to_sql on MySQL).",
            id="anarchon.W004",
        )
    ]


def _sqlite_journal(alias: str) -> list[CheckMessage]:
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            mode = str(cursor.fetchone()[0]).lower()
    except DatabaseError:
        return []
    if mode == "wal" or mode == "memory":
        return []
    return [
        Warning(
            f"Database {alias!r}: SQLite is in {mode!r} journal mode.",
            hint="With several scheduler processes on one SQLite file, readers and writers block each other "
            "and runs start late. Run 'PRAGMA journal_mode=WAL' once (it persists in the file), or on "
            'Django 5.1+ add "init_command": "PRAGMA journal_mode=WAL" to the database\'s OPTIONS.',
            id="anarchon.W002",
        )
    ]
