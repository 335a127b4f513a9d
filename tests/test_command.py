"""`manage.py anarchon` and `manage.py check` as a user runs them (real child processes)."""

from __future__ import annotations

import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from django_anarchon.models import JobState, Run
from tests.conftest import ON_DEMAND, ROOT, Cluster, wait_for
from tests.testapp.models import Execution

pytestmark = [pytest.mark.process, pytest.mark.django_db(transaction=True)]


def test_list_shows_jobs_schedules_next_due_times_and_pauses(cluster: Cluster) -> None:
    cluster.jobs = [
        {"name": "tick", "every": "1h30m", "kind": "record", "timeout": "5m", "alert_after": "3h"},
        {"name": "paris", "cron": "30 2 * * *", "timezone": "Europe/Paris", "kind": "record"},
    ]
    JobState.objects.create(name="paris", paused=True)
    result = cluster.manage("anarchon", "--list")
    assert result.returncode == 0, result.stderr
    tick, paris = result.stdout.splitlines()
    assert tick.startswith("tick") and "every 1h30m" in tick and "timeout=300s" in tick
    assert "alert_after=10800s" in tick
    assert "cron 30 2 * * * (Europe/Paris)" in paris and "PAUSED" in paris
    assert ("CET" in paris or "CEST" in paris) and ":30:00" in paris
    assert tick.index("next ") == paris.index("next "), "the columns line up, however long a schedule"


def test_list_shows_next_due_times_by_the_database_clock_on_a_host_whose_clock_is_off(cluster: Cluster) -> None:
    """Slots follow the database clock; --list on a host an hour ahead showed them an hour late."""
    from datetime import datetime, timedelta
    from datetime import timezone as tz

    from tests.conftest import FAKETIME_LIB, vendor

    if vendor() == "sqlite":
        pytest.skip("not applicable to SQLite: its clock is the calling process's (docs/reliability.md)")
    assert FAKETIME_LIB.exists(), "apt-get install faketime (libfaketime) to run the clock-skew test"
    cluster.jobs = [{"name": "often", "every": "1500ms", "kind": "record"}]
    skewed = {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": "+1h", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    before = datetime.now(tz.utc)
    result = cluster.manage("anarchon", "--list", extra_env=skewed)
    assert result.returncode == 0, result.stderr
    shown = re.search(r"next (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{3})?) UTC", result.stdout)
    assert shown, result.stdout
    due = datetime.fromisoformat(shown.group(1)).replace(tzinfo=tz.utc)
    assert before - timedelta(seconds=1) < due < before + timedelta(seconds=10), (due, before)
    assert due.microsecond in (0, 500_000), "a 1500ms job's slot shown to the millisecond"


def test_run_runs_one_job_in_the_foreground_as_manual(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "once", "every": ON_DEMAND, "kind": "record"}]
    result = cluster.manage("anarchon", "--run", "once", "--data", '{"n": 1}', "--instance-id", "cli")
    assert result.returncode == 0, result.stderr
    assert ": success" in result.stdout
    [run] = Run.objects.filter(job="once")
    assert (run.status, run.reason, run.manual, run.instance_id, run.data) == (
        "success",
        "manual",
        True,
        "cli",
        {"n": 1},
    )
    execution = Execution.objects.get(job="once")
    assert (execution.reason, execution.manual, execution.data) == ("manual", True, {"n": 1})


def test_run_of_a_failing_job_exits_non_zero_with_the_error(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "bad", "every": ON_DEMAND, "kind": "fail"}]
    result = cluster.manage("anarchon", "--run", "bad")
    assert result.returncode == 1
    assert "ValueError: boom in bad" in result.stderr
    assert "Traceback (most recent call last)" in result.stderr and 'jobs.py", line' in result.stderr, (
        "the handler's own traceback is printed"
    )
    assert result.stderr.count("Traceback (most recent call last)") == 1, "once: the log line carries it"
    assert Run.objects.get(job="bad").status == "failed"


