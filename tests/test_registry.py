"""Declaring jobs: every() / cron(), handlers, options, and errors raised at declaration time.

Every test uses a fresh ``Scheduler()``, never the process-wide default one.
"""

from __future__ import annotations

import functools
import importlib
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

import django_anarchon
from django_anarchon import (
    AnarchonError,
    Context,
    DuplicateJobError,
    JobDeclarationError,
    Scheduler,
    UnknownJobError,
)
from django_anarchon.registry import CATCH_UP_CHOICES, MAX_NAME_LENGTH, OVERLAP_CHOICES, UNSET, Job, Registry
from django_anarchon.schedules import CronSchedule, IntervalSchedule


@pytest.fixture
def sched() -> Scheduler:
    return Scheduler()


def handler(ctx: Context) -> None:
    """A plain handler."""


async def async_handler(ctx: Context) -> None:
    """An async handler."""


def declaration_error(call: Callable[[], Any], *fragments: str) -> JobDeclarationError:
    """Run ``call``, expect a JobDeclarationError and check that its message holds every fragment."""
    with pytest.raises(JobDeclarationError) as caught:
        call()
    error = caught.value
    assert isinstance(error, ValueError)
    assert isinstance(error, AnarchonError)
    for fragment in fragments:
        assert fragment in str(error), f"{fragment!r} not in {str(error)!r}"
    return error


# -- the two forms ---------------------------------------------------------------------------


def test_every_direct_form(sched: Scheduler) -> None:
    returned = sched.every("sync", "10s", handler)
    assert returned is handler
    job = sched.job("sync")
    assert isinstance(job, Job)
    assert job.name == "sync"
    assert job.handler is handler
    assert job.schedule == IntervalSchedule(10_000)
    assert job.schedule.describe() == "every 10s"
    assert job.is_async is False
    assert (job.timeout_ms, job.overlap, job.catch_up) == (None, "skip", "latest")
    assert job.data is UNSET and not job.has_data
    assert job.origin.startswith("tests.test_registry.handler:")
    assert sched.jobs == [job]
    assert "sync" in sched.registry and len(sched.registry) == 1


def test_every_decorator_returns_the_function_unchanged(sched: Scheduler) -> None:
    @sched.every("export", "10m", timeout="15m", overlap="allow", catch_up="all", data={"bucket": "exports"})
    def export(ctx: Context) -> str:
        return "exported"

    assert export.__name__ == "export"
    assert export(None) == "exported"  # type: ignore[arg-type]
    job = sched.job("export")
    assert job.handler is export
    assert job.schedule == IntervalSchedule(600_000)
    assert job.timeout_ms == 900_000
    assert (job.overlap, job.catch_up) == ("allow", "all")
    assert job.data == {"bucket": "exports"} and job.has_data


def test_cron_direct_and_decorator_forms(sched: Scheduler) -> None:
    assert sched.cron("nightly", "30 2 * * *", handler, timezone="Europe/Paris") is handler

    @sched.cron("monthly-invoices", "0 6 1 * *", timezone="Europe/Paris", timeout="15m")
    async def monthly_invoices(ctx: Context) -> None:
        pass

    nightly, invoices = sched.job("nightly"), sched.job("monthly-invoices")
    assert isinstance(nightly.schedule, CronSchedule)
    assert nightly.schedule.describe() == "cron 30 2 * * * (Europe/Paris)"
    assert invoices.handler is monthly_invoices
    assert invoices.is_async is True
    assert invoices.timeout_ms == 900_000
    assert [job.name for job in sched.jobs] == ["nightly", "monthly-invoices"]


def test_cron_timezone_defaults_to_time_zone(sched: Scheduler) -> None:
    with override_settings(TIME_ZONE="America/New_York"):
        sched.cron("ny", "0 9 * * *", handler)
    sched.cron("utc", "0 9 * * *", handler)
    assert sched.job("ny").schedule.describe() == "cron 0 9 * * * (America/New_York)"
    assert sched.job("utc").schedule.describe() == "cron 0 9 * * * (UTC)"
    sched.cron("none", "0 9 * * *", handler, timezone=None)
    assert sched.job("none").schedule.describe() == "cron 0 9 * * * (UTC)"


def test_cron_aliases_and_seconds(sched: Scheduler) -> None:
    for alias in ("@hourly", "@daily", "@midnight", "@weekly", "@monthly", "@yearly", "@annually"):
        sched.cron(f"alias{alias}", alias, handler)
    sched.cron("seconds", "*/15 * * * * 30", handler)
    assert len(sched.registry) == 8


