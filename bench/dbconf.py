"""The benchmark's own databases (never the test suite's ``test*`` ones)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

DB_NAME = "anarchon_bench"
SQLITE_PATH = Path(os.environ.get("ANARCHON_BENCH_SQLITE", Path(tempfile.gettempdir()) / "anarchon-bench.sqlite3"))
VENDORS = ("postgres", "sqlite", "mariadb")


def database(kind: str) -> dict[str, Any]:
    """The Django DATABASES entry for ``kind``."""
    if kind == "postgres":
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": DB_NAME,
            "USER": os.environ.get("ANARCHON_BENCH_PG_USER", "postgres"),
            "HOST": os.environ.get("ANARCHON_BENCH_PG_HOST", "127.0.0.1"),
            "PORT": os.environ.get("ANARCHON_BENCH_PG_PORT", "5432"),
            "CONN_HEALTH_CHECKS": True,
        }
    if kind == "mariadb":
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": DB_NAME,
            "USER": os.environ.get("ANARCHON_BENCH_MYSQL_USER", "root"),
            "HOST": os.environ.get("ANARCHON_BENCH_MYSQL_HOST", "127.0.0.1"),
            "PORT": os.environ.get("ANARCHON_BENCH_MYSQL_PORT", "3306"),
            "OPTIONS": {"init_command": "SET time_zone='+00:00'", "charset": "utf8mb4"},
            "CONN_HEALTH_CHECKS": True,
        }
    if kind == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(SQLITE_PATH), "OPTIONS": {"timeout": 30}}
    raise ValueError(f"unknown database {kind!r}; use one of {', '.join(VENDORS)}")
