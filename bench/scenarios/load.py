"""6. Load at default settings: what a run costs, how late at defaults, how many jobs fit, overload.

Every anarchon figure here is measured with the default settings (``MAX_WORKERS`` 16,
``POLL_INTERVAL`` 1 s, ``LEASE_TTL`` 30 s) and real ``manage.py anarchon`` processes; the
references are APScheduler 3's BackgroundScheduler in one process, measured in the same run:

* **cost**: CPU per run of the scheduler processes (every thread but the benchmark's own
  probe, to the nanosecond from each thread's ``/proc`` schedstat) over the measured window, 100 jobs every second, a
  trivial handler, one instance against APScheduler with its default pool (10 threads). The
  CPU spent inside statements is measured apart (the probe's thread clock around each): on
  SQLite it is the database's own work, done in the process, which PostgreSQL and MariaDB do
  in their server, out of the figure;
* **lateness**: 100 jobs every second, 1 and 3 instances, with the trivial handler (against
  APScheduler's default pool) and with a handler that writes one row with the ORM (against
  APScheduler with the same handler and 16 threads, the default ``MAX_WORKERS``). Cost and
  lateness are measured in ``ROUNDS`` rounds, each reference and each configuration once per
  round, and each one's starts pooled over its rounds: the p99 of one window moved by ±15 %
  between back-to-back windows of the same code (the 99th percentile of 100 starts a second is
  set by a few slow seconds), and machine drift in one window fell on one side only;
* **capacity**: 3 instances and more and more 1 s jobs of the ORM handler: the share of slots
  started within 1 s of their slot, p99, CPU per run and duplicates; the capacity is the most
  jobs with at least 99.9 % on time and no duplicate. APScheduler with the same handler and 16
  threads is measured at the same counts on PostgreSQL;
* **overload**: twice that many jobs for a while, then most of them paused (the load drops):
  no slot may run twice, every slot must be run or recorded (skipped, missed) with a reason,
  and how soon after the drop the remaining jobs start on time again.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from bench import machine, recorder, stats
from bench.cluster import ROOT, Cluster, Instance
from bench.context import Context, reset_database, sleep_until

EVERY_MS = 1000
WARM_UP = 3  # whole seconds from "every instance is ready" to the first measured slot
ON_TIME_S = 1.0
ON_TIME_TARGET = 0.999
ROUNDS = 3  # cost and lateness: interleaved rounds, pooled (see the module's docstring)


def seconds(quick: bool) -> int:
    return 10 if quick else 30


def window(duration: int, warm_up: int = WARM_UP) -> tuple[int, int]:
    first = (math.ceil(time.time()) + warm_up) * 1000
    return first, first + duration * 1000


def _on_time(starts: list[recorder.Start], first: int, end: int, expected: int) -> float:
    """The share of the expected slots whose first start came within ON_TIME_S of the slot."""
    seen: dict[tuple[str, int], float] = {}
    for start in starts:
        if first <= start.slot_ms < end and start.reason != "manual":
            seen.setdefault((start.job, start.slot_ms), start.lateness)
    return round(sum(1 for late in seen.values() if late <= ON_TIME_S) / expected, 4) if expected else math.nan


def _summary(starts: list[recorder.Start], jobs: int, first: int, end: int, cpu_s: float) -> dict[str, Any]:
    result = stats.lateness(starts, jobs, EVERY_MS, first, end)
    result["on_time"] = _on_time(starts, first, end, result["expected"])
    result["cpu_s"] = round(cpu_s, 3)
    result["cpu_per_run_ms"] = round(cpu_s / result["runs"] * 1000, 3) if result["runs"] else math.nan
    result["_late_s"] = stats.first_latenesses(starts, first, end)  # for _pooled; not written out
    return result


def _pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rounds as one measurement: latenesses pooled, counts and CPU summed."""
    late = [s for r in rounds for s in r.pop("_late_s")]
    result = dict(rounds[0])
    for key in (
        "runs",
        "expected",
        "missing",
        "duplicates",
        "cpu_s",
        "db_cpu_s",
        "takeovers",
        "log_errors",
        "unaccounted",
    ):
        if key in result:
            result[key] = round(sum(r[key] for r in rounds), 3)
    for key in ("by_reason", "statuses"):
        if key in result:
            result[key] = dict(sum((Counter(r[key]) for r in rounds), Counter()))
    expected = result["expected"]
    result.update(stats.summary_ms(late))
    result["completeness"] = round(result["runs"] / expected, 4) if expected else math.nan
    result["on_time"] = round(sum(r["on_time"] * r["expected"] for r in rounds) / expected, 4) if expected else math.nan
    result["cpu_per_run_ms"] = round(result["cpu_s"] / result["runs"] * 1000, 3) if result["runs"] else math.nan
    if "db_cpu_s" in result:
        result["db_cpu_per_run_ms"] = (
            round(result["db_cpu_s"] / result["runs"] * 1000, 3) if result["runs"] else math.nan
        )
    result["rounds"] = len(rounds)
    result["p99_ms_by_round"] = [r["p99_ms"] for r in rounds]
    return result