@pytest.mark.parametrize("interval", ["500ms", "10s", "5m", "1h", "1d", "1h30m", 30, 0.5, timedelta(minutes=2)])
def test_every_accepts_every_interval_form(sched: Scheduler, interval: object) -> None:
    sched.every("job", interval, handler)
    assert isinstance(sched.job("job").schedule, IntervalSchedule)


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [("15m", 900_000), (90, 90_000), (1.5, 1_500), (timedelta(seconds=3), 3_000), (None, None)],
)
def test_timeout_forms(sched: Scheduler, timeout: object, expected: int | None) -> None:
    sched.every("job", "1m", handler, timeout=timeout)
    assert sched.job("job").timeout_ms == expected


@pytest.mark.parametrize("overlap", OVERLAP_CHOICES)
@pytest.mark.parametrize("catch_up", CATCH_UP_CHOICES)
def test_every_overlap_and_catch_up_choice_is_accepted(sched: Scheduler, overlap: str, catch_up: str) -> None:
    sched.cron("job", "@hourly", handler, overlap=overlap, catch_up=catch_up)
    assert (sched.job("job").overlap, sched.job("job").catch_up) == (overlap, catch_up)


def test_unknown_job(sched: Scheduler) -> None:
    sched.every("known", "1m", handler)
    with pytest.raises(UnknownJobError, match="'unknown'.*'known'") as caught:
        sched.job("unknown")
    assert isinstance(caught.value, LookupError) and isinstance(caught.value, AnarchonError)
    with pytest.raises(UnknownJobError, match="No jobs are declared"):
        Scheduler().job("anything")


def test_an_unknown_job_names_the_jobs_modules_that_failed_to_load(sched: Scheduler) -> None:
    """With the checks skipped (--skip-checks), a broken jobs.py registers none of its jobs: say so."""
    sched.registry.errors.append(("billing.jobs", JobDeclarationError("sync", "bad interval: '10x'")))
    with pytest.raises(UnknownJobError) as caught:
        sched.job("sync")
    message = str(caught.value)
    assert "No jobs are declared. These jobs modules declare a bad job" in message, message
    assert "billing.jobs (Job 'sync': bad interval: '10x')" in message
    assert "INSTALLED_APPS" not in message


# -- handlers ---------------------------------------------------------------------------------


class AsyncCallable:
    async def __call__(self, ctx: Context) -> None:
        pass


class SyncCallable:
    def __call__(self, ctx: Context) -> None:
        pass


class Service:
    def run(self, ctx: Context) -> None:
        pass

    async def arun(self, ctx: Context) -> None:
        pass


def two_args(ctx: Context, other: int) -> None:
    pass


async def async_two_args(ctx: Context, other: int) -> None:
    pass


@pytest.mark.parametrize(
    ("make", "is_async"),
    [
        (lambda: handler, False),
        (lambda: async_handler, True),
        (lambda: lambda ctx: None, False),
        (lambda: functools.partial(two_args, other=1), False),
        (lambda: functools.partial(async_two_args, other=1), True),
        (lambda: functools.partial(functools.partial(async_two_args), other=1), True),
        (lambda: AsyncCallable(), True),
        (lambda: SyncCallable(), False),
        (lambda: Service().run, False),
        (lambda: Service().arun, True),
        (lambda: print, False),
    ],
)
def test_sync_and_async_handlers_are_detected(sched: Scheduler, make: Callable[[], Any], is_async: bool) -> None:
    function = make()
    assert sched.every("job", "1m", function) is function
    assert sched.job("job").is_async is is_async


def test_async_detection_in_the_decorator_form(sched: Scheduler) -> None:
    decorated = sched.cron("a", "@daily")(AsyncCallable())
    assert isinstance(decorated, AsyncCallable)
    assert sched.job("a").is_async is True


def test_optional_extra_parameters_are_fine(sched: Scheduler) -> None:
    def with_default(ctx: Context, retries: int = 3) -> None:
        pass

    def variadic(*args: Any, **kwargs: Any) -> None:
        pass

    sched.every("a", "1m", with_default)
    sched.every("b", "1m", variadic)
    assert len(sched.registry) == 2


