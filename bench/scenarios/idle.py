"""3. Idle cost: statements per second one idle instance sends, with 10 and 10,000 jobs,
and how fast a manual run (``run_now()`` from another process) is picked up.

Statements are counted inside the instance by :mod:`bench.benchapp.probe` (Django's
``execute_wrappers`` on every connection it opens), between two probe snapshots after
start-up. The jobs run once a day, so no slot is due in the window. Manual pickup is
measured with ``POLL_INTERVAL`` = 5 s: on PostgreSQL LISTEN/NOTIFY should wake the
instance at once, elsewhere the pickup waits for the next poll (2.5 s on average).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from bench import recorder, stats
from bench.cluster import Cluster, manage, wait_for
from bench.context import Context, reset_database

PICKUP_POLL = 5.0


def idle(ctx: Context, jobs: int, seconds: int) -> dict[str, Any]:
    reset_database()
    folder = ctx.folder(f"idle-{jobs}")
    with Cluster(ctx.db, folder, [{"prefix": "idle", "count": jobs, "every": "1d"}]) as cluster:
        (instance,) = cluster.start(1)
        cluster.wait_ready([instance])
        time.sleep(2)  # let start-up queries settle
        first = instance.fresh_probe(time.time())
        time.sleep(seconds)
        last = instance.fresh_probe(time.time())
    elapsed = last["time"] - first["time"]
    kinds = Counter(last["kinds"])
    kinds.subtract(first["kinds"])
    return {
        "jobs": jobs,
        "seconds": round(elapsed, 1),
        "queries_per_s": round((last["queries"] - first["queries"]) / elapsed, 3),
        "by_kind_per_s": {k: round(v / elapsed, 3) for k, v in sorted(kinds.items()) if v},
        # Less the probe's own thread, which the measured instance would not have.
        "cpu_s_per_min": round(
            (last["cpu"] - first["cpu"] - (last["probe_cpu"] - first["probe_cpu"])) / elapsed * 60, 3
        ),
        "rss_mb": round(last["rss_kb"] / 1024, 1),
        "startup_s": round(first["ready_at"] - instance.spawned, 2),
        "fires": len(recorder.read(folder)),
    }


def pickup(ctx: Context, count: int) -> dict[str, Any]:
    reset_database()
    folder = ctx.folder("pickup")
    jobs = [{"prefix": "manual", "count": 10, "every": "1d"}]
    settings = {"POLL_INTERVAL": PICKUP_POLL, "LEASE_TTL": 30}
    with Cluster(ctx.db, folder, jobs, settings) as cluster:
        (instance,) = cluster.start(1)
        cluster.wait_ready([instance])
        first = instance.fresh_probe(time.time())
        env = cluster.env()
        env.pop("ANARCHON_BENCH_PROBE")
        calls = json.loads(manage(ctx.db, "bench_runnow", "manual-0", "--count", str(count), env=env))
        wait_for(
            lambda: len([s for s in recorder.read(folder) if s.reason == "manual"]) >= count,
            PICKUP_POLL * 3,
            "the manual runs to start",
        )
        last = instance.fresh_probe(time.time())
    starts = {s.slot_ms: s for s in recorder.read(folder) if s.reason == "manual"}
    latencies = [starts[c["slot"]].start - c["called"] for c in calls]
    polls = last["kinds"].get("SELECT django_anarchon_run", 0) - first["kinds"].get("SELECT django_anarchon_run", 0)
    return {
        "poll_interval_s": PICKUP_POLL,
        "runs": count,
        **stats.summary_ms(latencies),
        "run_selects_per_s": round(polls / (last["time"] - first["time"]), 3),
    }


def run(ctx: Context) -> dict[str, Any]:
    seconds = 10 if ctx.quick else (30 if ctx.primary else 10)
    results: dict[str, Any] = {"instances": []}
    for jobs in (10, 10_000):
        ctx.log(f"idle: 1 instance, {jobs} jobs, {seconds}s")
        measured = idle(ctx, jobs, seconds)
        ctx.log(f"  {measured['queries_per_s']} statements/s, {measured['cpu_s_per_min']} CPU s/min")
        results["instances"].append(measured)
    ctx.log(f"idle: manual pickup with POLL_INTERVAL={PICKUP_POLL:g}s")
    results["pickup"] = pickup(ctx, 3 if ctx.quick else 6)
    ctx.log(f"  pickup p50 {results['pickup']['p50_ms']} ms, max {results['pickup']['max_ms']} ms")
    return results
