"""System checks: configuration mistakes that would break the scheduler's guarantees.

=================  ==========================================================
``anarchon.E001``  ``USE_TZ`` is False (leases and slots are compared in UTC).
``anarchon.E002``  a MySQL/MariaDB connection whose session time zone is not UTC.
``anarchon.E003``  ``LEASE_TTL`` shorter than three ``POLL_INTERVAL`` s.
``anarchon.E004``  the ``ANARCHON`` settings dict has an unknown key or a bad value.
``anarchon.E005``  a ``jobs.py`` declares a bad job.
``anarchon.W001``  an in-memory SQLite database (instances cannot share it).
``anarchon.W002``  a SQLite database not in WAL mode (instances block each other).
=================  ==========================================================
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DatabaseError, connections

from .conf import parse, problems
from .exceptions import SettingsError


@register("anarchon")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    if not settings.USE_TZ:
        messages.append(
            Error(
                "django-anarchon needs USE_TZ = True.",
                hint="With USE_TZ = False, SQLite stores local times while the database clock is UTC, "
                "so leases would look hours fresh or stale. Set USE_TZ = True.",
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
    return messages


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