@pytest.mark.parametrize(
    "bad",
    [
        lambda: None,
        two_args,
        async_two_args,
        functools.partial(two_args, 1, 2),
        lambda ctx, other: None,
    ],
)
def test_handler_that_cannot_take_one_argument(sched: Scheduler, bad: Callable[..., Any]) -> None:
    declaration_error(lambda: sched.every("job", "1m", bad), "Job 'job'", "exactly one argument")
    assert "job" not in sched.registry


def test_keyword_only_parameter_without_default_is_rejected(sched: Scheduler) -> None:
    def keyword_only(ctx: Context, *, other: int) -> None:
        pass

    error = declaration_error(lambda: sched.cron("job", "@daily", keyword_only), "exactly one argument")
    assert "keyword_only" in str(error)


@pytest.mark.parametrize("bad", [42, "handler", ["not", "callable"], {"a": 1}])
def test_non_callable_handler(sched: Scheduler, bad: object) -> None:
    declaration_error(lambda: sched.every("job", "1m", bad), "Job 'job'", "must be a function", repr(bad))
    # handler=None means "return a decorator"; applying that decorator to a non-callable fails too.
    decorator = sched.cron("job", "@daily")
    declaration_error(lambda: decorator(bad), "Job 'job'", "must be a function", repr(bad))
    assert len(sched.registry) == 0


def _generator(ctx: Context) -> Any:
    yield ctx.slot


async def _async_generator(ctx: Context) -> Any:
    yield ctx.slot


class _YieldingCall:
    def __call__(self, ctx: Context) -> Any:
        yield ctx.slot


@pytest.mark.parametrize(
    "bad", [_generator, _async_generator, functools.partial(_generator), _YieldingCall()], ids=repr
)
def test_a_generator_handler_is_refused_since_calling_it_runs_none_of_its_body(sched: Scheduler, bad: Any) -> None:
    """Called, a generator function returns a generator and runs nothing: every run was recorded
    ``success`` with the handler's body never run (helper 28)."""
    declaration_error(lambda: sched.every("job", "1m", bad), "Job 'job'", "generator function", "'yield'")
    declaration_error(lambda: sched.cron("job", "@daily")(bad), "Job 'job'", "generator function")
    assert len(sched.registry) == 0


# -- bad declarations: each names the job and the value and says what is valid ------------------


@pytest.mark.parametrize(
    ("interval", "fragments"),
    [
        ("10 parsecs", ["'10 parsecs'", "bad interval", "'500ms'", "timedelta"]),
        ("1m1h", ["'1m1h'", "largest first"]),
        ("", ["''", "empty"]),
        (0, ["0", "not positive"]),
        (-5, ["-5", "not positive"]),
        ("inf", ["'inf'", "not a duration"]),
        (float("nan"), ["nan", "not a duration"]),
        (True, ["True", "not a duration"]),
        (None, ["None", "not a duration"]),
        ("0.5ms", ["'0.5ms'", "whole number of milliseconds"]),
        ("5000000d", ["'5000000d'", "longer than the longest duration, 36500d"]),  # slots past the year 9999
    ],
)
def test_bad_interval(sched: Scheduler, interval: object, fragments: list[str]) -> None:
    declaration_error(lambda: sched.every("sync", interval, handler), "Job 'sync'", *fragments)
    declaration_error(lambda: sched.every("sync", interval), "Job 'sync'", *fragments)
    assert len(sched.registry) == 0


@pytest.mark.parametrize(
    ("expression", "fragments"),
    [
        ("61 * * * *", ["'61 * * * *'", "not a valid cron expression", "five fields"]),
        ("* * * * * * *", ["7 field(s)", "optional sixth field for seconds"]),
        ("* * * *", ["4 field(s)"]),
        ("@reboot", ["'@reboot'", "not a known cron alias", "@hourly"]),
        ("0 0 30 2 *", ["'0 0 30 2 *'", "never fires"]),
        ("", ["''"]),
        (5, ["5 is not a string"]),
        (None, ["None is not a string"]),
    ],
)
def test_bad_cron(sched: Scheduler, expression: object, fragments: list[str]) -> None:
    declaration_error(lambda: sched.cron("nightly", expression, handler), "Job 'nightly'", "bad cron", *fragments)
    declaration_error(lambda: sched.cron("nightly", expression), "Job 'nightly'", "bad cron", *fragments)


