from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "demo"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from . import alerts  # noqa: F401 - connects the failure alert

        connection_created.connect(use_wal)


def use_wal(sender, connection, **kwargs):  # type: ignore[no-untyped-def]
    """Several local `anarchon` processes may share db.sqlite3: WAL lets readers and a writer work at once
    (system check anarchon.W002). On Django 5.1+ the same can be set with OPTIONS["init_command"]."""
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
