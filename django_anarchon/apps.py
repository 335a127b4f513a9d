"""App configuration: register the system checks and discover every app's ``jobs`` module."""

from __future__ import annotations

from django.apps import AppConfig


class AnarchonConfig(AppConfig):
    name = "django_anarchon"
    verbose_name = "Anarchon scheduler"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401 - registers the checks
        from .scheduler import scheduler

        scheduler.registry.discover("jobs")
