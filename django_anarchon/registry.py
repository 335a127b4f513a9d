"""Job declarations: ``every()`` / ``cron()``, validated when they are made."""

from __future__ import annotations

import difflib
import functools
import inspect
import threading
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from .conf import check_json
from .durations import VALID_FORMS, parse_duration_ms
from .exceptions import DataNotSerializableError, DuplicateJobError, JobDeclarationError, UnknownJobError
from .schedules import IntervalSchedule, Schedule, cron_schedule, load_timezone
from .taskjobs import INSTALL_HINT, TaskArguments, is_task, task_arguments, task_classes, task_name

OVERLAP_CHOICES = ("skip", "allow", "queue", "replace")
CATCH_UP_CHOICES = ("latest", "all", "none")
OPTIONS = ("timeout", "overlap", "catch_up", "data", "alert_after", "timezone", "task")
MAX_NAME_LENGTH = 200

F = TypeVar("F", bound=Callable[..., Any])


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class Job:
    """One declared job: what to run, when, and how runs may overlap."""

    name: str
    schedule: Schedule
    handler: Callable[..., Any]
    is_async: bool
    timeout_ms: int | None
    overlap: str
    catch_up: str
    data: Any
    origin: str
    alert_after_ms: int | None = None  # job_overdue after this long without a success
    task: Any = None  # a task job's django.tasks task: its runs enqueue it (see taskjobs)
    task_arguments: TaskArguments | None = None  # what a task job passes to its task

    @property
    def has_data(self) -> bool:
        return self.data is not UNSET

    def timeout_error(self) -> TimeoutError:
        """What a run past ``timeout`` is recorded failed with (and its signal aborts with)."""
        return TimeoutError(f"Job {self.name!r} ran past its timeout of {(self.timeout_ms or 0) / 1000:g}s")

    @property
    def is_task_job(self) -> bool:
        return self.task is not None

    def refuse_data_for_dataless_task(self, data: Any, caller: str) -> None:
        """Raise if ``data`` is given to a task job whose task takes none (it would be dropped silently)."""
        if data is not None and self.task_arguments is not None and not self.task_arguments.data:
            raise JobDeclarationError(
                self.name,
                f"its task {self.origin} takes no 'data' argument, so {caller}() cannot pass data={data!r}; "
                f"add a 'data' parameter to the task's function, or call {caller}() without data",
            )


def _origin(handler: Any) -> str:
    code = getattr(handler, "__code__", None)
    module = getattr(handler, "__module__", None) or "?"
    qualname = getattr(handler, "__qualname__", None) or repr(handler)
    line = f":{code.co_firstlineno}" if code is not None else ""
    return f"{module}.{qualname}{line}"


def _is_async(handler: Callable[..., Any]) -> bool:
    return _any_form(handler, inspect.iscoroutinefunction)


def _is_generator(handler: Callable[..., Any]) -> bool:
    """A ``def`` or ``async def`` with ``yield``: calling it runs none of its body."""
    return _any_form(handler, inspect.isgeneratorfunction) or _any_form(handler, inspect.isasyncgenfunction)


def returned_generator(job_name: str, result: object) -> TypeError | None:
    """The error for a handler that *returned* a generator (a lambda around a generator function).

    Its body never ran, and calling the run a success would hide that; generator functions
    themselves are refused when declared.
    """
    if inspect.isgenerator(result) or inspect.isasyncgen(result):
        return TypeError(
            f"the handler of job {job_name!r} returned a generator, so none of its body ran; "
            "a handler must do its work when called (a plain def or async def, no 'yield')"
        )
    return None


def _any_form(handler: Callable[..., Any], test: Callable[[Any], bool]) -> bool:
    """``test`` on the handler, the function of a ``functools.partial``, or a callable object's ``__call__``."""
    if test(handler):
        return True
    if isinstance(handler, functools.partial) and test(handler.func):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - callable objects
    return call is not None and test(call)


def validate_name(name: object) -> str:
    if not isinstance(name, str):
        raise JobDeclarationError(None, f"the job name must be a string, got {name!r}")
    if not name.strip() or name != name.strip():
        raise JobDeclarationError(name, "the job name must not be empty or start or end with whitespace")
    if len(name) > MAX_NAME_LENGTH:
        raise JobDeclarationError(name[:40] + "…", f"the job name is longer than {MAX_NAME_LENGTH} characters")
    if any(unicodedata.category(c).startswith("C") for c in name):
        raise JobDeclarationError(name, "the job name must not contain control characters")
    return name


