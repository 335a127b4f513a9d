"""The committed migrations match the models on every supported Django."""

from __future__ import annotations

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
