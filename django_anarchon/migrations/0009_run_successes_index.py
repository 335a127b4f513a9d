"""The index on ``(job, status)`` gives way to ``anarchon_run_successes`` (``models.SuccessesIndex``).

Every run wrote its entry of the old index at its claim and moved it at its end; with each
run of another job, a batch of runs wrote about as many leaf pages of it as it had runs.
The new index is partial, successful runs by job and end (``WHERE status = 'success'``),
where the database has partial indexes (PostgreSQL, SQLite); MariaDB gets
``(job, status, finished_at)``.

Running instances go on while it applies: the new index is created before the old one is
dropped, so the newest-success query keeps an index meanwhile, and on PostgreSQL both are
built and dropped ``CONCURRENTLY`` (not holding back the scheduler's writes, nor, for the
drop, its reads). Each step is skipped when already done, so a run that stopped half way
(MariaDB's DDL is not transactional) can be run again. On MariaDB each step waits for open
transactions that read the run table (a backup, a long report) and holds back the
scheduler's queries meanwhile: apply it when none is running.
"""

from typing import Any

from django.db import migrations

import django_anarchon.models

NEW, OLD = "anarchon_run_successes", "anarchon_run_job_status"


def _indexes(schema_editor: Any, table: str) -> dict[str, bool]:
    """The run table's indexes by name: whether each is usable (PostgreSQL marks a failed concurrent build invalid)."""
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        found = {name: True for name in connection.introspection.get_constraints(cursor, table)}
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE i.indrelid = %s::regclass",
                [connection.ops.quote_name(table)],
            )
            found.update(dict(cursor.fetchall()))
    return found


def _create(schema_editor: Any, model: Any, index: Any) -> None:
    found = _indexes(schema_editor, model._meta.db_table)
    concurrently = schema_editor.connection.vendor == "postgresql"
    if index.name in found and not found[index.name]:
        _drop(schema_editor, model, index.name)  # a concurrent build that failed: built again
    elif index.name in found:
        return
    options = {"concurrently": True} if concurrently else {}
    schema_editor.execute(index.create_sql(model, schema_editor, **options))


def _drop(schema_editor: Any, model: Any, name: str) -> None:
    if name not in _indexes(schema_editor, model._meta.db_table):
        return
    options = {"concurrently": True} if schema_editor.connection.vendor == "postgresql" else {}
    schema_editor.execute(schema_editor._delete_index_sql(model, name, **options))


def forwards(apps: Any, schema_editor: Any) -> None:
    run = apps.get_model("django_anarchon", "Run")
    _create(schema_editor, run, django_anarchon.models.SuccessesIndex(name=NEW))
    _drop(schema_editor, run, OLD)


def backwards(apps: Any, schema_editor: Any) -> None:
    from django.db import models

    run = apps.get_model("django_anarchon", "Run")
    _create(schema_editor, run, models.Index(fields=["job", "status"], name=OLD))
    _drop(schema_editor, run, NEW)


class Migration(migrations.Migration):

    atomic = False  # PostgreSQL builds and drops indexes CONCURRENTLY only outside a transaction

    dependencies = [
        ('django_anarchon', '0008_run_task_result_id'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name='run',
                    index=django_anarchon.models.SuccessesIndex(name=NEW),
                ),
                migrations.RemoveIndex(
                    model_name='run',
                    name=OLD,
                ),
            ],
            database_operations=[migrations.RunPython(forwards, backwards, elidable=False)],
        ),
    ]
