"""System checks: one test per check id (anarchon.E001 ... W001), plus ``manage.py check`` itself."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.checks import Error, Warning, run_checks
from django.db import connection, connections
from django.test import override_settings

import django_anarchon
from django_anarchon import Scheduler
from django_anarchon.checks import check_jobs, check_mysql_time_zone, check_settings

ROOT = Path(__file__).resolve().parent.parent


def anarchon_ids(messages: list) -> list[str]:
    return sorted(m.id for m in messages if m.id and m.id.startswith("anarchon."))


def test_a_correct_configuration_has_no_anarchon_messages() -> None:
    assert anarchon_ids(run_checks(tags=["anarchon"])) == []
    assert check_settings() == []
    assert check_jobs() == []


# -- E001 ------------------------------------------------------------------------------------


def test_e001_use_tz_false() -> None:
    with override_settings(USE_TZ=False):
        messages = run_checks(tags=["anarchon"])
    [error] = [m for m in messages if m.id == "anarchon.E001"]
    assert isinstance(error, Error)
    assert "USE_TZ" in error.msg and "USE_TZ = True" in error.hint
    assert anarchon_ids(messages) == ["anarchon.E001"]


# -- E002 ------------------------------------------------------------------------------------


@pytest.fixture
def default_connection_with_session_time_zone() -> Iterator[None]:
    """Swap in, for this thread, a new connection to the test database whose session time zone is +02:00."""
    original = connections["default"]
    probe = connections.create_connection("default")
    options = dict(probe.settings_dict.get("OPTIONS", {}))
    options["init_command"] = "SET time_zone='+02:00'"
    probe.settings_dict = {**probe.settings_dict, "OPTIONS": options}
    connections["default"] = probe
    try:
        yield
    finally:
        connections["default"] = original
        probe.close()


@pytest.mark.django_db
def test_e002_mysql_session_time_zone(request: pytest.FixtureRequest) -> None:
    # The test settings set the session time zone to UTC (init_command), so nothing is reported...
    assert check_mysql_time_zone(databases=["default"]) == []
    assert anarchon_ids(run_checks(databases=["default"], tags=["database"])) == []
    # ... and without databases the check does not touch any (like Django's own database checks).
    assert check_mysql_time_zone() == []
    if connection.vendor != "mysql":
        # Only MySQL/MariaDB sessions have their own time zone: other backends never get E002,
        # even when Django asks for the database checks.
        with override_settings(TIME_ZONE="Europe/Paris"):
            assert check_mysql_time_zone(databases=["default"]) == []
        return
    request.getfixturevalue("default_connection_with_session_time_zone")
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT @@session.time_zone")
        assert cursor.fetchone()[0] == "+02:00"
    messages = run_checks(databases=["default"], tags=["database"])
    assert anarchon_ids(messages) == ["anarchon.E002"]
    [error] = check_mysql_time_zone(databases=["default"])
    assert isinstance(error, Error) and error.id == "anarchon.E002"
    assert "'default'" in error.msg and "'+02:00'" in error.msg and "+7200s" in error.msg
    assert "SET time_zone='+00:00'" in error.hint


# -- W004 ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_w004_mysql_without_time_zone_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Helper 38: with TIME_ZONE not UTC and no time zone tables on the server, the admin's run history
    answered 500 on MariaDB, and no check said why."""
    from django_anarchon import checks
    from django_anarchon.dbtime import converts_to

    with override_settings(TIME_ZONE="UTC"):  # the connection's own zone: nothing to convert anywhere
        assert check_mysql_time_zone(databases=["default"]) == []
    with override_settings(TIME_ZONE="Europe/Berlin"):
        converts = converts_to(connection, "Europe/Berlin")
        assert converts or connection.vendor == "mysql", "only MySQL/MariaDB convert times in SQL"
        assert anarchon_ids(check_mysql_time_zone(databases=["default"])) == ([] if converts else ["anarchon.W004"])
        if connection.vendor != "mysql":
            return
        monkeypatch.setattr(checks, "converts_to", lambda connection, zone: False)
        [warning] = check_mysql_time_zone(databases=["default"])
        assert isinstance(warning, Warning) and warning.id == "anarchon.W004"
        assert "'default'" in warning.msg and "'Europe/Berlin'" in warning.msg and "time zone tables" in warning.msg
        assert "mariadb-tzinfo-to-sql /usr/share/zoneinfo" in warning.hint
        with override_settings(USE_TZ=False):  # Django converts nothing then (E001 says what is wrong)
            assert check_mysql_time_zone(databases=["default"]) == []


# -- E003 ------------------------------------------------------------------------------------


def test_e003_lease_shorter_than_three_polls() -> None:
    with override_settings(ANARCHON={"LEASE_TTL": 1, "POLL_INTERVAL": 1}):
        messages = run_checks(tags=["anarchon"])
    assert anarchon_ids(messages) == ["anarchon.E003"]
    [error] = [m for m in messages if m.id == "anarchon.E003"]
    assert "LEASE_TTL (1s)" in error.msg and "three POLL_INTERVALs (3s)" in error.msg
    assert "Raise LEASE_TTL or lower POLL_INTERVAL" in error.hint
    with override_settings(ANARCHON={"LEASE_TTL": 3, "POLL_INTERVAL": 1}):
        assert anarchon_ids(run_checks(tags=["anarchon"])) == []


