"""4. Failover: from SIGKILL of a runner to the takeover attempt's start, and from SIGTERM
to the hand-over (the next attempt's start on another instance).

Two instances (a killed one is replaced before the next repetition) and one job whose
handler sleeps for an hour honouring ``ctx.signal``. Targets: SIGKILL ≤ LEASE_TTL +
POLL_INTERVAL; SIGTERM ≤ POLL_INTERVAL + 0.5 s.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from bench import recorder, stats
from bench.cluster import Cluster, Instance, wait_for
from bench.context import Context, reset_database

LEASE_TTL = 3.0
POLL_INTERVAL = 0.5


def _latest(folder: Any) -> recorder.Start | None:
    starts = recorder.read(folder)
    return max(starts, key=lambda s: s.attempt) if starts else None


def _repeat(ctx: Context, cluster: Cluster, sig: int, reps: int) -> list[dict[str, float]]:
    from django_anarchon.models import Run

    measured = []
    for _ in range(reps):
        current = wait_for(lambda: _latest(cluster.folder), 30, "the long run to start")
        runner: Instance = next(i for i in cluster.instances if i.pid == current.pid)
        time.sleep(1.0)  # let a few lease renewals happen, as in a real run
        sent = time.time()
        os.kill(runner.pid, sig)

        def taken_over(previous: recorder.Start = current) -> recorder.Start | None:
            latest = _latest(cluster.folder)
            return latest if latest is not None and latest.attempt > previous.attempt else None

        nxt = wait_for(taken_over, LEASE_TTL * 4, "the next attempt to start")
        old = Run.objects.get(job=current.job, slot=current.slot_ms, attempt=current.attempt)
        measured.append(
            {
                "to_next_start_s": round(nxt.start - sent, 3),
                "to_old_ended_s": round(old.finished_at.timestamp() - sent, 3) if old.finished_at else float("nan"),
            }
        )
        runner.process.wait(30)
        cluster.wait_ready(cluster.start(1))
    return measured


def run(ctx: Context) -> dict[str, Any]:
    reps = 2 if ctx.quick else (5 if ctx.primary else 3)
    reset_database()
    folder = ctx.folder("failover")
    jobs = [{"prefix": "long", "count": 1, "every": "2s", "kind": "sleep", "seconds": 3600}]
    # Every repetition continues the same run with its next attempt (the job's handler sleeps an
    # hour), and ten of them would reach the default MAX_ATTEMPTS: its last attempt is recorded
    # failed instead of handed on, and the next repetition would wait for nothing.
    settings = {"LEASE_TTL": LEASE_TTL, "POLL_INTERVAL": POLL_INTERVAL, "SHUTDOWN_GRACE": 5, "MAX_ATTEMPTS": None}
    results: dict[str, Any] = {"lease_ttl_s": LEASE_TTL, "poll_interval_s": POLL_INTERVAL, "repetitions": reps}
    with Cluster(ctx.db, folder, jobs, settings) as cluster:
        cluster.wait_ready(cluster.start(2))
        for name, sig, target in (
            ("sigkill", signal.SIGKILL, LEASE_TTL + POLL_INTERVAL),
            ("sigterm", signal.SIGTERM, POLL_INTERVAL + 0.5),
        ):
            ctx.log(f"failover: {reps} x {name}")
            samples = _repeat(ctx, cluster, sig, reps)
            latencies = [s["to_next_start_s"] for s in samples]
            results[name] = {
                "samples": samples,
                "median_s": round(stats.percentile(latencies, 50), 3),
                "max_s": round(max(latencies), 3),
                "target_s": target,
            }
            ctx.log(f"  median {results[name]['median_s']} s, max {results[name]['max_s']} s (target {target:g} s)")
    return results
