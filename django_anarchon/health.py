"""Is the scheduler alive? One answer for ``manage.py anarchon --check``, probes and django-health-check.

Read from the database only, so it works from any process (a web server, a
container's probe, a cron job): the instances' heartbeat rows, written by each
instance's loop, say that the loop turns and reaches the database, and carry the
offset of the instance's clock from the database's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import DatabaseError, connections

from . import store
from .clock import describe_offset
from .conf import get_settings
from .models import Instance

MAX_CLOCK_OFFSET_MS = 1000.0


@dataclass(frozen=True)
class Health:
    """The answer: ``ok``, why not (``reason``), and the instances that count as live."""

    ok: bool
    reason: str
    live: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return self.reason


def unapplied_migrations(alias: str) -> list[str]:
    """django_anarchon's migrations the database ``alias`` lacks (raises ``DatabaseError`` if unreachable)."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[alias])
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [migration.name for migration, backwards in plan if migration.app_label == "django_anarchon"]


def absent_sqlite_file(alias: str) -> str | None:
    """The path of ``alias``'s SQLite file if it is one that does not exist (else None)."""
    settings = connections[alias].settings_dict
    name = str(settings.get("NAME") or "")
    if connections[alias].vendor != "sqlite" or not name or name == ":memory:" or name.startswith("file:"):
        return None
    return None if os.path.exists(name) else name


def check_health(instance_id: str | None = None) -> Health:
    """Whether the cluster (or the instance ``instance_id``) is alive and well.

    Healthy: the migrations are applied, and at least one instance (with
    ``instance_id``: that one) sent a heartbeat within three heartbeat
    intervals of the database's clock, and its clock was within a second of the
    database's when it last measured it.
    """
    alias = store.alias()
    absent = absent_sqlite_file(alias)
    if absent is not None:  # connecting would make an empty one, and call it unmigrated
        return Health(False, f"the SQLite database file {absent} does not exist")
    try:
        missing = unapplied_migrations(alias)
        if missing:
            return Health(False, f"the database lacks django_anarchon's migrations {', '.join(missing)}: run migrate")
        now = store.database_time()
        rows = list(Instance.objects.using(alias).order_by("instance_id"))
    except DatabaseError as error:
        return Health(False, f"the database is unreachable ({type(error).__name__}: {error})")
    if instance_id is not None:
        rows = [row for row in rows if row.instance_id == instance_id]
        if not rows:
            return Health(False, f"no instance {instance_id!r} has registered (is `manage.py anarchon` running?)")
    stale_after = timedelta(seconds=3 * get_settings().heartbeat_every)
    live, problems = [], []
    for row in rows:
        age = (now - row.last_heartbeat).total_seconds()
        if now - row.last_heartbeat > stale_after:
            problems.append(f"{row.instance_id}: no heartbeat for {age:.0f}s (loop stopped, or database unreachable)")
        elif row.clock_offset_ms is not None and abs(row.clock_offset_ms) > MAX_CLOCK_OFFSET_MS:
            problems.append(f"{row.instance_id}: its clock is {describe_offset(row.clock_offset_ms)} the database's")
        else:
            live.append(row.instance_id)
    if live:
        return Health(True, f"{len(live)} live instance(s): {', '.join(live)}", live)
    if not rows:
        return Health(False, "no scheduler instance has registered (is `manage.py anarchon` running?)")
    return Health(False, "no live instance: " + "; ".join(problems))
