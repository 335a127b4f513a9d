from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        connection_created.connect(use_wal)


def use_wal(sender, connection, **kwargs):  # type: ignore[no-untyped-def]
    """Several test processes share the SQLite file: WAL lets readers and one writer work at once."""
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
