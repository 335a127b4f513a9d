"""The health check: ``check_health()``, ``manage.py anarchon --check`` and the django-health-check plugin."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError
from django.utils import timezone

from django_anarchon import store
from django_anarchon.health import check_health
from django_anarchon.models import Instance
from tests.conftest import ON_DEMAND, Cluster

pytestmark = pytest.mark.django_db(transaction=True)


def instance(name: str, age_s: float = 0.0, offset_ms: float | None = 3.0) -> Instance:
    beat = store.database_time() - timedelta(seconds=age_s)
    return Instance.objects.create(
        token=name, instance_id=name, host="h", pid=1, started_at=beat, last_heartbeat=beat, clock_offset_ms=offset_ms
    )


def test_healthy_with_one_live_instance_among_stale_ones() -> None:
    assert not check_health().ok and "no scheduler instance has registered" in check_health().reason
    instance("gone", age_s=3600)
    health = check_health()
    assert not health.ok and "gone: no heartbeat for 3600s" in health.reason
    instance("alive")
    health = check_health()
    assert health.ok and health.live == ["alive"] and str(health) == "1 live instance(s): alive"


def test_one_instance_can_be_checked_by_its_id() -> None:
    instance("web-1")
    instance("web-2", age_s=3600)
    assert check_health("web-1").ok
    assert not check_health("web-2").ok
    missing = check_health("web-3")
    assert not missing.ok and "no instance 'web-3' has registered" in missing.reason


def test_an_instance_whose_clock_is_off_the_databases_is_not_healthy() -> None:
    instance("skewed", offset_ms=-4200.0)
    health = check_health("skewed")
    assert not health.ok and "its clock is 4.2s ahead of the database's" in health.reason
    instance("slow", offset_ms=3100.0)
    assert "its clock is 3.1s behind the database's" in check_health("slow").reason


def test_an_unreachable_database_is_unhealthy(monkeypatch: pytest.MonkeyPatch) -> None:
    instance("alive")

    def refused() -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(store, "database_time", refused)
    health = check_health()
    assert not health.ok and health.reason == "the database is unreachable (OperationalError: connection refused)"


@pytest.mark.process
def test_the_check_command_answers_for_a_running_instance_and_fails_once_its_loop_stops(cluster: Cluster) -> None:
    cluster.jobs = [{"name": "x", "every": ON_DEMAND}]
    node = cluster.start("probed")
    cluster.wait_ready(node)
    ok = cluster.manage("anarchon", "--check")
    assert ok.returncode == 0 and ok.stdout.strip() == "ok: 1 live instance(s): probed", ok.stdout + ok.stderr
    assert cluster.manage("anarchon", "--check", "--instance-id", "probed").returncode == 0
    other = cluster.manage("anarchon", "--check", "--instance-id", "other")
    assert other.returncode == 1 and "no instance 'other' has registered" in other.stderr
    node.signal(signal.SIGSTOP)  # the loop stops turning: no more heartbeats
    try:
        time.sleep(3 * 0.67 + 1.5)  # three heartbeat intervals (LEASE_TTL 2 s / 3), and some
        stopped = cluster.manage("anarchon", "--check", "--instance-id", "probed")
    finally:
        node.signal(signal.SIGCONT)
    assert stopped.returncode == 1, stopped.stdout
    assert "unhealthy: no live instance: probed: no heartbeat for" in stopped.stderr


def test_the_check_command_does_not_create_a_missing_sqlite_file(cluster: Cluster, tmp_path: Any) -> None:
    """Connecting made an empty file, and the check then called it unmigrated (helper 29)."""
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("SQLite only: the other databases do not create a database on connecting")
    missing = tmp_path / "missing.sqlite3"
    result = cluster.manage("anarchon", "--check", extra_env={"ANARCHON_TEST_DB_NAME": str(missing)})
    assert result.returncode == 1 and f"the SQLite database file {missing} does not exist" in result.stderr
    assert not missing.exists()


def test_the_django_health_check_plugin_reports_the_same() -> None:
    plugin = pytest.importorskip(
        "django_anarchon.contrib.health_check", reason="needs django-health-check (the test extra installs it)"
    )
    instance("alive")
    check = plugin.Scheduler()
    if hasattr(check, "check_status"):  # django-health-check 3
        check.check_status()
        assert not check.errors
    else:
        check.run()
    Instance.objects.all().update(last_heartbeat=timezone.now() - timedelta(hours=1))
    with pytest.raises(Exception, match="no live instance"):
        if hasattr(check, "check_status"):
            check.errors = []
            check.check_status()
            raise check.errors[0]
        check.run()


def test_the_health_check_plugin_can_be_an_installed_app(tmp_path: Any) -> None:
    """django-health-check 3 wants the plugin in INSTALLED_APPS: Django imports the package while it
    loads the apps, and its import of the models stopped every command ("Apps aren't loaded yet",
    helper 29)."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "hc_settings.py").write_text(
        "from tests.settings import *  # noqa\n"
        "INSTALLED_APPS = [*INSTALLED_APPS, 'django_anarchon.contrib.health_check']\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); "
         "from django.apps import apps; print(apps.get_app_config('anarchon_health_check').name)"],
        cwd=root,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "hc_settings", "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}"},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "django_anarchon.contrib.health_check"