@pytest.mark.parametrize("zone", ["Mars/Olympus", "Europe/Pariss", "", "utc+2", 5, timezone.utc])
def test_unknown_timezone(sched: Scheduler, zone: object) -> None:
    error = declaration_error(
        lambda: sched.cron("nightly", "30 2 * * *", handler, timezone=zone), "Job 'nightly'", "bad timezone", repr(zone)
    )
    assert "IANA name such as 'Europe/Paris'" in str(error)
    assert len(sched.registry) == 0


def test_duplicate_name_names_both_places(sched: Scheduler) -> None:
    sched.every("sync", "10s", handler)

    def other_sync(ctx: Context) -> None:
        pass

    with pytest.raises(DuplicateJobError) as caught:
        sched.cron("sync", "@daily", other_sync)
    error = caught.value
    assert isinstance(error, JobDeclarationError) and isinstance(error, ValueError)
    message = str(error)
    assert "Job 'sync'" in message
    assert "tests.test_registry.handler:" in message
    assert "other_sync" in message
    assert "must be unique" in message
    assert sched.job("sync").handler is handler  # the first declaration stays

    # The decorator form fails the same way, when it is applied.
    decorator = sched.every("sync", "1m")
    with pytest.raises(DuplicateJobError, match="tests.test_registry.handler"):
        decorator(other_sync)


def test_the_same_handler_declared_twice_is_told_as_such(sched: Scheduler) -> None:
    sched.every("sync", "10s", handler)
    with pytest.raises(DuplicateJobError) as caught:
        sched.every("sync", "10s", handler)
    message = str(caught.value)
    assert "declared twice for the same handler, tests.test_registry.handler:" in message, message
    assert "imported under two names" in message and "must be unique" in message


def test_same_name_in_two_schedulers_is_fine() -> None:
    first, second = Scheduler(), Scheduler()
    first.every("sync", "10s", handler)
    second.every("sync", "10s", handler)
    assert first.job("sync") is not second.job("sync")


@pytest.mark.parametrize("option", ["retries", "tz", "time_zone", "catchup"])
def test_unknown_option(sched: Scheduler, option: str) -> None:
    declaration_error(
        lambda: sched.every("sync", "10s", handler, **{option: 1}),
        "Job 'sync'",
        f"unknown option(s) '{option}'",
        "valid options are timeout, overlap, catch_up, data",
    )
    declaration_error(lambda: sched.cron("nightly", "@daily", **{option: 1}), "Job 'nightly'", repr(option))


def test_timezone_given_to_every(sched: Scheduler) -> None:
    declaration_error(
        lambda: sched.every("sync", "10s", handler, timezone="Europe/Paris"),
        "Job 'sync'",
        "the option 'timezone' is for cron jobs",
        "aligned to the Unix epoch",
    )


def test_an_unknown_option_close_to_a_valid_one_gets_a_suggestion(sched: Scheduler) -> None:
    declaration_error(
        lambda: sched.every("sync", "10s", handler, timout="5m"),
        "Job 'sync'",
        "unknown option(s) 'timout' (did you mean 'timeout'?)",
    )
    declaration_error(
        lambda: sched.cron("nightly", "@daily", handler, timezon="UTC", colour=1),
        "unknown option(s) 'colour', 'timezon' (did you mean 'timezone'?)",
    )


def test_a_value_that_is_not_json_is_named_where_it_sits_in_the_data(sched: Scheduler) -> None:
    from datetime import date

    declaration_error(
        lambda: sched.every("sync", "10s", handler, data={"period": {"start": date(2027, 1, 1)}}),
        "the date datetime.date(2027, 1, 1) at ['period']['start'] is not JSON",
    )


@pytest.mark.parametrize("overlap", ["nope", "SKIP", "", None, ["skip"], True])
def test_bad_overlap(sched: Scheduler, overlap: object) -> None:
    declaration_error(
        lambda: sched.every("sync", "10s", handler, overlap=overlap),
        "Job 'sync'",
        f"bad overlap {overlap!r}",
        "'skip', 'allow', 'queue', 'replace'",
    )


@pytest.mark.parametrize("catch_up", ["some", "ALL", None, 1, False])
def test_bad_catch_up(sched: Scheduler, catch_up: object) -> None:
    declaration_error(
        lambda: sched.cron("nightly", "@daily", handler, catch_up=catch_up),
        "Job 'nightly'",
        f"bad catch_up {catch_up!r}",
        "'latest', 'all', 'none'",
    )