def test_run_of_a_failing_job_prints_the_traceback_when_the_log_does_not(tmp_path: Path) -> None:
    """A project whose logging keeps django_anarchon's records off the terminal still sees the error."""
    import io

    from django.core.management import call_command
    from django.core.management.base import CommandError

    from django_anarchon import Scheduler

    def broken(ctx: Any) -> None:
        raise ValueError("boom in quiet")

    own = Scheduler()
    own.every("quiet", "1h", broken)
    logger = logging.getLogger("django_anarchon")
    kept = logger.handlers[:], logger.propagate
    logger.handlers[:] = [logging.FileHandler(tmp_path / "log.txt")]
    logger.propagate = False
    err = io.StringIO()
    try:
        with (
            mock.patch("django_anarchon.management.commands.anarchon.scheduler", own),
            pytest.raises(CommandError, match="boom in quiet"),
        ):
            call_command("anarchon", "--run", "quiet", stderr=err, stdout=io.StringIO())
    finally:
        logger.handlers[0].close()
        logger.handlers[:], logger.propagate = kept
    assert err.getvalue().count("Traceback (most recent call last)") == 1, err.getvalue()
    assert "boom in quiet" in (tmp_path / "log.txt").read_text()


def test_the_command_refuses_to_start_on_a_database_that_lacks_the_migrations(cluster: Cluster, tmp_path: Path) -> None:
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("one database is enough to show it: a fresh SQLite file stands for an unmigrated database")
    result = cluster.manage("anarchon", extra_env={"ANARCHON_TEST_DB_NAME": str(tmp_path / "never-migrated.sqlite3")})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "lacks django_anarchon's migrations 0001_initial" in result.stderr
    assert "run `python manage.py migrate` first" in result.stderr


