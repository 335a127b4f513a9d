"""PostgreSQL only: ``django_anarchon_claim()`` with plans PostgreSQL can keep, and an index of active runs.

The function of migration 0003 looked rows up with ``= ANY(array)``; for such
queries PL/pgSQL's plan cache keeps choosing a custom plan, so each of its
statements was planned again on every call (0.2-0.6 ms each, most of a
claim's time). This version decides the same things in the same order, one
claim and one job at a time, with scalar parameters only: every statement
gets a generic plan once and reuses it, and every plan is an index lookup by
(job, slot) or by job name, however long the history of runs grows.

"What is this job doing" (a ``running`` run, or a handed-over one waiting)
is answered from a partial index holding only those rows,
``anarchon_run_active``: without it, the lookup went through every running
run of the table or through a job's whole history. Building it reads the run
table once while holding off writes to it (claims wait): on a history of
millions of runs, a few seconds.

Same signature and result as before; the Python side is unchanged. Other
databases get nothing from this migration.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

from django_anarchon.store.schema import install_claim_function

# Migration 0006 moves this index into the Run model's Meta.indexes.
INDEX = (
    "CREATE INDEX IF NOT EXISTS anarchon_run_active ON django_anarchon_run (job) "
    "WHERE status = 'running' OR (status = 'pending' AND attempt > 1)"
)


def create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(INDEX)
        install_claim_function(2)(apps, schema_editor)


def restore(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        install_claim_function(1)(apps, schema_editor)
        schema_editor.execute("DROP INDEX IF EXISTS anarchon_run_active")


class Migration(migrations.Migration):
    dependencies = [("django_anarchon", "0003_claim_function")]
    operations = [migrations.RunPython(create, restore, elidable=False)]