@pytest.mark.parametrize("timeout", ["0s", 0, -1, "soon", False, "inf", [5]])
def test_bad_timeout(sched: Scheduler, timeout: object) -> None:
    declaration_error(
        lambda: sched.every("sync", "10s", handler, timeout=timeout), "Job 'sync'", "bad timeout", repr(timeout)
    )


@pytest.mark.parametrize(
    "data",
    [
        {1, 2},
        {"when": datetime(2024, 1, 1)},
        object(),
        float("nan"),
        {"ratio": float("inf")},
        [b"bytes"],
    ],
)
def test_data_that_is_not_json(sched: Scheduler, data: object) -> None:
    error = declaration_error(
        lambda: sched.every("sync", "10s", handler, data=data), "Job 'sync'", "JSON-serialisable", "dicts, lists"
    )
    assert repr(data)[:50] in str(error)
    declaration_error(lambda: sched.cron("nightly", "@daily", data=data), "Job 'nightly'", "JSON-serialisable")


def test_self_referencing_data_is_rejected(sched: Scheduler) -> None:
    loop: list[Any] = []
    loop.append(loop)
    declaration_error(lambda: sched.every("sync", "10s", handler, data=loop), "Job 'sync'", "JSON-serialisable")


@pytest.mark.parametrize("data", [{"path": "caf\udce9.txt"}, ["\ud800"], {"\udfff": 1}])
def test_data_with_a_lone_surrogate_is_refused_where_it_is_given(sched: Scheduler, data: object) -> None:
    """Valid for json.dumps, refused by the databases (PostgreSQL: a DataError in the loop's claim, no job ran)."""
    error = declaration_error(lambda: sched.every("sync", "10s", handler, data=data), "Job 'sync'", "lone surrogate")
    assert "errors='replace'" in str(error)


@pytest.mark.parametrize(
    "data", [None, 0, "", [], {}, {"ville": "Zürich", "emoji": "✓", "astral": "\U0001f600"}, [1, 2.5, True, None]]
)
def test_json_data_is_kept(sched: Scheduler, data: object) -> None:
    sched.every("sync", "10s", handler, data=data)
    job = sched.job("sync")
    assert job.has_data
    assert job.data == data


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("", "must not be empty"),
        ("   ", "must not be empty"),
        (" sync", "start or end with whitespace"),
        ("sync ", "start or end with whitespace"),
        ("sync\n", "start or end with whitespace"),
        ("a" * (MAX_NAME_LENGTH + 1), f"longer than {MAX_NAME_LENGTH} characters"),
        ("sync\tjob", "control characters"),
        ("sync\x00", "control characters"),
        ("sync\x1bjob", "control characters"),
        ("sync\u200bjob", "control characters"),
        (None, "must be a string"),
        (42, "must be a string"),
        (b"sync", "must be a string"),
    ],
)
def test_bad_names(sched: Scheduler, name: object, fragment: str) -> None:
    error = declaration_error(lambda: sched.every(name, "10s", handler), fragment)  # type: ignore[arg-type]
    if isinstance(name, str):
        shown = name if len(name) <= MAX_NAME_LENGTH else name[:40]
        assert repr(shown).rstrip("'") in str(error)
    else:
        assert repr(name) in str(error)
    declaration_error(lambda: sched.cron(name, "@daily"), fragment)  # type: ignore[arg-type]
    assert len(sched.registry) == 0


def test_names_up_to_the_limit_and_non_ascii_are_accepted(sched: Scheduler) -> None:
    sched.every("a" * MAX_NAME_LENGTH, "10s", handler)
    sched.every("nettoyage-été", "1h", handler, data={"ville": "Zürich", "emoji": "✓"})
    sched.cron("月次レポート", "0 6 1 * *", handler, timezone="Asia/Tokyo")
    assert sched.job("nettoyage-été").data == {"ville": "Zürich", "emoji": "✓"}
    assert sched.registry.names() == ["a" * MAX_NAME_LENGTH, "nettoyage-été", "月次レポート"]


def test_a_bad_decorator_fails_before_the_function_is_defined(sched: Scheduler) -> None:
    defined = []
    with pytest.raises(JobDeclarationError, match="10 parsecs"):

        @sched.every("sync", "10 parsecs")
        def sync(ctx: Context) -> None:  # pragma: no cover - never reached
            pass

        defined.append(sync)
    # The decorator call itself raised: nothing was defined, decorated or registered.
    assert defined == []
    assert len(sched.registry) == 0
    with pytest.raises(JobDeclarationError, match="retries"):
        sched.cron("nightly", "@daily", retries=3)
    with pytest.raises(JobDeclarationError, match="Mars/Olympus"):
        sched.cron("nightly", "@daily", timezone="Mars/Olympus")


