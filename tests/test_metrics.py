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
    node = cluster.start("metered", args=["--metrics-port", str(port)])
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
    assert (
        "anarchon_job_last_success_age_seconds" in text
        and 'job="broken"' not in text.split("anarchon_job_last_success_age_seconds")[-1]
    ), "a job that never succeeded has no age"


def test_the_web_process_reads_the_cluster_figures_from_the_database() -> None:
    from datetime import timedelta

    from prometheus_client import generate_latest

    from django_anarchon import store
    from django_anarchon.models import Instance, Run

    now = store.database_time()
    Instance.objects.create(token="t", instance_id="i", host="h", pid=1, started_at=now, last_heartbeat=now)
    Run.objects.create(job="report", slot=1, attempt=1, status="success", reason="scheduled",
                       scheduled_at=now, finished_at=now - timedelta(seconds=90))  # fmt: skip
    text = generate_latest().decode()
    assert value(text, "anarchon_instances_alive") == 1
    assert 89 <= value(text, "anarchon_job_last_success_age_seconds", job="report") < 120


def test_skip_reasons_and_missed_counts_are_read_from_the_records() -> None:
    assert metrics.skip_reason("no instance had a free worker for it before the job's next slot came") == "no_worker"
    assert metrics.skip_reason(BEHIND_DETAIL) == "behind"
    assert metrics.skip_reason("the job is paused") == "paused"
    assert metrics.skip_reason("cancelled by ann in the admin") == "cancelled"
    assert metrics.skip_reason("the previous run (slot …) was still running on a") == "busy"
    before = metrics.MISSED.labels("m")._value.get()
    metrics.missed("m", "4 slot(s) missed from … to … while no instance ran them; catch_up='latest'")
    assert metrics.MISSED.labels("m")._value.get() == before + 4