def _cpu_marks(instances: list[Instance]) -> list[machine.CpuMark]:
    return [machine.cpu_mark(instance.pid) for instance in instances]


def _scheduler_cpu_s(instances: list[Instance], before: list[machine.CpuMark], after: list[machine.CpuMark]) -> float:
    """CPU seconds the instances used between two marks, less their probe threads' (see benchapp/probe.py)."""
    total = 0.0
    for instance, start, end in zip(instances, before, after, strict=True):
        probe = instance.probe() or {}
        total += machine.cpu_used_s(start, end, leave_out=[probe["probe_tid"]] if "probe_tid" in probe else [])
    return total


def _db_cpu(instances: list[Instance], after: float) -> tuple[float, float]:
    """CPU seconds the instances have spent inside statements, by their first probes written after ``after``,
    and the mean time of those probes (see benchapp/probe.py)."""
    probes = [instance.fresh_probe(after) for instance in instances]
    return sum(p.get("db_cpu", 0.0) for p in probes), sum(p["time"] for p in probes) / len(probes)


def apscheduler(ctx: Context, jobs: int, handler: str, workers: int, duration: int) -> dict[str, Any]:
    """The reference in its own process, with ``workers`` threads and the same handler."""
    folder = ctx.folder(f"load-aps-{handler}-{jobs}-{workers}")
    if handler == "orm":
        reset_database()
    first, end = window(duration, warm_up=WARM_UP + 2)  # its start-up (Django, APScheduler) takes a second
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.apscheduler_ref", "--jobs", str(jobs), "--every", str(EVERY_MS / 1000)]
        + ["--until", str(end / 1000 + 1.5), "--out", str(folder), "--workers", str(workers)]
        + ["--handler", handler, "--db", ctx.db],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    sleep_until(first / 1000)
    cpu_before = machine.cpu_mark(process.pid)
    sleep_until(end / 1000)
    cpu_after = machine.cpu_mark(process.pid)
    if process.wait(120) != 0:
        raise RuntimeError(f"the APScheduler reference exited with {process.returncode}")
    result = _summary(recorder.read(folder), jobs, first, end, machine.cpu_used_s(cpu_before, cpu_after))
    return {"what": f"APScheduler 3, 1 process, {workers} threads, {handler} handler", "jobs": jobs, **result}


