"""Jobs that enqueue a ``django.tasks`` task instead of calling a handler.

A *task job* is declared with a task (``scheduler.cron(name, spec, task=t)``,
or the decorator stacked on ``@task``). Its run does one thing: enqueue the
task with ``slot=`` (and ``data=`` where the task takes it). The runner does
that inside the transaction that records the run ``success`` (see
:func:`store.finish_enqueued`), so where the task backend stores tasks in the
scheduler's database, the task row and the run's record commit together or
not at all: a takeover never enqueues a slot twice.

Works with Django 6's ``django.tasks`` and with the ``django-tasks`` backport
(Django 4.2/5.2); this module imports neither until a task job needs it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from .exceptions import TaskFailed

INSTALL_HINT = (
    "task jobs need Django 6's django.tasks or the django-tasks backport: pip install 'django-anarchon[tasks]' "
    "(and, for the database backend, django-tasks-db)"
)


def task_classes() -> tuple[type, ...]:
    """The ``Task`` classes of the task frameworks that are installed (Django's first)."""
    found: list[type] = []
    for module in ("django.tasks.base", "django_tasks.base"):
        try:
            found.append(import_module(module).Task)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def is_task(value: object) -> bool:
    """Whether ``value`` is a task (a function decorated with ``@task``) of an installed framework."""
    classes = task_classes()
    return bool(classes) and isinstance(value, classes)


def task_name(task: Any) -> str:
    return str(getattr(task, "module_path", None) or getattr(task, "name", None) or repr(task))


@dataclass(frozen=True)
class TaskArguments:
    """What a task job passes to its task: always ``slot=``; ``data=`` where the task takes it."""

    data: bool  # pass data=

    def kwargs(self, slot: int, data: Any) -> dict[str, Any]:
        return {"slot": slot, "data": data} if self.data else {"slot": slot}


def task_arguments(task: Any, *, job_has_data: bool) -> TaskArguments:
    """Check that ``task``'s function can take ``slot=`` (and ``data=``); raise ``ValueError`` saying why not.

    ``data=`` is passed when the function has a parameter named ``data``, or
    takes ``**kwargs`` and the job declares data. Declared data that the task
    cannot take is an error rather than something dropped.
    """
    func = getattr(task, "func", None)
    try:
        signature = inspect.signature(func) if func is not None else None
    except (TypeError, ValueError):
        signature = None
    if signature is None:
        return TaskArguments(data=job_has_data)
    params = signature.parameters
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named_data = "data" in params and params["data"].kind is not inspect.Parameter.POSITIONAL_ONLY
    data = named_data or (var_keyword and job_has_data)
    if job_has_data and not data:
        raise ValueError(
            f"the job declares data but its task {task_name(task)} takes no 'data' argument; "
            "add a 'data' parameter to the task's function or drop the job's data"
        )
    positional = [object()] if getattr(task, "takes_context", False) else []
    try:
        signature.bind(*positional, **TaskArguments(data=data).kwargs(0, None))
    except TypeError as error:
        what = "slot=<ms since the epoch>" + (", data=<the run's data>" if data else "")
        raise ValueError(
            f"the task {task_name(task)} cannot be called with {what} ({error}); a task job passes the slot as "
            "the keyword argument 'slot' (its idempotency key), so its function must accept it"
        ) from None
    return TaskArguments(data=data)


@dataclass(frozen=True)
class Enqueued:
    """A task enqueued for a run: the task result's id and its backend's alias."""

    result_id: str
    backend: str


def enqueue(task: Any, arguments: TaskArguments, slot: int, data: Any) -> Enqueued:
    """Enqueue ``task`` for one run; raise what the backend raised.

    A backend that runs the task at once (the immediate backend) reports a task
    that raised as a failed result: that is raised here as :class:`TaskFailed`,
    so the run is recorded ``failed`` with the task's error.
    """
    result = task.enqueue(**arguments.kwargs(slot, data))
    status = str(getattr(result, "status", ""))
    if status.upper().endswith("FAILED"):
        errors = list(getattr(result, "errors", None) or [])
        last = errors[-1] if errors else None
        raise TaskFailed(
            task_name(task),
            getattr(last, "exception_class_path", "") or "",
            getattr(last, "traceback", "") or "",
        )
    return Enqueued(result_id=str(result.id), backend=str(getattr(result, "backend", "") or ""))


def result_model(backend: Any) -> Any:
    """The model a database task backend (or a subclass of one) stores its results in, or None.

    django-tasks-db keeps them in ``django_tasks_db.models.DBTaskResult``, django-tasks 0.11 in
    ``django_tasks.backends.database.models.DBTaskResult``: the ``models`` module next to the
    backend's class.
    """
    for cls in type(backend).__mro__:
        module = cls.__module__
        if module.startswith(("builtins", "django.tasks.", "django_tasks.backends.base")):
            continue
        package = module.rsplit(".", 1)[0] if "." in module else module
        try:
            models = import_module(f"{package}.models")
        except ImportError:
            continue
        model = getattr(models, "DBTaskResult", None)
        if model is not None:
            return model
    return None


def backend_of(task: Any) -> Any:
    """The backend ``task`` enqueues to; raises the framework's error for an unknown alias."""
    return task.get_backend()


def is_dummy(backend: Any) -> bool:
    return type(backend).__name__ == "DummyBackend"


def runs_at_once(backend: Any) -> bool:
    return type(backend).__name__ == "ImmediateBackend"


__all__ = [
    "INSTALL_HINT",
    "Enqueued",
    "TaskArguments",
    "backend_of",
    "enqueue",
    "is_dummy",
    "is_task",
    "result_model",
    "runs_at_once",
    "task_arguments",
    "task_classes",
    "task_name",
]
