"""A django-health-check check of the scheduler, built on :func:`django_anarchon.health.check_health`.

django-health-check 4 (Django 5.2+): list the check in the view::

    path("ht/", HealthCheckView.as_view(checks=[..., "django_anarchon.contrib.health_check.Scheduler"]))

django-health-check 3: add ``"django_anarchon.contrib.health_check"`` to ``INSTALLED_APPS``; its app
registers the check with ``health_check.plugins.plugin_dir``.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def check_health(instance_id: str | None = None) -> Any:
    """:func:`django_anarchon.health.check_health`, imported when called: this package is an app
    (django-health-check 3), imported while Django loads the apps, before models can be."""
    from django_anarchon.health import check_health

    return check_health(instance_id)


try:
    from health_check.base import HealthCheck
except ImportError:  # django-health-check 3
    HealthCheck = None

if HealthCheck is not None:
    from health_check.exceptions import ServiceUnavailable

    @dataclasses.dataclass
    class Scheduler(HealthCheck):  # type: ignore[misc]
        """A django-anarchon instance (any, or ``instance_id``) is alive and well."""

        instance_id: str | None = None

        def run(self) -> None:
            health = check_health(self.instance_id)
            if not health.ok:
                raise ServiceUnavailable(health.reason)

else:  # pragma: no cover - exercised where django-health-check 3 is installed (Django 4.2)
    from health_check import backends
    from health_check.exceptions import ServiceUnavailable

    _Base: Any = getattr(backends, "HealthCheck", None) or backends.BaseHealthCheckBackend

    class Scheduler(_Base):  # type: ignore[no-redef]
        """A django-anarchon instance is alive and well."""

        critical_service = True

        def check_status(self, subset: Any = None) -> None:
            health = check_health()
            if not health.ok:
                self.add_error(ServiceUnavailable(health.reason))

        def __repr__(self) -> str:
            return "django-anarchon scheduler"

        def identifier(self) -> str:
            return repr(self)


__all__ = ["Scheduler"]
