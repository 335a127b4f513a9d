"""Settings of the benchmark project.

``ANARCHON_BENCH_DB`` picks the database (``postgres``, ``mariadb`` or ``sqlite``); the
benchmark's own databases are used, never the test suite's. ``ANARCHON_LEASE_TTL``,
``ANARCHON_POLL_INTERVAL``, ``ANARCHON_MAX_WORKERS`` and ``ANARCHON_SHUTDOWN_GRACE`` set the
scheduler; ``ANARCHON_BENCH_JOBS`` declares the jobs (see :mod:`bench.jobset`).
"""

from __future__ import annotations

import os
from typing import Any

from bench import dbconf

SECRET_KEY = "bench-only-not-secret"  # noqa: S105
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django_anarchon", "bench.benchapp"]
DATABASES = {"default": dbconf.database(os.environ.get("ANARCHON_BENCH_DB", "postgres"))}


def _float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


ANARCHON: dict[str, Any] = {
    "LEASE_TTL": _float("ANARCHON_LEASE_TTL", 30.0),
    "POLL_INTERVAL": _float("ANARCHON_POLL_INTERVAL", 1.0),
    "SHUTDOWN_GRACE": _float("ANARCHON_SHUTDOWN_GRACE", 5.0),
    "MAX_WORKERS": int(os.environ.get("ANARCHON_MAX_WORKERS", 16)),
}
if "ANARCHON_MAX_ATTEMPTS" in os.environ:  # "None": no limit
    _attempts = os.environ["ANARCHON_MAX_ATTEMPTS"]
    ANARCHON["MAX_ATTEMPTS"] = None if _attempts == "None" else int(_attempts)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"django_anarchon": {"handlers": ["console"], "level": os.environ.get("ANARCHON_BENCH_LOG", "WARNING")}},
}