def anarchon(
    ctx: Context, jobs: int, handler: str, instances: int, duration: int, pause_after: int | None = None
) -> dict[str, Any]:
    """``instances`` real instances with default settings; with ``pause_after`` (s), all but a tenth of the
    jobs are paused that long into the window (the load drops), and the recovery is measured."""
    from django.db.models import Count
    from django.db.models.functions import Now

    from django_anarchon.models import JobState, Run

    reset_database()
    folder = ctx.folder(f"load-{handler}-{jobs}-{instances}")
    width = len(str(jobs - 1))
    names = [f"load-{n:0{width}d}" for n in range(jobs)]
    kept = set(names[::10])  # still scheduled after the drop
    group = [{"prefix": "load", "count": jobs, "every": f"{EVERY_MS}ms", "kind": handler}]
    with Cluster(ctx.db, folder, group) as cluster:
        cluster.wait_ready(cluster.start(instances))
        first, end = window(duration)
        sleep_until(first / 1000)
        cpu_before = _cpu_marks(cluster.instances)
        db_before, db_from = _db_cpu(cluster.instances, first / 1000)
        dropped_at = None
        if pause_after is not None:
            sleep_until(first / 1000 + pause_after)
            # One statement (as an operator's bulk pause would be): pausing job by job takes
            # seconds on a machine this busy, and the load would drop only slowly.
            JobState.objects.filter(name__in=set(names) - kept).update(
                paused=True, paused_at=Now(), pause_note="benchmark: the load drops"
            )
            dropped_at = int(time.time() * 1000)
        sleep_until(end / 1000)
        cpu_after = _cpu_marks(cluster.instances)
        db_after, db_until = _db_cpu(cluster.instances, end / 1000)
        sleep_until(end / 1000 + 2.0)
        errors = sum(i.output().count(" ERROR ") for i in cluster.instances)
    starts = recorder.read(folder)
    result = _summary(starts, jobs, first, end, _scheduler_cpu_s(cluster.instances, cpu_before, cpu_after))
    # The probes' snapshots come every half second: their rate, over the window's length.
    db_cpu_s = (db_after - db_before) / max(db_until - db_from, 0.1) * (end - first) / 1000
    result["db_cpu_s"] = round(db_cpu_s, 3)
    result["db_cpu_per_run_ms"] = round(db_cpu_s / result["runs"] * 1000, 3) if result["runs"] else math.nan
    rows = Run.objects.filter(slot__gte=first, slot__lt=end, manual=False)
    result.update(
        {
            "instances": instances,
            "handler": handler,
            "jobs": jobs,
            "log_errors": errors,
            "takeovers": rows.filter(reason="takeover").count(),
            "statuses": dict(rows.filter(attempt=1).values_list("status").annotate(n=Count("id"))),
        }
    )
    result.update(_accounting(rows, names, first, end))
    if dropped_at is not None:
        late = [s.slot_ms for s in starts if s.job in kept and s.slot_ms >= dropped_at and s.lateness > ON_TIME_S]
        result["recovered_after_s"] = round(max(0, max(late, default=dropped_at) - dropped_at) / 1000, 1)
    return result


def _accounting(rows: Any, names: list[str], first: int, end: int) -> dict[str, int]:
    """Every slot in the window: run, or recorded with a reason (a row, or a ``missed`` record's range)?

    A paused job's slots leave no row (they are not run): those from its pause on, and those still
    undecided when it was paused (no later slot of the job decided before the pause) are counted
    apart, ``paused_undecided``. Anything else with no record is ``unaccounted``.
    """
    from django_anarchon.models import JobState

    have = set()
    decided: dict[str, list[int]] = {}
    for job, slot, status, detail in rows.filter(attempt=1).values_list("job", "slot", "status", "detail"):
        have.add((job, slot))
        decided.setdefault(job, []).append(slot)
        if status == "missed" and (count := detail.split(" ", 1)[0]).isdigit():
            have.update((job, slot - n * EVERY_MS) for n in range(int(count)))
    paused_at = {
        name: int(at.timestamp() * 1000)
        for name, at in JobState.objects.filter(paused=True, name__in=names).values_list("name", "paused_at")
    }
    unaccounted = paused_undecided = 0
    for name in names:
        for slot in range(first, end, EVERY_MS):
            if (name, slot) in have:
                continue
            at = paused_at.get(name)
            if at is not None and (slot >= at or not any(slot < d < at for d in decided.get(name, ()))):
                paused_undecided += slot < at
                continue
            unaccounted += 1
    return {"unaccounted": unaccounted, "paused_undecided": paused_undecided}