# -- E004 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"LEASE_TIL": 3}, "Did you mean 'LEASE_TTL'?"),
        ({"LEASE_TTL": 0}, "ANARCHON['LEASE_TTL']"),
        ({"MAX_WORKERS": "4"}, "ANARCHON['MAX_WORKERS']"),
        ({"DATA": {1, 2}}, "JSON-serialisable"),
        ("not a dict", "must be a dict"),
    ],
)
def test_e004_bad_settings(raw: object, fragment: str) -> None:
    with override_settings(ANARCHON=raw):
        messages = run_checks(tags=["anarchon"])
    assert anarchon_ids(messages) == ["anarchon.E004"]  # and no E003 from a half-parsed dict
    [error] = messages
    assert fragment in error.msg


# -- E005 ------------------------------------------------------------------------------------


@pytest.fixture
def default_scheduler(monkeypatch: pytest.MonkeyPatch) -> Scheduler:
    """A fresh scheduler standing in for the process-wide default one (which ``check_jobs`` reads)."""
    fresh = Scheduler()
    monkeypatch.setattr(django_anarchon, "scheduler", fresh)
    monkeypatch.setattr(sys.modules["django_anarchon.scheduler"], "scheduler", fresh)
    return fresh


def test_e005_a_jobs_module_declares_a_bad_job(
    default_scheduler: Scheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tests.testapp

    module = f"anarchon_fixture_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "from django_anarchon import scheduler\n"
        "scheduler.every('good-one', '10s', print)\n"
        "scheduler.cron('bad-one', '0 0 30 2 *', print)\n"
        "@scheduler.every('bad-two', '10 parsecs')\n"
        "def two(ctx): pass\n"
        "@scheduler.every('bad-three', '1s')\n"
        "def three(): pass\n"
        "scheduler.every('good-two', '1m', print)\n"
    )
    importlib.invalidate_caches()
    monkeypatch.setattr(tests.testapp, "__path__", [*tests.testapp.__path__, str(tmp_path)])
    try:
        default_scheduler.registry.discover(module)
    finally:
        sys.modules.pop(f"tests.testapp.{module}", None)

    messages = run_checks(tags=["anarchon"])
    assert anarchon_ids(messages) == ["anarchon.E005"] * 3, "every bad job of the module, each once"
    error, two, three = check_jobs()
    assert "'bad-two'" in two.msg and "'10 parsecs'" in two.msg
    assert "'bad-three'" in three.msg and "exactly one argument" in three.msg
    assert isinstance(error, Error) and error.id == "anarchon.E005"
    assert "'bad-one'" in error.msg and "'0 0 30 2 *'" in error.msg and "never fires" in error.msg
    assert error.obj == f"tests.testapp.{module}"
    assert f"tests.testapp.{module}" in error.hint and "none of its jobs are registered" in error.hint
    assert default_scheduler.registry.names() == []


def test_e005_one_message_per_broken_module(default_scheduler: Scheduler) -> None:
    from django_anarchon import JobDeclarationError

    default_scheduler.registry.errors.extend(
        [
            ("app_one.jobs", JobDeclarationError("a", "bad interval: 'x'")),
            ("app_two.jobs", JobDeclarationError("b", "y")),
        ]
    )
    messages = check_jobs()
    assert [(m.id, m.obj) for m in messages] == [("anarchon.E005", "app_one.jobs"), ("anarchon.E005", "app_two.jobs")]
    assert messages[0].msg == "Job 'a': bad interval: 'x'"


# -- W001 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [":memory:", "file:memorydb_default?mode=memory&cache=shared"])
def test_w001_in_memory_sqlite(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setitem(connections.settings, "scratch", {"ENGINE": "django.db.backends.sqlite3", "NAME": name})
    messages = run_checks(tags=["anarchon"])
    assert anarchon_ids(messages) == ["anarchon.W001"]
    [warning] = messages
    assert isinstance(warning, Warning)
    assert "'scratch'" in warning.msg and "in-memory SQLite" in warning.msg
    assert "Use a file" in warning.hint


def test_w001_not_for_a_file_database(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(
        connections.settings, "scratch", {"ENGINE": "django.db.backends.sqlite3", "NAME": tmp_path / "db.sqlite3"}
    )
    assert anarchon_ids(run_checks(tags=["anarchon"])) == []


# -- manage.py check ---------------------------------------------------------------------------


def manage_check(jobs: list[dict[str, object]], **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "ANARCHON_TEST_JOBS": json.dumps(jobs), **env}
    environment.pop("ANARCHON_TEST_CHILD", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "manage.py"), "check"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_manage_py_check_passes_in_the_test_project() -> None:
    result = manage_check([])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_manage_py_check_reports_a_bad_jobs_module_and_fails() -> None:
    result = manage_check(
        [{"name": "nightly", "cron": "0 0 30 2 *"}], ANARCHON_LEASE_TTL="1", ANARCHON_POLL_INTERVAL="1"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "anarchon.E005" in result.stderr and "'nightly'" in result.stderr
    assert result.stderr.count("'0 0 30 2 *'") == 1, "the message once, not also logged"
    assert "anarchon.E003" in result.stderr
