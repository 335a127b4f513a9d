"""The lateness reference: APScheduler 3's BackgroundScheduler, one process, no coordination.

Runs ``--jobs`` jobs every ``--every`` seconds (slots aligned to the epoch, like anarchon's)
until ``--until`` (epoch seconds), with a ``--workers`` thread pool (APScheduler's default is
10), and records each start with :func:`bench.recorder.record`, the function the anarchon
handlers use. With ``--handler orm --db postgres`` each run also writes one row with the
Django ORM, as the anarchon ``orm`` handler does (Django set up with the benchmark's settings;
APScheduler's threads keep their connections, as threads do unless told otherwise). APScheduler does
not hand the scheduled time to the job, so ``run_job`` is wrapped to put it in a
thread-local first (a few attribute writes before the handler is called).

    python -m bench.apscheduler_ref --jobs 100 --every 1 --until 1767225600 --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from datetime import datetime, timezone
from typing import Any

from apscheduler.executors import pool
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from bench import recorder

_local = threading.local()
_run_job = pool.run_job


def _run_job_with_slot(job: Any, jobstore_alias: str, run_times: list[datetime], logger_name: str) -> list[Any]:
    events = []
    for run_time in run_times:
        _local.slot_ms = round(run_time.timestamp() * 1000)
        events.extend(_run_job(job, jobstore_alias, [run_time], logger_name))
    return events


def handler(name: str) -> None:
    start = time.time()
    recorder.record(name, _local.slot_ms, start)


def orm_handler(name: str) -> None:
    from bench.benchapp.models import Tick

    start = time.time()
    recorder.record(name, _local.slot_ms, start)
    Tick.objects.create(job=name, slot=_local.slot_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--until", type=float, required=True)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--handler", choices=["record", "orm"], default="record")
    parser.add_argument("--db", default="postgres", help="with --handler orm: the benchmark database")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ[recorder.ENV] = args.out
    job = handler
    if args.handler == "orm":
        os.environ.update({"DJANGO_SETTINGS_MODULE": "bench.settings", "ANARCHON_BENCH_DB": args.db})
        import django

        django.setup()
        job = orm_handler
    pool.run_job = _run_job_with_slot  # type: ignore[assignment]

    scheduler = BackgroundScheduler(
        executors={"default": ThreadPoolExecutor(args.workers)},
        job_defaults={"misfire_grace_time": 30, "coalesce": False, "max_instances": 1},
        timezone=timezone.utc,
    )
    aligned = datetime.fromtimestamp(int(time.time()) - 10, tz=timezone.utc)
    width = len(str(args.jobs - 1))
    for i in range(args.jobs):
        name = f"late-{i:0{width}d}"
        trigger = IntervalTrigger(seconds=args.every, start_date=aligned, timezone=timezone.utc)
        scheduler.add_job(job, trigger, args=[name], id=name)
    scheduler.start()
    print("ready", flush=True)
    time.sleep(max(0.0, args.until - time.time()))
    scheduler.shutdown(wait=True)


if __name__ == "__main__":
    main()