def run(ctx: Context) -> dict[str, Any]:
    duration = seconds(ctx.quick)
    results: dict[str, Any] = {"every_s": EVERY_MS / 1000, "on_time_within_s": ON_TIME_S}
    # Cost and lateness at the defaults, 100 jobs: the references and ours in turn, ROUNDS times.
    configs = [("record", 1), ("record", 3), ("orm", 1), ("orm", 3)]
    references: dict[str, list[dict[str, Any]]] = {"record": [], "orm": []}
    ours: dict[tuple[str, int], list[dict[str, Any]]] = {config: [] for config in configs}
    each = max(duration // ROUNDS, 5)
    for round_ in range(1, ROUNDS + 1):
        ctx.log(f"load: round {round_} of {ROUNDS}: APScheduler (trivial handler, 10 threads; ORM handler, 16)")
        references["record"].append(apscheduler(ctx, 100, "record", 10, each))
        references["orm"].append(apscheduler(ctx, 100, "orm", 16, each))
        for handler, instances in configs:
            measured = anarchon(ctx, 100, handler, instances, each)
            ctx.log(
                f"  100 jobs, {handler} handler, {instances} instance(s): p99 {measured['p99_ms']} ms "
                f"(APScheduler {references[handler][-1]['p99_ms']} ms), on time {measured['on_time']:.2%}, "
                f"CPU/run {measured['cpu_per_run_ms']} ms"
            )
            ours[(handler, instances)].append(measured)
    results["reference_record"] = _pooled(references["record"])
    results["reference_orm"] = _pooled(references["orm"])
    results["lateness"] = [_pooled(ours[config]) for config in configs]
    # Capacity: more and more jobs of the ORM handler on three instances.
    counts = (100, 200, 400) if ctx.quick else (100, 200, 300, 400, 600)
    if not ctx.primary:
        counts = counts[:3]
    results["capacity"] = []
    for jobs in counts:
        ctx.log(f"load: capacity, {jobs} jobs, orm handler, 3 instances")
        measured = anarchon(ctx, jobs, "orm", 3, duration)
        measured.pop("_late_s")
        ctx.log(f"  on time {measured['on_time']:.2%}, p99 {measured['p99_ms']} ms, dup {measured['duplicates']}")
        results["capacity"].append(measured)
        if measured["on_time"] < 0.9:
            break  # far past capacity: the next count says nothing more
    fitting = [m["jobs"] for m in results["capacity"] if m["on_time"] >= ON_TIME_TARGET and not m["duplicates"]]
    results["capacity_jobs"] = max(fitting, default=0)
    if ctx.primary:
        results["reference_capacity"] = []
        for jobs in counts[:3]:
            ctx.log(f"load: APScheduler, {jobs} jobs, orm handler, 16 threads")
            reference = apscheduler(ctx, jobs, "orm", 16, duration)
            reference.pop("_late_s")
            results["reference_capacity"].append(reference)
    # Overload: twice the capacity, then the load drops.
    heavy = max(2 * results["capacity_jobs"], 200)
    ctx.log(f"load: overload, {heavy} jobs, orm handler, 3 instances, most paused after {duration // 2}s")
    results["overload"] = anarchon(ctx, heavy, "orm", 3, duration, pause_after=duration // 2)
    results["overload"].pop("_late_s")
    over = results["overload"]
    ctx.log(
        f"  duplicates {over['duplicates']}, unaccounted {over['unaccounted']}, takeovers {over['takeovers']}, "
        f"recovered after {over.get('recovered_after_s')} s"
    )
    return results


__all__ = ["run", "seconds"]
