"""The committed migrations match the models on every supported Django."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    try:
        call_command("makemigrations", "django_anarchon", "--check", "--dry-run", verbosity=1)
    except SystemExit as exit_:  # makemigrations --check exits 1 when a migration is missing
        pytest.fail(f"models and migrations differ (makemigrations --check exited {exit_.code})")


@pytest.mark.django_db
def test_the_run_table_keeps_no_index_on_job_and_status() -> None:
    """Every run wrote its entry of that index at its claim and moved it at its end, a leaf page per job
    (migration 0009). Successes by job and end are indexed instead, partially where the database can."""
    from django.db import connection

    from django_anarchon.models import Run

    table = Run._meta.db_table
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, table)
    indexes = {name: info["columns"] for name, info in found.items() if info["index"] and not info["unique"]}
    assert ["job", "status"] not in indexes.values(), indexes
    if connection.features.supports_partial_indexes:
        assert indexes["anarchon_run_successes"] == ["job", "finished_at"], indexes
        with connection.cursor() as cursor:
            if connection.vendor == "sqlite":
                cursor.execute("SELECT sql FROM sqlite_master WHERE name = 'anarchon_run_successes'")
            else:
                cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'anarchon_run_successes'")
            (definition,) = cursor.fetchone()
        assert "WHERE" in definition and "'success'" in definition, definition
    else:
        assert indexes["anarchon_run_successes"] == ["job", "status", "finished_at"], indexes


def _run_indexes() -> dict[str, list[str]]:
    from django.db import connection

    from django_anarchon.models import Run

    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, Run._meta.db_table)
    return {name: info["columns"] for name, info in found.items() if info["index"] and not info["unique"]}


@pytest.mark.django_db(transaction=True)
def test_migration_0009_goes_both_ways_and_runs_again_after_stopping_half_way() -> None:
    """Instances run on while it applies: on PostgreSQL every index is built and dropped CONCURRENTLY
    (a plain CREATE INDEX held back every write, a plain DROP INDEX every read behind any open
    transaction); and a run stopped between its steps (MariaDB's DDL is not transactional) applies
    when run again, where it failed with "Duplicate key name"."""
    from django.db import connection

    from django_anarchon.models import Run, SuccessesIndex

    sent: list[str] = []

    def keep(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "INDEX" in sql.upper():
            sent.append(sql)
        return execute(sql, params, many, context)

    try:
        with connection.execute_wrapper(keep):
            call_command("migrate", "django_anarchon", "0008", verbosity=0)
        indexes = _run_indexes()
        assert ["job", "status"] in indexes.values() and "anarchon_run_successes" not in indexes, indexes
        # Half way: the new index made, the old one not yet dropped.
        with connection.schema_editor(atomic=False) as editor:
            editor.add_index(Run, SuccessesIndex(name="anarchon_run_successes"))
        with connection.execute_wrapper(keep):
            call_command("migrate", "django_anarchon", "0009", verbosity=0)
        indexes = _run_indexes()
        assert ["job", "status"] not in indexes.values() and "anarchon_run_successes" in indexes, indexes
    finally:
        call_command("migrate", "django_anarchon", verbosity=0)
    changes = [s for s in sent if s.lstrip().upper().startswith(("CREATE INDEX", "DROP INDEX"))]
    assert len(changes) == 3, changes  # back: create the old, drop the new; forward: drop the old
    if connection.vendor == "postgresql":
        assert all("CONCURRENTLY" in s for s in changes), changes


@pytest.mark.django_db(transaction=True)
def test_migration_0010_gives_the_job_name_columns_a_binary_collation_on_mysql_and_touches_nothing_elsewhere() -> None:
    """On MySQL/MariaDB a column takes the database's default collation, usually case- and
    accent-insensitive: "Sync" and "sync" were one job there (helper 28). The migration makes the
    name columns compare exactly, keeping their character set; elsewhere it sends no statement."""
    from django.db import connection

    sent: list[str] = []

    def keep(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.lstrip().upper().startswith("ALTER"):
            sent.append(sql)
        return execute(sql, params, many, context)

    columns = {"django_anarchon_jobstate": "name", "django_anarchon_run": "job"}
    try:
        call_command("migrate", "django_anarchon", "0009", verbosity=0)
        if connection.vendor == "mysql":
            with connection.cursor() as cursor:  # as a table made before the migration has them
                for table, column in columns.items():
                    cursor.execute(
                        f"ALTER TABLE {table} MODIFY {column} varchar(200) "
                        "CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL"
                    )
        with connection.execute_wrapper(keep):
            call_command("migrate", "django_anarchon", verbosity=0)
            applied_again = len(sent)
            call_command("migrate", "django_anarchon", "0009", verbosity=0)
            call_command("migrate", "django_anarchon", verbosity=0)  # already binary: nothing to do
    finally:
        call_command("migrate", "django_anarchon", verbosity=0)
    if connection.vendor != "mysql":
        assert sent == []
        return
    assert applied_again == 2 and len(sent) == 2, sent
    with connection.cursor() as cursor:
        for table, column in columns.items():
            cursor.execute(
                "SELECT character_set_name, collation_name, is_nullable FROM information_schema.columns "
                "WHERE table_schema = DATABASE() AND table_name = %s AND column_name = %s",
                [table, column],
            )
            assert cursor.fetchone() == ("utf8mb4", "utf8mb4_bin", "NO"), (table, column)
        primary = connection.introspection.get_constraints(cursor, "django_anarchon_jobstate")
    assert any(c["primary_key"] and c["columns"] == ["name"] for c in primary.values()), primary
