"""Counters inside a measured ``manage.py anarchon`` process, dumped to a JSON file.

* every SQL statement sent on any of the process's connections (via Django's
  ``execute_wrappers``, installed on each connection as it is created), by kind, and the CPU
  time the process spent inside them (on SQLite, the database's own work);
* every claiming transaction (:func:`django_anarchon.store.decide`): claims sent,
  won, skipped, deferred; the rest were decided by someone else (lost);
* when the scheduler finished its start-up, CPU seconds and RSS;
* the probe's own thread (its native id and CPU seconds), which the scenarios take off the
  process's CPU: the measured instance pays for counting and dumping, the references do not.

The file ``probe-<pid>.json`` is rewritten (atomically) every half second. The
counting costs a Python call and two reads of the thread's CPU clock per statement, nothing
on the database.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

_TABLE = re.compile(r'(?:FROM|INTO|UPDATE)\s+[`"]?(\w+)', re.IGNORECASE)
# A statement's kind is read off its start: a claim of a hundred slots is a long text, and
# scanning all of it cost the measured instance more than the count was worth.
KIND_PREFIX = 200
_lock = threading.Lock()
_probe_cpu = 0.0  # CPU seconds the probe's thread has used, as of its last snapshot
# CPU seconds the process's threads spent inside statements (Django's cursor call and the driver's
# execute): on SQLite the database's own work, which PostgreSQL and MariaDB do in their server.
_db_cpu = 0.0
queries: Counter[str] = Counter()
decide: Counter[str] = Counter()


def kind(sql: str) -> str:
    """A short name for a statement: its verb and first table (``SELECT django_anarchon_run``)."""
    words = sql.split(None, 1)
    verb = words[0].upper() if words else "?"
    table = _TABLE.search(sql)
    return f"{verb} {table.group(1)}" if table else verb


def _count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
    global _db_cpu
    counted = kind(sql[:KIND_PREFIX])
    before = time.thread_time()
    try:
        return execute(sql, params, many, context)
    finally:
        took = time.thread_time() - before
        with _lock:
            queries[counted] += 1
            _db_cpu += took


def _on_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    if _count not in connection.execute_wrappers:
        connection.execute_wrappers.append(_count)


def _wrap_decide() -> None:
    from django_anarchon import store

    original = store.decide

    def counted(claims: Any, catch_ups: Any = (), **kwargs: Any) -> Any:
        outcome = original(claims, catch_ups, **kwargs)
        with _lock:
            decide["calls"] += 1
            decide["claims"] += len(claims)
            decide["won"] += len(outcome.won)
            decide["skipped"] += len(outcome.skipped)
            decide["deferred"] += len(outcome.deferred)
        return outcome

    store.decide = counted


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def snapshot() -> dict[str, Any]:
    from django_anarchon import scheduler

    times = os.times()
    with _lock:
        counts = dict(queries)
        decided = dict(decide)
    return {
        "pid": os.getpid(),
        "time": time.time(),
        "ready": scheduler.wait_started(0),
        "queries": sum(counts.values()),
        "kinds": counts,
        "decide": decided,
        "cpu": times.user + times.system,
        "rss_kb": _rss_kb(),
        "probe_tid": threading.get_native_id(),
        "probe_cpu": _probe_cpu,
        "db_cpu": _db_cpu,
    }


def _dump(folder: Path) -> None:
    path = folder / f"probe-{os.getpid()}.json"
    temporary = path.with_suffix(".tmp")
    ready_at: float | None = None
    global _probe_cpu
    while True:
        _probe_cpu = time.thread_time()
        data = snapshot()
        if data["ready"] and ready_at is None:
            ready_at = data["time"]
        data["ready_at"] = ready_at
        temporary.write_text(json.dumps(data))
        temporary.replace(path)
        time.sleep(0.05 if ready_at is None else 0.5)


def install(folder: str) -> None:
    from django.db.backends.signals import connection_created

    connection_created.connect(_on_connection, weak=False)
    _wrap_decide()
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_dump, args=(target,), name="bench-probe", daemon=True).start()
