"""Prometheus metrics: they move under real runs, served by the command and readable from any process."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest

from django_anarchon import metrics
from django_anarchon.slots import BEHIND_DETAIL
from tests.conftest import ON_DEMAND, Cluster, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:  # noqa: S310
        return str(response.read().decode())


def value(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" ([0-9.e+-]+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.process
def test_the_command_serves_metrics_that_move_under_real_runs(cluster: Cluster) -> None:
    cluster.jobs = [
        {"name": "tick", "every": "1s", "kind": "record"},
        {"name": "broken", "every": "1s", "kind": "fail", "overlap": "allow"},
        {"name": "spare", "every": ON_DEMAND},
    ]
    port = free_port()
    node = cluster.start("metered", args=["--metrics-port", str(port), "--metrics-address", "127.0.0.1"])
    cluster.wait_ready(node)
    text = wait_for(
        lambda: (t := scrape(port)) and value(t, "anarchon_runs_total", job="tick", status="success") >= 2 and t,
        15,
        what="two successful runs counted",
    )
    assert value(text, "anarchon_runs_total", job="broken", status="failed") >= 1
    assert value(text, "anarchon_run_lateness_seconds_count", job="tick") >= 2
    assert value(text, "anarchon_run_duration_seconds_count", job="tick") >= 2
    assert value(text, "anarchon_claims_total", result="won") >= 4
    assert value(text, "anarchon_lease_renewals_total", result="ok") >= 0
    assert value(text, "anarchon_instances_alive") == 1, "read from the database at the scrape"
    assert value(text, "anarchon_job_last_success_age_seconds", job="tick") < 5
    # A job that never succeeded counts from when it was first seen (as job_overdue does), so an
    # alert on the gauge fires for a job failing since its deploy.
    assert 'anarchon_job_last_success_age_seconds{job="broken"}' in text
    assert 0 <= value(text, "anarchon_job_last_success_age_seconds", job="broken") < 30


def test_the_web_process_reads_the_cluster_figures_from_the_database() -> None:
    from datetime import timedelta

    from prometheus_client import generate_latest

    from django_anarchon import store
    from django_anarchon.models import Instance, JobState, Run

    now = store.database_time()
    Instance.objects.create(token="t", instance_id="i", host="h", pid=1, started_at=now, last_heartbeat=now)
    for name in ("report", "never", "paused", "resumed"):
        JobState.objects.create(name=name, first_seen=now - timedelta(days=30))
    for name in ("report", "paused", "resumed"):
        Run.objects.create(job=name, slot=1, attempt=1, status="success", reason="scheduled",
                           scheduled_at=now, finished_at=now - timedelta(seconds=90))  # fmt: skip
    JobState.objects.get(name="paused").pause("maintenance")
    JobState.objects.filter(name="resumed").update(resumed_at=now - timedelta(seconds=30))
    text = generate_latest().decode()
    assert value(text, "anarchon_instances_alive") == 1
    assert 89 <= value(text, "anarchon_job_last_success_age_seconds", job="report") < 120
    assert value(text, "anarchon_job_last_success_age_seconds", job="never") >= 30 * 86400, "never succeeded"
    assert 'anarchon_job_last_success_age_seconds{job="paused"}' not in text, "a paused job is not overdue: no series"
    assert 29 <= value(text, "anarchon_job_last_success_age_seconds", job="resumed") < 60, "counted from its resume"


def test_skip_reasons_and_missed_counts_are_read_from_the_records() -> None:
    assert metrics.skip_reason("no instance had a free worker for it before the job's next slot came") == "no_worker"
    assert metrics.skip_reason(BEHIND_DETAIL) == "behind"
    assert metrics.skip_reason("the job is paused") == "paused"
    assert metrics.skip_reason("cancelled by ann in the admin") == "cancelled"
    assert metrics.skip_reason("the previous run (slot …) was still running on a") == "busy"
    before = metrics.MISSED.labels("m").get()
    metrics.missed("m", "4 slot(s) missed from … to … while no instance ran them; catch_up='latest'")
    assert metrics.MISSED.labels("m").get() == before + 4


def test_counters_and_histograms_are_exposed_as_prometheus_client_would() -> None:
    """Counted here, handed to prometheus-client's registry at the scrape: the usual names and buckets."""
    from prometheus_client import generate_latest

    for seconds in (0.004, 0.005, 0.2, 45.0, 100.0):
        metrics.LATENESS.labels("exposed").observe(seconds)
    metrics.RUNS.labels("exposed", "success").inc()
    metrics.RUNS.labels("exposed", "success").inc(2)
    text = generate_latest().decode()
    assert "# TYPE anarchon_run_lateness_seconds histogram" in text
    assert "# TYPE anarchon_runs_total counter" in text or "# TYPE anarchon_runs counter" in text
    assert value(text, "anarchon_runs_total", job="exposed", status="success") == 3
    buckets = {
        le: value(text, "anarchon_run_lateness_seconds_bucket", job="exposed", le=le)
        for le in ("0.005", "0.01", "0.25", "30.0", "60.0", "+Inf")
    }
    # cumulative, and a value equal to a bound counts in that bound's bucket ("le")
    assert buckets == {"0.005": 2, "0.01": 2, "0.25": 3, "30.0": 3, "60.0": 4, "+Inf": 5}
    assert value(text, "anarchon_run_lateness_seconds_count", job="exposed") == 5
    assert value(text, "anarchon_run_lateness_seconds_sum", job="exposed") == pytest.approx(145.209)
    with pytest.raises(ValueError, match="takes the labels"):
        metrics.RUNS.labels("only-one")
    with pytest.raises(ValueError, match="only go up"):
        metrics.RUNS.labels("exposed", "success").inc(-1)