def test_a_failed_declaration_registers_nothing(sched: Scheduler) -> None:
    sched.every("kept", "10s", handler)
    for call in (
        lambda: sched.every("bad", "10s", handler, overlap="nope"),
        lambda: sched.every("bad", "nope", handler),
        lambda: sched.cron("bad", "@daily", handler, data={1, 2}),
    ):
        with pytest.raises(JobDeclarationError):
            call()
    assert sched.registry.names() == ["kept"]


def test_registry_remove_and_iteration_is_a_snapshot() -> None:
    registry = Registry()
    scheduler = Scheduler()
    scheduler.registry = registry
    scheduler.every("a", "1m", handler)
    scheduler.every("b", "1m", handler)
    for job in registry:  # removing while iterating is safe
        registry.remove(job.name)
    assert len(registry) == 0
    registry.remove("never-declared")


# -- discovery of jobs modules ----------------------------------------------------------------


@pytest.fixture
def jobs_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sched: Scheduler) -> Iterator[Callable[[str], str]]:
    """Write a module into ``tests.testapp`` (through a temporary path entry) that declares on ``sched``.

    The module does what a real ``jobs.py`` does: ``from django_anarchon import scheduler``;
    the test points that name at its fresh scheduler.
    """
    import tests.testapp

    monkeypatch.setattr(tests.testapp, "__path__", [*tests.testapp.__path__, str(tmp_path)])
    monkeypatch.setattr(django_anarchon, "scheduler", sched)
    monkeypatch.setattr(sys.modules["django_anarchon.scheduler"], "scheduler", sched)
    names: list[str] = []

    def write(body: str) -> str:
        name = f"anarchon_fixture_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text("from django_anarchon import scheduler\n\n" + body)
        importlib.invalidate_caches()
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(f"tests.testapp.{name}", None)


def test_discover_imports_the_module_of_every_app(sched: Scheduler, jobs_module: Callable[[str], str]) -> None:
    name = jobs_module(
        'scheduler.every("found-a", "10s", lambda ctx: None)\nscheduler.cron("found-b", "@daily", print)\n'
    )
    sched.registry.discover(name)
    assert sched.registry.names() == ["found-a", "found-b"]
    assert sched.registry.errors == []


def test_discover_rolls_back_a_module_with_a_bad_job(sched: Scheduler, jobs_module: Callable[[str], str]) -> None:
    sched.every("declared-before", "1m", handler)
    name = jobs_module(
        'scheduler.every("half-a", "10s", lambda ctx: None)\n'
        'scheduler.every("half-b", "10 parsecs", lambda ctx: None)\n'
        'scheduler.every("never-reached", "10s", lambda ctx: None)\n'
    )
    sched.registry.discover(name)
    # None of the module's jobs stay half-registered; earlier declarations are untouched.
    assert sched.registry.names() == ["declared-before"]
    [(module, error)] = sched.registry.errors
    assert module == f"tests.testapp.{name}"
    assert isinstance(error, JobDeclarationError)
    assert "half-b" in str(error) and "10 parsecs" in str(error)


def test_discover_rolls_back_a_duplicate(sched: Scheduler, jobs_module: Callable[[str], str]) -> None:
    sched.every("sync", "1m", handler)
    name = jobs_module('scheduler.every("fresh", "10s", print)\nscheduler.every("sync", "10s", print)\n')
    sched.registry.discover(name)
    assert sched.registry.names() == ["sync"]
    [(_, error)] = sched.registry.errors
    assert isinstance(error, DuplicateJobError)


def test_discover_lets_other_errors_propagate(sched: Scheduler, jobs_module: Callable[[str], str]) -> None:
    name = jobs_module('raise RuntimeError("broken jobs module")\n')
    with pytest.raises(RuntimeError, match="broken jobs module"):
        sched.registry.discover(name)
    name = jobs_module("import a_module_that_does_not_exist_anywhere\n")
    with pytest.raises(ModuleNotFoundError, match="a_module_that_does_not_exist_anywhere"):
        sched.registry.discover(name)
    assert sched.registry.errors == []


def test_discover_without_any_such_module_does_nothing(sched: Scheduler) -> None:
    sched.registry.discover("no_app_has_this_module")
    assert len(sched.registry) == 0 and sched.registry.errors == []
