"""django-anarchon: a leaderless, distributed periodic-job scheduler for Django.

Declare jobs in your apps' ``jobs.py`` on :data:`scheduler`, run
``python manage.py anarchon`` on every instance, and exactly one instance wins
each scheduled run. This module is the public API; it imports no models.
"""

from __future__ import annotations

from .context import Context
from .exceptions import (
    AnarchonError,
    AttemptsExhausted,
    DataNotSerializableError,
    DuplicateJobError,
    Interrupted,
    JobDeclarationError,
    SettingsError,
    TaskFailed,
    UnknownJobError,
)
from .scheduler import Scheduler, arun_now, run_now, scheduler
from .signal import AbortSignal

__version__ = "0.1.0"

__all__ = [
    "AbortSignal",
    "AnarchonError",
    "AttemptsExhausted",
    "Context",
    "DataNotSerializableError",
    "DuplicateJobError",
    "Interrupted",
    "JobDeclarationError",
    "Scheduler",
    "SettingsError",
    "TaskFailed",
    "UnknownJobError",
    "arun_now",
    "run_now",
    "scheduler",
]
