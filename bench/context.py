"""What every scenario gets: the database, the mode, a scratch folder, a logger."""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Context:
    db: str  # postgres, sqlite or mariadb
    quick: bool
    scratch: Path

    @property
    def primary(self) -> bool:
        """PostgreSQL gets every configuration; the others the ones that tell something new."""
        return self.db == "postgres"

    def folder(self, name: str) -> Path:
        """An empty scratch folder for one measurement."""
        path = self.scratch / self.db / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {self.db}: {message}", file=sys.stderr, flush=True)


def reset_database() -> None:
    """Empty the scheduler's tables (and the benchmark's own) of the bench database."""
    from django.db import connection

    from bench.benchapp.models import ClaimRef, Tick
    from django_anarchon.models import Instance, JobState, Run

    tables = [m._meta.db_table for m in (Run, JobState, Instance, ClaimRef, Tick)]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("TRUNCATE " + ", ".join(tables))
            # Every measurement starts from a checkpoint, so that none has one in its window
            # (a timed checkpoint counts from the last one, five minutes by default).
            cursor.execute("CHECKPOINT")
        else:
            for table in tables:
                cursor.execute(f"DELETE FROM {table}")  # noqa: S608 - our own table names
    connection.close()


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))
