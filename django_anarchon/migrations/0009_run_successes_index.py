"""The index on ``(job, status)`` gives way to ``anarchon_run_successes`` (``models.SuccessesIndex``).

Every run wrote its entry of the old index at its claim and moved it at its end; with each
run of another job, a batch of runs wrote about as many leaf pages of it as it had runs.
The new index is partial, successful runs by job and end (``WHERE status = 'success'``),
where the database has partial indexes (PostgreSQL, SQLite); MariaDB gets
``(job, status, finished_at)``. It is created before the old one is dropped, so that the
newest-success query keeps an index meanwhile. On a large history, creating it takes a
while, and PostgreSQL holds back writes to the run table until it is built.
"""

from django.db import migrations

import django_anarchon.models


class Migration(migrations.Migration):

    dependencies = [
        ('django_anarchon', '0008_run_task_result_id'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='run',
            index=django_anarchon.models.SuccessesIndex(name='anarchon_run_successes'),
        ),
        migrations.RemoveIndex(
            model_name='run',
            name='anarchon_run_job_status',
        ),
    ]
