"""The database server's clock as query expressions: leases are judged by it, never by a host's clock."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import DateTimeField, ExpressionWrapper, Func, Value
from django.db.models.functions import Greatest


class DbNow(Func):
    """The database server's clock, in UTC, to the microsecond where it has them.

    Django's ``Now()`` follows the MySQL session time zone and, before Django 5,
    has only whole seconds on SQLite; leases need neither surprise.
    """

    output_field = DateTimeField()
    template = "CURRENT_TIMESTAMP"

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template="STATEMENT_TIMESTAMP()", **extra)

    def as_mysql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template="UTC_TIMESTAMP(6)", **extra)

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(
            compiler, connection, template="STRFTIME('%%%%Y-%%%%m-%%%%d %%%%H:%%%%M:%%%%f', 'NOW')", **extra
        )


class DbIn(ExpressionWrapper):
    """The database clock plus a number of seconds.

    On SQLite, a date modifier of ``STRFTIME`` rather than Django's date
    arithmetic, which calls back into Python for every row (a claim's
    INSERT sets a lease per row: a tenth of what it cost there).
    """

    def __init__(self, seconds: float) -> None:
        super().__init__(DbNow() + timedelta(seconds=seconds), output_field=DateTimeField())
        self.seconds = float(seconds)

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', %s)", [f"{self.seconds:+.6f} seconds"]


def db_in(seconds: float) -> ExpressionWrapper:
    """The database clock plus ``seconds``."""
    return DbIn(seconds)


class NotBefore(Greatest):
    """The database clock, or ``moment`` if that is later (a run claimed ahead starts at its slot)."""

    def __init__(self, moment: datetime) -> None:
        super().__init__(DbNow(), Value(moment, output_field=DateTimeField()))
        self.moment = moment


def db_not_before(moment: datetime) -> Greatest:
    """The later of the database clock and ``moment``."""
    return NotBefore(moment)


def converts_to(connection: Any, zone: str) -> bool:
    """Whether ``connection`` (a Django wrapper) can convert its times to the named time ``zone`` in SQL.

    Django converts datetimes in SQL to truncate or extract them in the current time zone (the
    admin's date bar, ``__year`` lookups): on MySQL/MariaDB with ``CONVERT_TZ``, which answers NULL
    for a named zone unless the server's time zone tables are loaded, and Django then raises
    ``ValueError("Database returned an invalid datetime value…")``. True on the other databases,
    and where Django converts nothing (the zone is the connection's own).
    """
    if connection.vendor != "mysql" or not zone or zone == connection.timezone_name:
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT CONVERT_TZ('2001-01-01 00:00:00', %s, %s)", [connection.timezone_name, zone])
        row = cursor.fetchone()
    return row is not None and row[0] is not None
