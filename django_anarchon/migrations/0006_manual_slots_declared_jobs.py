"""Manual runs get a slot space of their own; jobs remember when they were last declared.

* The unique constraint becomes (job, slot, attempt, manual): ``run_now()`` in the
  very millisecond of a scheduled slot no longer takes that slot's row, and the
  claim function (v4, PostgreSQL) decides a slot by its scheduled rows only.
* ``JobState.declared_at``: the pending and running rows of a job that no instance
  has declared for a while are closed instead of waiting for ever.
* The partial index ``anarchon_run_active`` (created as raw SQL by 0004 on
  PostgreSQL) moves into ``Run.Meta.indexes`` (``models.ActiveRunsIndex``, built on
  ``models.ACTIVE``); SQLite gets it too, MariaDB, which has no partial indexes, a
  plain index on the job.
* The ``cancel_run`` permission, for the admin's "Cancel" action on pending runs.
"""

from typing import Any

from django.db import migrations, models

import django_anarchon.models
from django_anarchon.store.schema import install_claim_function


def drop_raw_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX IF EXISTS anarchon_run_active")


def create_raw_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "CREATE INDEX IF NOT EXISTS anarchon_run_active ON django_anarchon_run (job) "
            "WHERE status = 'running' OR (status = 'pending' AND attempt > 1)"
        )


class Migration(migrations.Migration):

    dependencies = [
        ('django_anarchon', '0005_claim_function_quiet_losers'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='run',
            options={'permissions': [('cancel_run', 'Can cancel a pending run')], 'verbose_name': 'run', 'verbose_name_plural': 'runs'},
        ),
        migrations.RemoveConstraint(
            model_name='run',
            name='anarchon_one_winner_per_attempt',
        ),
        migrations.AddConstraint(
            model_name='run',
            constraint=models.UniqueConstraint(fields=('job', 'slot', 'attempt', 'manual'), name='anarchon_one_winner_per_attempt'),
        ),
        migrations.AddField(
            model_name='jobstate',
            name='declared_at',
            field=models.DateTimeField(blank=True, null=True, verbose_name='last declared'),
        ),
        migrations.RunPython(drop_raw_index, create_raw_index, elidable=False),
        migrations.AddIndex(
            model_name='run',
            index=django_anarchon.models.ActiveRunsIndex(name='anarchon_run_active'),
        ),
        migrations.RunPython(install_claim_function(4), install_claim_function(3), elidable=False),
    ]