def test_list_says_so_when_it_cannot_read_the_database(cluster: Cluster, tmp_path: Path) -> None:
    """It listed every job as not paused, by this host's clock, exiting 0 without a word (helper 29)."""
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("one database is enough to show it: a fresh SQLite file stands for an unreadable database")
    cluster.jobs = [{"name": "tick", "every": "1h", "kind": "record"}]
    empty = tmp_path / "empty.sqlite3"
    sqlite3.connect(empty).close()  # a database never migrated
    result = cluster.manage("anarchon", "--list", extra_env={"ANARCHON_TEST_DB_NAME": str(empty)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("tick") and "every 1h" in result.stdout
    assert "Could not read the database (OperationalError: no such table" in result.stderr
    assert "paused jobs are not marked PAUSED" in result.stderr
    # A file that does not exist is not created, empty, by the listing (helper 37), as --check does not.
    absent = tmp_path / "none.sqlite3"
    result = cluster.manage("anarchon", "--list", extra_env={"ANARCHON_TEST_DB_NAME": str(absent)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("tick") and "every 1h" in result.stdout
    assert f"the SQLite database file {absent} does not exist" in result.stderr
    assert "paused jobs are not marked PAUSED" in result.stderr
    assert not absent.exists(), "the listing created the database file"
    # The checks that need no database still run then (they were all left out): a job declared wrong.
    cluster.jobs = [{"name": "tick", "every": "0s", "kind": "record"}]
    result = cluster.manage("anarchon", "--list", extra_env={"ANARCHON_TEST_DB_NAME": str(absent)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "anarchon.E005" in result.stderr and "'tick'" in result.stderr
    assert not absent.exists(), "the checks created the database file"


def test_an_instance_started_while_the_database_is_unreachable_runs_its_checks_once_it_is_back(
    cluster: Cluster, tmp_path: Path
) -> None:
    """It skipped the checks and started anyway: on a database that came back unmigrated (or with a
    MySQL session time zone it must refuse) it ran, or retried quietly for ever (helper 29). It
    now waits for the database, then runs the checks, and refuses then."""
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("one database is enough to show it: a SQLite file in a folder not yet made is unreachable")
    later = tmp_path / "not-yet" / "db.sqlite3"
    instance = cluster.start("waits", extra_env={"ANARCHON_TEST_DB_NAME": str(later)})
    wait_for(lambda: "Database unreachable at start" in instance.output(), 30, what="the unreachable warning")
    time.sleep(1.5)
    assert instance.alive(), instance.output()
    assert "started with" not in instance.output(), "nothing is scheduled before the checks ran"
    later.parent.mkdir()  # reachable now, but never migrated
    wait_for(lambda: not instance.alive(), 30, what="the instance to refuse the unmigrated database")
    assert instance.process.returncode == 1, instance.output()
    assert "lacks django_anarchon's migrations 0001_initial" in instance.output()


def test_an_instance_stopped_while_it_waits_for_the_database_exits_0(cluster: Cluster, tmp_path: Path) -> None:
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("one database is enough to show it: a SQLite file in a folder not yet made is unreachable")
    instance = cluster.start("stopped", extra_env={"ANARCHON_TEST_DB_NAME": str(tmp_path / "none" / "db.sqlite3")})
    wait_for(lambda: "Database unreachable at start" in instance.output(), 30, what="the unreachable warning")
    instance.signal(signal.SIGTERM)
    wait_for(lambda: not instance.alive(), 10, what="the instance to stop")
    assert instance.process.returncode == 0, instance.output()


def test_run_with_the_database_unreachable_fails_at_once(cluster: Cluster, tmp_path: Path) -> None:
    """A one-off command waited for ever, and exited 0 with nothing run when stopped (helper 31)."""
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("one database is enough to show it: a SQLite file in a folder not yet made is unreachable")
    cluster.jobs = [{"name": "x", "every": ON_DEMAND}]
    result = cluster.manage(
        "anarchon", "--run", "x", timeout=30, extra_env={"ANARCHON_TEST_DB_NAME": str(tmp_path / "no" / "db.sqlite3")}
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the database is unreachable: unable to open database file" in result.stderr


def test_verbosity_2_turns_on_debug_logging(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "x", "every": ON_DEMAND}]
    quiet = cluster.manage("anarchon", "--run", "x")
    assert quiet.returncode == 0, quiet.stderr
    assert " DEBUG " not in quiet.stderr
    loud = cluster.manage("anarchon", "--run", "x", "-v", "2")
    assert loud.returncode == 0, loud.stderr
    assert " DEBUG django_anarchon " in loud.stderr, loud.stderr


def test_run_of_an_unknown_job_names_the_declared_ones(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "known", "every": ON_DEMAND}]
    result = cluster.manage("anarchon", "--run", "unknown")
    assert result.returncode == 1
    assert "No job is named 'unknown'" in result.stderr and "'known'" in result.stderr


def test_bad_flags_are_rejected_by_argparse(cluster: Cluster) -> None:
    result = cluster.manage("anarchon", "--run", "x", "--data", "{not json")
    assert result.returncode == 2 and "--data" in result.stderr and "not valid JSON" in result.stderr
    result = cluster.manage("anarchon", "--list", "--run", "x")
    assert result.returncode == 2 and "not allowed with" in result.stderr


def test_settings_that_break_the_guarantees_stop_the_command(cluster: Cluster) -> None:
    cluster.settings = {"LEASE_TTL": 1, "POLL_INTERVAL": 1}
    result = cluster.manage("anarchon")
    assert result.returncode == 1
    assert "anarchon.E003" in result.stderr


def test_a_bad_declaration_is_reported_by_check_and_blocks_the_scheduler(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "ok", "every": "1s"}, {"name": "typo", "every": "10 sec"}]
    result = cluster.manage("check")
    assert result.returncode == 1
    assert "anarchon.E005" in result.stderr
    assert "Job 'typo': bad interval: '10 sec'" in result.stderr and "'1h30m'" in result.stderr
    result = cluster.manage("anarchon")
    assert result.returncode == 1 and "anarchon.E005" in result.stderr


def test_a_jobs_module_that_raises_at_import_stops_the_process_with_its_own_error(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "x", "every": "1s", "kind": "no-such-kind"}]
    result = cluster.manage("check")
    assert result.returncode == 1
    assert "unknown test job kind 'no-such-kind'" in result.stderr
    assert "Traceback" in result.stderr


def test_a_second_sigint_exits_at_once(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "deaf", "every": "1s", "kind": "stubborn", "seconds": 60}]
    cluster.settings = {"SHUTDOWN_GRACE": 60}
    node = cluster.start("deaf-node")
    cluster.wait_ready(node)
    wait_for(lambda: Execution.objects.filter(job="deaf").exists(), 10, what="the handler to start")
    node.signal(signal.SIGINT)
    time.sleep(0.5)
    assert node.alive(), "the first SIGINT waits for the grace period"
    node.signal(signal.SIGINT)
    assert node.wait(5) == 130


@pytest.mark.parametrize("kind", ["stubborn", "async_stubborn"])
def test_sigterm_exits_0_after_the_grace_period_even_if_a_handler_never_ends(cluster: Cluster, kind: str) -> None:
    # The handler ignores its signal. After SHUTDOWN_GRACE the run is handed over;
    # the process must then leave, not wait for the handler's thread (an async
    # handler's sync_to_async thread is one that Python waits for at exit).
    cluster.jobs = [{"name": "deaf", "every": ON_DEMAND, "kind": kind, "seconds": 60}]
    cluster.settings = {"SHUTDOWN_GRACE": 0.5}
    node = cluster.start("deaf-node")
    cluster.wait_ready(node)
    request = cluster.manage("shell", "-c", "from django_anarchon import run_now; run_now('deaf')")
    assert request.returncode == 0, request.stderr
    wait_for(lambda: Execution.objects.filter(job="deaf").exists(), 10, what="the handler to start")
    node.signal(signal.SIGTERM)
    assert node.wait(10) == 0, node.output()
    assert "did not end within the 0.5s grace period" in node.output()
    run = Run.objects.get(job="deaf", attempt=1)
    assert run.status == "interrupted"
    assert Run.objects.get(job="deaf", slot=run.slot, attempt=2).status == "pending"
    assert not Execution.objects.filter(job="deaf", event="end").exists()


# A shell without job control starts background commands with SIGINT ignored; the command must stop on it.
SIGINT_IGNORED = ["sh", "-c", 'trap "" INT; exec "$0" "$@"']


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_run_stops_its_run_on_sigint_or_sigterm_and_hands_it_over(cluster: Cluster, signum: int) -> None:
    """``--run`` stops as the scheduler does: the signal aborts, the handler raising hands the run over."""
    cluster.jobs = [{"name": "long", "every": ON_DEMAND, "kind": "sleep", "seconds": 60}]
    node = cluster.start("cli", prefix=SIGINT_IGNORED, args=["--run", "long"])
    wait_for(lambda: Execution.objects.filter(job="long", event="start").exists(), 20, what="the handler to start")
    node.signal(signum)
    assert node.wait(10) == 1, node.output()
    assert "the run ended interrupted" in node.output()
    assert "is stopping" in Execution.objects.get(job="long", event="aborted").note
    run = Run.objects.get(job="long", attempt=1)
    assert (run.status, run.manual) == ("interrupted", True)
    assert Run.objects.get(job="long", slot=run.slot, attempt=2).status == "pending", "handed over"


def test_run_exits_at_once_on_a_second_sigint(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "deaf", "every": ON_DEMAND, "kind": "stubborn", "seconds": 60}]
    cluster.settings = {"SHUTDOWN_GRACE": 60}
    node = cluster.start("cli", prefix=SIGINT_IGNORED, args=["--run", "deaf"])
    wait_for(lambda: Execution.objects.filter(job="deaf").exists(), 20, what="the handler to start")
    node.signal(signal.SIGINT)
    time.sleep(0.5)
    assert node.alive(), "the first SIGINT waits for the grace period"
    node.signal(signal.SIGINT)
    assert node.wait(5) == 130


def test_the_command_keeps_start_up_objects_out_of_garbage_collections(cluster: Cluster) -> None:
    """A full collection of a Django process took 15-20 ms and delayed every handler due meanwhile."""
    cluster.jobs = [{"name": "collector", "every": "1s", "kind": "gc"}]
    node = cluster.start("gc")
    cluster.wait_ready(node)
    run = wait_for(lambda: Execution.objects.filter(job="collector").first(), 10, what="a run")
    assert int(run.note) > 10_000, f"only {run.note} objects frozen: gc.freeze() was not called after start-up"


def test_run_now_from_another_process_is_picked_up_within_a_poll(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "manual", "every": ON_DEMAND, "kind": "record"}]
    node = cluster.start("worker")
    cluster.wait_ready(node)
    time.sleep(0.5)
    code = "from django_anarchon import run_now; print(run_now('manual', data={'from': 'shell'}).pk)"
    result = cluster.manage("shell", "-c", code)
    assert result.returncode == 0, result.stderr
    run_id = int(result.stdout.split()[-1])
    done = wait_for(lambda: Run.objects.filter(pk=run_id, status="success").first(), 10, what="the manual run")
    assert (done.reason, done.manual, done.data, done.instance_id) == ("manual", True, {"from": "shell"}, "worker")
    pickup = (done.started_at - done.created_at).total_seconds()
    assert pickup < 0.2 + 1.5, f"picked up after {pickup:.2f}s"
    print(f"run_now pickup by polling or NOTIFY: {pickup * 1000:.0f} ms")


