"""Job names are compared exactly on MySQL and MariaDB: the name columns get the ``_bin`` collation.

Job names are case- and accent-sensitive everywhere else ("sync" and "Sync", "café" and "cafe"
are two jobs, as the registry has them), but a MySQL/MariaDB column takes the database's
default collation, usually case- and accent-insensitive (``utf8mb4_general_ci``,
``utf8mb4_0900_ai_ci``): two such jobs shared one ``JobState`` row, and the second of them
never ran. ``JobState.name`` and ``Run.job`` keep their character set and get its binary
collation. PostgreSQL and SQLite compare exactly already; nothing changes there.

On MySQL and MariaDB this rebuilds the run table (its DDL is not transactional, and it holds back the
scheduler's writes meanwhile): with a long run history, apply it when the scheduler is stopped.
It is skipped for a column that has a binary collation already, so it can be run again.
A later migration that alters either field must keep the collation (Django's MySQL schema
editor would write the column back with the table's default).
"""

from typing import Any

from django.db import migrations


def forwards(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    quote = connection.ops.quote_name
    for model_name, column in (("JobState", "name"), ("Run", "job")):
        table = apps.get_model("django_anarchon", model_name)._meta.db_table
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT character_set_name, collation_name, character_maximum_length FROM information_schema.columns "
                "WHERE table_schema = DATABASE() AND table_name = %s AND column_name = %s",
                [table, column],
            )
            charset, collation, length = cursor.fetchone()
        if collation.endswith("_bin"):
            continue
        schema_editor.execute(
            f"ALTER TABLE {quote(table)} MODIFY {quote(column)} varchar({int(length)}) "
            f"CHARACTER SET {charset} COLLATE {charset}_bin NOT NULL"
        )


class Migration(migrations.Migration):

    atomic = False  # MariaDB's DDL commits anyway

    dependencies = [
        ('django_anarchon', '0009_run_successes_index'),
    ]

    operations = [
        migrations.RunPython(forwards, migrations.RunPython.noop, elidable=False),
    ]
