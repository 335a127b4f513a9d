"""5. Scale: 1k, 10k and 100k declared jobs (mixed interval and cron, 40 timezones).

In this process, with the engine's own code: declaring the jobs, building the heap of next
slots (what :meth:`Engine._startup` does), and the cost per fire of the loop's scheduling
step (pop the heap, :func:`plan_due`, push the next slot), timed over the next fires in
order. The heap makes a fire O(log n); the schedule maths is O(1) in n, so the cost per
fire should barely move from 1k to 100k jobs.

In a real ``manage.py anarchon`` with 10,000 jobs: start-up time (first start on an empty
database, and a restart), RSS, CPU seconds per minute and statements per second when idle.
"""

from __future__ import annotations

import gc
import heapq
import time
from pathlib import Path
from typing import Any

from bench import jobset, recorder
from bench.cluster import Cluster
from bench.context import Context, reset_database
from django_anarchon import Scheduler
from django_anarchon.slots import plan_due

FIRES = 5000
MAX_FIRES = 60_000


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _noop(ctx: Any) -> None:
    """Never called."""


def in_process(count: int) -> dict[str, Any]:
    gc.collect()
    rss = _rss_kb()
    scheduler = Scheduler()
    started = time.perf_counter()
    jobset.declare(scheduler, list(jobset.mixed("scale", count)), lambda spec: _noop)
    declared = time.perf_counter() - started
    jobs = {job.name: job for job in scheduler.jobs}
    grace_ms = 2000
    now = int(time.time() * 1000)

    started = time.perf_counter()
    heap = [(job.schedule.next_after(now - grace_ms - 1), name) for name, job in jobs.items()]
    heapq.heapify(heap)
    built = time.perf_counter() - started
    next_slot = {name: slot for slot, name in heap}

    fire_total = heap_total = 0.0
    by_kind: dict[str, list[float]] = {"interval": [], "cron": []}
    fires = 0
    # Time fires in order until both kinds have enough samples (with 100k jobs the next
    # thousands of fires may all be cron ones, until the next whole hour).
    while fires < MAX_FIRES and (fires < FIRES or min(len(v) for v in by_kind.values()) < FIRES // 5):
        fires += 1
        t0 = time.perf_counter()
        slot, name = heapq.heappop(heap)
        t1 = time.perf_counter()
        job = jobs[name]
        plan = plan_due(job.schedule, next_slot[name], slot, grace_ms)
        next_slot[name] = plan.next_slot
        t2 = time.perf_counter()
        heapq.heappush(heap, (plan.next_slot, name))
        t3 = time.perf_counter()
        fire_total += t3 - t0
        heap_total += (t1 - t0) + (t3 - t2)
        by_kind[job.schedule.kind].append(t3 - t0)
    kinds = {"interval": [j for j in jobs.values() if j.schedule.kind == "interval"][:200]}
    kinds["cron"] = [j for j in jobs.values() if j.schedule.kind == "cron"][:200]
    next_after_us = {}
    for kind, sample in kinds.items():
        t0 = time.perf_counter()
        for job in sample:
            job.schedule.next_after(now + 12_345)
        next_after_us[kind] = round((time.perf_counter() - t0) / len(sample) * 1e6, 1)
    return {
        "jobs": count,
        "declare_s": round(declared, 3),
        "declare_us_per_job": round(declared / count * 1e6, 1),
        "heap_build_s": round(built, 3),
        "fires": fires,
        "per_fire_us": round(fire_total / fires * 1e6, 2),
        "heap_op_us": round(heap_total / fires * 1e6, 3),
        "per_fire_us_by_kind": {k: round(sum(v) / len(v) * 1e6, 2) for k, v in by_kind.items() if v},
        "fires_by_kind": {k: len(v) for k, v in by_kind.items()},
        "next_after_us": next_after_us,
        "rss_growth_mb": round((_rss_kb() - rss) / 1024, 1),
    }


def real(ctx: Context, seconds: int) -> dict[str, Any]:
    reset_database()
    folder = ctx.folder("scale")
    jobs = [{"prefix": "mix", "count": 10_000, "mixed": True}]
    result: dict[str, Any] = {"jobs": 10_000}
    with Cluster(ctx.db, folder, jobs) as cluster:
        (first,) = cluster.start(1)
        cluster.wait_ready([first], timeout=300)
        result["first_start_s"] = round(first.probe()["ready_at"] - first.spawned, 2)  # type: ignore[index]
        cluster.stop()
        (instance,) = cluster.start(1)
        cluster.wait_ready([instance], timeout=300)
        result["restart_s"] = round(instance.probe()["ready_at"] - instance.spawned, 2)  # type: ignore[index]
        time.sleep(2)
        before = instance.fresh_probe(time.time())
        time.sleep(seconds)
        after = instance.fresh_probe(time.time())
    elapsed = after["time"] - before["time"]
    fires = [s for s in recorder.read(folder) if before["time"] <= s.start <= after["time"]]
    result.update(
        {
            "seconds": round(elapsed, 1),
            "rss_mb": round(after["rss_kb"] / 1024, 1),
            "cpu_s_per_min": round((after["cpu"] - before["cpu"]) / elapsed * 60, 3),
            "queries_per_s": round((after["queries"] - before["queries"]) / elapsed, 3),
            "fires": len(fires),
        }
    )
    return result


def run(ctx: Context) -> dict[str, Any]:
    results: dict[str, Any] = {"fires_timed": FIRES, "in_process": []}
    if ctx.primary:
        for count in (1_000, 10_000, 100_000):
            ctx.log(f"scale: {count} jobs in process")
            measured = in_process(count)
            ctx.log(f"  {measured['per_fire_us']} us per fire, declared in {measured['declare_s']} s")
            results["in_process"].append(measured)
    if not ctx.primary:
        return results  # start-up, RSS and idle CPU of 10,000 jobs barely depend on the database
    seconds = 15 if ctx.quick else 60
    ctx.log(f"scale: manage.py anarchon with 10,000 jobs, {seconds}s idle")
    results["process"] = real(ctx, seconds)
    ctx.log(
        "  start-up {first_start_s} s (restart {restart_s} s), RSS {rss_mb} MB, {cpu_s_per_min} CPU s/min".format(
            **results["process"]
        )
    )
    return results