def test_run_now_is_picked_up_at_once_via_notify_on_postgresql_and_at_the_next_poll_elsewhere(
    cluster: Cluster,
) -> None:
    from django.db import connection

    cluster.jobs = [{"name": "manual", "every": ON_DEMAND, "kind": "record"}]
    # A poll only every 30 s: a pickup within seconds can only come from NOTIFY.
    cluster.settings = {"POLL_INTERVAL": 30, "LEASE_TTL": 120}
    node = cluster.start("listener")
    cluster.wait_ready(node)
    time.sleep(1.0)  # past the start-up poll
    shell = "from django_anarchon import run_now; print(run_now('manual', data={n}).pk)"
    if connection.vendor != "postgresql":
        # No LISTEN/NOTIFY: the request waits for the next poll.
        run_id = int(cluster.manage("shell", "-c", shell.format(n=0)).stdout.split()[-1])
        time.sleep(3)
        assert Run.objects.get(pk=run_id).status == "pending"
        return
    pickups = []
    for n in range(3):
        run_id = int(cluster.manage("shell", "-c", shell.format(n=n)).stdout.split()[-1])
        done = wait_for(
            lambda run_id=run_id: Run.objects.filter(pk=run_id, status="success").first(), 10, what="NOTIFY pickup"
        )
        pickups.append((done.started_at - done.created_at).total_seconds())
    assert max(pickups) < 2.0, pickups
    print("run_now pickup via NOTIFY: " + ", ".join(f"{p * 1000:.0f} ms" for p in pickups))


def test_the_example_project_e_mails_the_admins_when_a_run_fails(tmp_path: Path) -> None:
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'example.sqlite3'}", "PYTHONUNBUFFERED": "1"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    manage = [sys.executable, str(ROOT / "example_project" / "manage.py")]
    migrate = subprocess.run([*manage, "migrate", "-v", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert migrate.returncode == 0, migrate.stderr
    result = subprocess.run(
        [*manage, "anarchon", "--run", "sync-customers", "--data", '{"fail": true}'],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    # The console e-mail backend prints the alert that demo/alerts.py sends on run_failed.
    assert "Subject: [Django] Job sync-customers failed (attempt 1)" in result.stdout
    assert "To: ops@example.com" in result.stdout
    assert "RuntimeError: the customer API answered 503" in result.stdout
