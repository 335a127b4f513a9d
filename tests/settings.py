"""Settings for the test suite. ``DATABASE_URL`` picks the database (default: SQLite file)."""

from __future__ import annotations

import os
import tempfile
from importlib.util import find_spec
from pathlib import Path

import environ

env = environ.Env()
BASE_DIR = Path(__file__).resolve().parent
SQLITE_PATH = Path(tempfile.gettempdir()) / f"anarchon-tests-{os.environ.get('TOX_ENV_NAME', 'local')}.sqlite3"

SECRET_KEY = "tests-only-not-secret"  # noqa: S105
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {"default": env.db_url_config(os.environ.get("DATABASE_URL") or f"sqlite:///{SQLITE_PATH}")}
_db = DATABASES["default"]
_db.setdefault("TEST", {})
if "sqlite" in _db["ENGINE"]:
    # Process tests share the database with `manage.py anarchon` children, so
    # it must be a real file; the busy timeout lets writers queue up.
    _db["NAME"] = os.environ.get("ANARCHON_TEST_SQLITE", str(SQLITE_PATH))
    _db["TEST"]["NAME"] = _db["NAME"]
    _db.setdefault("OPTIONS", {})["timeout"] = 30
elif "mysql" in _db["ENGINE"]:
    _db.setdefault("OPTIONS", {}).update({"init_command": "SET time_zone='+00:00'", "charset": "utf8mb4"})
    _db["TEST"]["CHARSET"] = "utf8mb4"
    _db["TEST"]["COLLATION"] = "utf8mb4_unicode_ci"
if os.environ.get("ANARCHON_TEST_DB_NAME"):
    if os.environ.get("ANARCHON_TEST_CHILD"):
        # A `manage.py anarchon` started by a test: use the test database itself.
        _db["NAME"] = os.environ["ANARCHON_TEST_DB_NAME"]
    else:
        _db["TEST"]["NAME"] = os.environ["ANARCHON_TEST_DB_NAME"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_anarchon",
    "tests.testapp.apps.TestAppConfig",
]

# Task jobs: Django 6's django.tasks, or the django-tasks backport on 4.2/5.2; the database
# backend from django-tasks-db (5.2+) or from django-tasks 0.11 itself (4.2). tox installs them.
_tasks = "django.tasks" if find_spec("django.tasks") else "django_tasks"
if find_spec("django_tasks_db"):
    TASKS_DATABASE_BACKEND = "django_tasks_db.DatabaseBackend"
    INSTALLED_APPS += ["django_tasks_db"]
else:
    TASKS_DATABASE_BACKEND = "django_tasks.backends.database.DatabaseBackend"
    INSTALLED_APPS += ["django_tasks.backends.database"]
if _tasks == "django_tasks":
    INSTALLED_APPS += ["django_tasks"]
TASKS = {
    "default": {"BACKEND": TASKS_DATABASE_BACKEND},
    "immediate": {"BACKEND": f"{_tasks}.backends.immediate.ImmediateBackend"},
    "dummy": {"BACKEND": f"{_tasks}.backends.dummy.DummyBackend"},
    # The database backend, pausing between writing a task's row and returning (a SIGKILL test).
    "slow": {"BACKEND": "tests.testapp.backends.SlowDatabaseBackend"},
}
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ANARCHON = {
    "LEASE_TTL": env.float("ANARCHON_LEASE_TTL", default=2.0),
    "POLL_INTERVAL": env.float("ANARCHON_POLL_INTERVAL", default=0.2),
    "SHUTDOWN_GRACE": env.float("ANARCHON_SHUTDOWN_GRACE", default=5.0),
    "MAX_WORKERS": env.int("ANARCHON_MAX_WORKERS", default=16),
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"django_anarchon": {"handlers": ["console"], "level": env.str("ANARCHON_LOG_LEVEL", "INFO")}},
}
