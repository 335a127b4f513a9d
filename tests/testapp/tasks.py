"""Tasks for the task-job tests: django.tasks on Django 6, the django-tasks backport before it."""

from __future__ import annotations

import os
import time
from typing import Any

try:
    from django.tasks import task
except ImportError:  # Django 4.2/5.2
    from django_tasks import task  # type: ignore[no-redef]


def _note(name: str, slot: int, data: Any, event: str = "task") -> None:
    from .models import Execution

    Execution.objects.create(
        job=name,
        slot=slot,
        attempt=0,
        reason="task",
        instance_id=os.environ.get("ANARCHON_TEST_INSTANCE", "worker"),
        pid=os.getpid(),
        event=event,
        at=time.time(),
        data=data,
    )


@task()
def record_slot(slot: int, data: Any = None) -> int:
    """Write one Execution row per execution: the tests count them per slot."""
    _note("task:record_slot", slot, data)
    return slot


# The same task on the backend that pauses inside its enqueue (tests/testapp/backends.py).
record_slot_slowly = record_slot.using(backend="slow")


@task()
def slot_only(slot: int) -> int:
    """Takes the slot and nothing else."""
    _note("task:slot_only", slot, None)
    return slot


@task(backend="immediate")
def record_now(slot: int, data: Any = None) -> int:
    """The same on the immediate backend: runs inside the scheduler's worker."""
    _note("task:record_now", slot, data)
    return slot


@task(backend="immediate")
def fail_now(slot: int) -> None:
    """Raises inside the scheduler's worker (immediate backend), after a write that must not stay."""
    _note("task:fail_now", slot, None)
    raise ValueError(f"task failed for slot {slot}")


@task(backend="dummy")
def never_runs(slot: int) -> None:
    """On the dummy backend: a task job with it is a system-check error."""
