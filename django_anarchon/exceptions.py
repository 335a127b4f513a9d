"""The exceptions django-anarchon raises.

Every error a user can cause subclasses both :class:`AnarchonError` and the
builtin that matches it, and builds its message from what was wrong, so that
``except ValueError`` and ``except AnarchonError`` both work.
"""

from __future__ import annotations

from typing import Any


class AnarchonError(Exception):
    """Base class of every error django-anarchon raises on bad input."""


class JobDeclarationError(AnarchonError, ValueError):
    """A job was declared with a bad name, schedule, timezone, option or handler."""

    def __init__(self, job: str | None, problem: str) -> None:
        self.job = job
        self.problem = problem
        where = f"Job {job!r}: " if job is not None else ""
        super().__init__(f"{where}{problem}")


class DuplicateJobError(JobDeclarationError):
    """Two jobs were declared with the same name."""

    def __init__(self, job: str, first: str, second: str) -> None:
        if first == second:
            problem = (
                f"it is declared twice for the same handler, {first}: is the declaration run twice "
                "(a jobs module imported under two names, or declared in a loop)? "
                "Job names must be unique within the project."
            )
        else:
            problem = (
                f"this name is already used by {first}; it cannot also be given to "
                f"{second}. Job names must be unique within the project."
            )
        super().__init__(job, problem)


class UnknownJobError(AnarchonError, LookupError):
    """A job name was given that no ``jobs.py`` declares."""

    def __init__(self, job: str, known: list[str], unloaded: list[str] | None = None) -> None:
        self.job = job
        if known:
            shown = ", ".join(repr(n) for n in sorted(known)[:20])
            more = f" (and {len(known) - 20} more)" if len(known) > 20 else ""
            hint = f"Declared jobs are: {shown}{more}."
        elif not unloaded:
            hint = "No jobs are declared: is 'django_anarchon' in INSTALLED_APPS and do your apps have a jobs.py?"
        else:
            hint = "No jobs are declared."
        if unloaded:
            modules = "; ".join(unloaded)
            hint += f" These jobs modules declare a bad job, and none of their jobs is registered: {modules}"
        super().__init__(f"No job is named {job!r}. {hint}")


class DataNotSerializableError(AnarchonError, TypeError):
    """Run data (or saved progress) could not be stored as JSON."""

    def __init__(self, where: str, value: Any, error: Exception | str) -> None:
        self.value = value
        shown = repr(value)
        if len(shown) > 200:
            shown = shown[:200] + "…"
        super().__init__(
            f"{where} must be JSON-serialisable (dicts, lists, strings, numbers, "
            f"booleans, None), because it is stored with the run; got {shown}: {error}"
        )


class SettingsError(AnarchonError, ValueError):
    """The ``ANARCHON`` settings dict holds an unknown key or a bad value (or another setting breaks the scheduler)."""

    def __init__(self, key: str | None, problem: str, *, setting: str = "ANARCHON") -> None:
        self.key = key
        where = f"{setting}[{key!r}]: " if key is not None else f"{setting}: "
        super().__init__(f"{where}{problem}")


class AttemptsExhausted(AnarchonError, RuntimeError):
    """A run was interrupted on its last allowed attempt (``MAX_ATTEMPTS``) and recorded failed.

    Sent as the ``exception`` of ``run_failed`` for such a run; never raised.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)


class TaskFailed(AnarchonError, RuntimeError):
    """The task of a task job ran at once (the immediate backend) and raised.

    Sent as the ``exception`` of ``run_failed``; the run records the task's own
    exception class as its error type and the task's traceback.
    """

    def __init__(self, task: str, exception_class_path: str, traceback: str) -> None:
        self.task = task
        self.exception_class_path = exception_class_path
        self.task_traceback = traceback
        last = traceback.strip().splitlines()[-1] if traceback.strip() else exception_class_path
        super().__init__(f"Task {task} raised {last}")


class Interrupted(BaseException):
    """The run was asked to stop: the scheduler is stopping, or its lease was lost.

    Like :class:`asyncio.CancelledError` and trio's ``Cancelled`` it derives
    from :class:`BaseException`, so a handler's ``except Exception:`` does not
    swallow it by accident. Its message says why the run was interrupted.
    """