class Registry:
    """The jobs a scheduler knows, by name. Thread-safe for declaration."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        # Declaration errors found while discovering jobs.py modules: (module, error).
        self.errors: list[tuple[str, JobDeclarationError]] = []
        # While a jobs.py is imported by discover(): its bad declarations, collected instead of raised.
        self._collected: list[JobDeclarationError] | None = None

    def collect(self, error: JobDeclarationError) -> bool:
        """Keep ``error`` for :meth:`discover` (True) if a ``jobs`` module is being discovered; else False."""
        if self._collected is None:
            return False
        self._collected.append(error)
        return True

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs.values()))

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, name: object) -> bool:
        return name in self._jobs

    def get(self, name: str) -> Job:
        try:
            return self._jobs[name]
        except KeyError:
            unloaded = [f"{module} ({error})" for module, error in self.errors]
            raise UnknownJobError(name, list(self._jobs), unloaded) from None

    def names(self) -> list[str]:
        return list(self._jobs)

    def add(self, job: Job) -> None:
        with self._lock:
            existing = self._jobs.get(job.name)
            if existing is not None:
                raise DuplicateJobError(job.name, existing.origin, job.origin)
            self._jobs[job.name] = job

    def remove(self, name: str) -> None:
        with self._lock:
            self._jobs.pop(name, None)

    def discover(self, module_name: str = "jobs") -> None:
        """Import every installed app's ``jobs`` module, like the admin's autodiscover.

        Every bad declaration of a module is collected rather than raised, so
        that the system check ``anarchon.E005`` reports each of them (a module
        that raises :class:`JobDeclarationError` itself counts too); such a
        module is rolled back as a whole (none of its jobs stay
        half-registered), its errors are kept in :attr:`errors`, and
        :meth:`Scheduler.start` refuses to start. Any other error in a
        ``jobs.py`` propagates unchanged.
        """
        from importlib import import_module

        from django.apps import apps
        from django.utils.module_loading import module_has_submodule

        for app_config in apps.get_app_configs():
            if not module_has_submodule(app_config.module, module_name):
                continue
            path = f"{app_config.name}.{module_name}"
            with self._lock:
                before = dict(self._jobs)
            self._collected = []
            try:
                import_module(path)
            except JobDeclarationError as error:
                self._collected.append(error)
            finally:
                found, self._collected = self._collected, None
            if found:
                with self._lock:
                    self._jobs = before
                self.errors.extend((path, error) for error in found)


def _default_timezone() -> str:
    from django.conf import settings

    if settings.configured:
        return getattr(settings, "TIME_ZONE", None) or "UTC"
    return "UTC"


def build_job(
    kind: str,
    name: object,
    spec: object,
    handler: Callable[..., Any],
    options: dict[str, Any],
) -> Job:
    """Validate one declaration and return the :class:`Job`; raise :class:`JobDeclarationError`."""
    name = validate_name(name)
    valid = OPTIONS if kind == "cron" else tuple(o for o in OPTIONS if o != "timezone")
    unknown = sorted(set(options) - set(valid))
    if unknown:
        if unknown == ["timezone"]:
            raise JobDeclarationError(
                name, "the option 'timezone' is for cron jobs; interval slots are aligned to the Unix epoch, in UTC"
            )
        hints = [
            f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(str(o), valid, n=1)) else ""
            for o in unknown
        ]
        listed = ", ".join(f"{o!r}{hint}" for o, hint in zip(unknown, hints, strict=True))
        raise JobDeclarationError(name, f"unknown option(s) {listed}; valid options are {', '.join(valid)}")
    task = options.get("task")
    arguments: TaskArguments | None = None  # a task job's: what its task is passed
    if task is not None:
        if handler is not _placeholder and handler is not task:
            raise JobDeclarationError(name, "give either a handler or task=, not both")
        handler = task
    if task is not None or is_task(handler):
        if not task_classes():
            raise JobDeclarationError(name, f"task={task_name(handler)}: {INSTALL_HINT}")
        if not is_task(handler):
            raise JobDeclarationError(
                name, f"task= must be a task (a function decorated with django.tasks' @task), got {handler!r}"
            )
        if options.get("timeout") is not None:
            raise JobDeclarationError(
                name,
                "timeout does not apply to a task job: its run ends once the task is enqueued; "
                "limit the task's own run time in the task or its worker",
            )
        try:
            arguments = task_arguments(handler, job_has_data=options.get("data", UNSET) is not UNSET)
        except ValueError as error:
            raise JobDeclarationError(name, str(error)) from None
    elif not callable(handler):
        raise JobDeclarationError(name, f"the handler must be a function or coroutine function, got {handler!r}")
    elif _is_generator(handler):
        raise JobDeclarationError(
            name,
            f"the handler {_origin(handler)} is a generator function (it contains 'yield'): calling it runs "
            "none of its body, so every run would succeed doing nothing; use a plain def or async def",
        )
    try:
        signature = None if arguments is not None else inspect.signature(handler)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        try:
            signature.bind(object())
        except TypeError:
            raise JobDeclarationError(
                name, f"the handler {_origin(handler)} must accept exactly one argument (the context ctx)"
            ) from None

    schedule: Schedule
    if kind == "interval":
        try:
            schedule = IntervalSchedule(parse_duration_ms(spec))
        except ValueError as error:
            raise JobDeclarationError(name, f"bad interval: {error}") from None
    else:
        # Only a missing (or None) timezone means TIME_ZONE; "" is a bad value like any other.
        tz_name = options.get("timezone")
        if tz_name is None:
            tz_name = _default_timezone()
        try:
            tz = load_timezone(tz_name)
        except ValueError as error:
            raise JobDeclarationError(name, f"bad timezone: {error}") from None
        if not isinstance(spec, str):
            raise JobDeclarationError(name, f"bad cron expression: {spec!r} is not a string")
        try:
            schedule = cron_schedule(spec, tz.key)
        except ValueError as error:
            raise JobDeclarationError(name, f"bad cron expression: {error}") from None

    timeout = options.get("timeout")
    timeout_ms: int | None = None
    if timeout is not None:
        try:
            timeout_ms = parse_duration_ms(timeout)
        except ValueError as error:
            raise JobDeclarationError(name, f"bad timeout: {error}") from None

    alert_after = options.get("alert_after")
    alert_after_ms: int | None = None
    if alert_after is not None:
        try:
            alert_after_ms = parse_duration_ms(alert_after)
        except ValueError as error:
            raise JobDeclarationError(name, f"bad alert_after: {error}") from None

    overlap = options.get("overlap", "skip")
    if overlap not in OVERLAP_CHOICES:
        raise JobDeclarationError(name, f"bad overlap {overlap!r}; use one of {', '.join(map(repr, OVERLAP_CHOICES))}")
    catch_up = options.get("catch_up", "latest")
    if catch_up not in CATCH_UP_CHOICES:
        raise JobDeclarationError(
            name, f"bad catch_up {catch_up!r}; use one of {', '.join(map(repr, CATCH_UP_CHOICES))}"
        )
    data = options.get("data", UNSET)
    if data is not UNSET:
        try:
            check_json(data, "data")
        except DataNotSerializableError as error:
            raise JobDeclarationError(name, str(error)) from None

    task_job = arguments is not None
    return Job(
        name=name,
        schedule=schedule,
        handler=handler,
        is_async=False if task_job else _is_async(handler),
        timeout_ms=timeout_ms,
        alert_after_ms=alert_after_ms,
        overlap=overlap,
        catch_up=catch_up,
        data=data,
        origin=_origin(getattr(handler, "func", handler) if task_job else handler),
        task=handler if task_job else None,
        task_arguments=arguments,
    )


class Declarations:
    """The ``every()`` / ``cron()`` half of a scheduler."""

    registry: Registry

    def every(self, name: str, interval: Any, handler: Callable[..., Any] | None = None, **options: Any) -> Any:
        """Run ``handler`` at every multiple of ``interval`` since the Unix epoch.

        ``interval`` is a duration string (``"500ms"``, ``"10s"``, ``"1h30m"``),
        a number of seconds or a ``timedelta``. Without ``handler``, returns a
        decorator. Options: ``timeout``, ``overlap``, ``catch_up``, ``data``, ``alert_after``;
        ``task=`` (a ``django.tasks`` task) instead of a handler makes each run enqueue it.
        """
        return self._declare("interval", name, interval, handler, options)

    def cron(self, name: str, expression: str, handler: Callable[..., Any] | None = None, **options: Any) -> Any:
        """Run ``handler`` on a cron ``expression`` in ``timezone`` (default: ``TIME_ZONE``).

        Five fields, an optional sixth for seconds, or an ``@alias``. Without
        ``handler``, returns a decorator. Options: ``timezone``, ``timeout``,
        ``overlap``, ``catch_up``, ``data``, ``alert_after``; ``task=`` (a
        ``django.tasks`` task) instead of a handler makes each run enqueue it.
        """
        return self._declare("cron", name, expression, handler, options)

    def _declare(
        self, kind: str, name: Any, spec: Any, handler: Callable[..., Any] | None, options: dict[str, Any]
    ) -> Any:
        if handler is None and options.get("task") is not None:
            self._add(kind, name, spec, options["task"], options)
            return options["task"]
        if handler is None:
            # Validate everything but the handler now, so that a bad schedule
            # fails at the decorator line even before the function is defined.
            try:
                build_job(kind, name, spec, _placeholder, options)
            except JobDeclarationError as error:
                if not self.registry.collect(error):
                    raise
                return _unchanged

            def decorator(function: F) -> F:
                self._add(kind, name, spec, function, options)
                return function

            return decorator
        self._add(kind, name, spec, handler, options)
        return handler

    def _add(self, kind: str, name: Any, spec: Any, handler: Callable[..., Any], options: dict[str, Any]) -> None:
        try:
            self.registry.add(build_job(kind, name, spec, handler, options))
        except JobDeclarationError as error:
            if not self.registry.collect(error):
                raise


def _unchanged(function: F) -> F:
    """The decorator of a declaration that was collected as bad: the function stays as it is."""
    return function


def _placeholder(ctx: Any) -> None:  # pragma: no cover - never called
    """Stands in for the handler while a decorator's arguments are checked."""


__all__ = ["Job", "Registry", "Declarations", "OVERLAP_CHOICES", "CATCH_UP_CHOICES", "VALID_FORMS", "UNSET"]
