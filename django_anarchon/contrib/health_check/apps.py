"""With django-health-check 3, registers the scheduler check when the app is installed."""

from __future__ import annotations

from django.apps import AppConfig


class AnarchonHealthCheckConfig(AppConfig):
    name = "django_anarchon.contrib.health_check"
    label = "anarchon_health_check"
    verbose_name = "Anarchon scheduler health check"

    def ready(self) -> None:
        try:
            from health_check.plugins import plugin_dir
        except ImportError:
            return  # django-health-check 4 lists its checks in the view instead
        from . import Scheduler

        plugin_dir.register(Scheduler)