# -- job_overdue -------------------------------------------------------------------------------


def test_an_overdue_alert_is_claimed_once_per_lapse_however_many_instances_look() -> None:
    from django_anarchon import Scheduler
    from django_anarchon.models import JobState, Run
    from tests.test_store import race

    scheduler = Scheduler()
    scheduler.every("nightly", "1d", lambda ctx: None, alert_after="2h")
    scheduler.every("quiet", "1d", lambda ctx: None)  # no alert_after: never alerted
    jobs = scheduler.jobs
    store.ensure_jobs(jobs)
    assert store.claim_overdue_alerts(jobs) == [], "first seen a moment ago: not overdue yet"
    JobState.objects.update(first_seen=timezone.now() - timedelta(hours=3))
    found = [a for batch in race(8, lambda i: store.claim_overdue_alerts(jobs)) for a in batch]
    assert [a.job for a in found] == ["nightly"], "one alert across eight instances"
    assert found[0].last_success is None and found[0].without_success > timedelta(hours=3)
    assert store.claim_overdue_alerts(jobs) == [], "sent once per lapse"
    # A success after the alert re-arms it; three hours without another make a new lapse.
    JobState.objects.filter(name="nightly").update(overdue_alerted_at=timezone.now() - timedelta(hours=4))
    ran = timezone.now() - timedelta(hours=3)
    Run.objects.create(job="nightly", slot=1, attempt=1, status="success", reason="scheduled",
                       scheduled_at=ran, finished_at=ran)  # fmt: skip
    [again] = store.claim_overdue_alerts(jobs)
    assert again.last_success == ran
    JobState.objects.filter(name="nightly").update(paused=True)
    JobState.objects.filter(name="nightly").update(overdue_alerted_at=None)
    assert store.claim_overdue_alerts(jobs) == [], "a paused job is not overdue"
    # Resumed after a pause longer than alert_after: counted from the resume, not from the last
    # success (the alert came at once, before the job had had a single slot).
    JobState.objects.get(name="nightly").resume()
    assert store.claim_overdue_alerts(jobs) == [], "resumed a moment ago: not overdue yet"
    JobState.objects.filter(name="nightly").update(resumed_at=timezone.now() - timedelta(hours=2, minutes=1))
    [after_resume] = store.claim_overdue_alerts(jobs)
    assert timedelta(hours=2) < after_resume.without_success < timedelta(hours=2, minutes=2)


@pytest.mark.process
def test_job_overdue_is_sent_once_across_three_instances(cluster: Cluster) -> None:
    from tests.conftest import wait_for
    from tests.testapp.models import Execution

    cluster.jobs = [{"name": "failing", "every": "1s", "kind": "fail", "alert_after": "2s"}]
    nodes = [cluster.start(f"o{i}") for i in range(3)]
    cluster.wait_ready(*nodes)
    wait_for(lambda: Execution.objects.filter(event="overdue").exists(), 15, what="the job_overdue alert")
    time.sleep(3)  # every instance's housekeeping comes round again meanwhile
    alerts = list(Execution.objects.filter(event="overdue"))
    assert [a.job for a in alerts] == ["failing"], f"{len(alerts)} alerts for one lapse"
    assert "Job 'failing' is overdue" in cluster.logs()
