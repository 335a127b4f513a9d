"""1. Lateness: handler start minus slot, for 100 jobs every 1 s.

anarchon with 1, 3 and 6 ``manage.py anarchon`` instances, against APScheduler 3's
BackgroundScheduler in one process with the same jobs (the reference, no coordination),
both recording with :func:`bench.recorder.record`.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import recorder, stats
from bench.cluster import ROOT, Cluster
from bench.context import Context, reset_database, sleep_until

JOBS = 100
EVERY_MS = 1000
WARM_UP = 3  # whole seconds between "every instance is ready" and the first measured slot


def seconds(quick: bool) -> int:
    return 15 if quick else 60


def window(duration: int) -> tuple[int, int]:
    """First and end (excluded) slot of a measured window that starts a few seconds from now."""
    first = (math.ceil(time.time()) + WARM_UP) * 1000
    return first, first + duration * 1000


def apscheduler(folder: Path, duration: int) -> dict[str, Any]:
    """The reference, measured in its own process (see :mod:`bench.apscheduler_ref`)."""
    first, end = window(duration)
    first += 2000  # its start-up takes ~1 s; start measuring after it
    end += 2000
    subprocess.run(
        [sys.executable, "-m", "bench.apscheduler_ref", "--jobs", str(JOBS), "--every", str(EVERY_MS / 1000)]
        + ["--until", str(end / 1000 + 1.5), "--out", str(folder)],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    result = stats.lateness(recorder.read(folder), JOBS, EVERY_MS, first, end)
    return {"what": "APScheduler 3 BackgroundScheduler, 1 process, 16 threads", "seconds": duration, **result}


def anarchon(ctx: Context, instances: int, duration: int, settings: dict[str, Any]) -> dict[str, Any]:
    reset_database()
    folder = ctx.folder(f"lateness-{instances}-{settings.get('MAX_WORKERS', 'default')}")
    jobs = [{"prefix": "late", "count": JOBS, "every": f"{EVERY_MS}ms"}]
    with Cluster(ctx.db, folder, jobs, settings) as cluster:
        cluster.wait_ready(cluster.start(instances))
        first, end = window(duration)
        sleep_until(end / 1000 + 1.5)
        errors = sum(i.output().count(" ERROR ") for i in cluster.instances)
    result = stats.lateness(recorder.read(folder), JOBS, EVERY_MS, first, end)
    return {"instances": instances, "seconds": duration, "settings": settings, "log_errors": errors, **result}


def run(ctx: Context) -> dict[str, Any]:
    duration = seconds(ctx.quick) if ctx.primary else seconds(ctx.quick) // 3
    counts = (1, 3, 6) if ctx.primary else (3,)
    results: dict[str, Any] = {"jobs": JOBS, "every_s": EVERY_MS / 1000, "runs": []}
    # MAX_WORKERS must cover the 100 runs due at once, or the engine defers (and drops) the rest;
    # one extra run with the default (16) shows what that costs.
    plan = [(count, duration, {"MAX_WORKERS": JOBS}) for count in counts]
    if ctx.primary:
        plan.append((1, min(duration, 20), {}))
    for count, length, settings in plan:
        ctx.log(f"lateness: {count} instance(s), {length}s, settings {settings or 'default'}")
        measured = anarchon(ctx, count, length, settings)
        ctx.log(
            f"  p50 {measured['p50_ms']} ms, p99 {measured['p99_ms']} ms, max {measured['max_ms']} ms, "
            f"completeness {measured['completeness']}"
        )
        results["runs"].append(measured)
    return results
