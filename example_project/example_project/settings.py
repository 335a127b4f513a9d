"""Settings of the example project. Everything can be overridden from the environment.

DATABASE_URL picks the database (default: SQLite file next to manage.py), e.g.
DATABASE_URL=postgres://postgres@127.0.0.1:5432/example.
"""

from __future__ import annotations

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()

SECRET_KEY = env.str("SECRET_KEY", default="example-only-change-me")
DEBUG = env.bool("DEBUG", default=True)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])
USE_TZ = True
TIME_ZONE = env.str("TIME_ZONE", default="UTC")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
if "sqlite" in DATABASES["default"]["ENGINE"]:
    # Several local `anarchon` processes share the file: let writers wait for each other.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
elif "mysql" in DATABASES["default"]["ENGINE"]:
    # Keep database times in UTC, like Django's (system check anarchon.E002).
    DATABASES["default"].setdefault("OPTIONS", {})["init_command"] = "SET time_zone='+00:00'"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_anarchon",
    "demo",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"
STATIC_URL = "static/"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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

# Failure alerts go to the admins; the console backend prints them.
ADMINS = [("Operations", env.str("ADMIN_EMAIL", default="ops@example.com"))]
EMAIL_BACKEND = env.str("EMAIL_BACKEND", default="django.core.mail.backends.console.EmailBackend")
SERVER_EMAIL = "anarchon@example.com"

ANARCHON = {
    "LEASE_TTL": env.float("ANARCHON_LEASE_TTL", default=30.0),
    "POLL_INTERVAL": env.float("ANARCHON_POLL_INTERVAL", default=1.0),
    "SHUTDOWN_GRACE": env.float("ANARCHON_SHUTDOWN_GRACE", default=30.0),
    "DATA": {"environment": env.str("ENVIRONMENT", default="example")},
    "HISTORY_RETENTION": "7d",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "django_anarchon": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "demo": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}
