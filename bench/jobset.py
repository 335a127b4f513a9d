"""Sets of benchmark jobs, described as JSON so that every process declares the same ones.

``ANARCHON_BENCH_JOBS`` holds a list of groups, each one of:

* ``{"prefix": "late", "count": 100, "every": "1s", "kind": "record"}``: ``count`` interval jobs;
* ``{"prefix": "mix", "count": 10000, "mixed": true}``: a mix of interval and cron jobs
  (hourly to monthly) in many timezones, all firing at most once an hour.

Extra keys (``overlap``, ``catch_up``, ``timeout``) are passed to the declaration.
``kind`` is ``record`` (record the start and return), ``orm`` (record the start, then write
one row with the ORM, as real handlers do) or ``sleep`` (record the start, then sleep
``seconds`` honouring ``ctx.signal``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

ENV = "ANARCHON_BENCH_JOBS"

TIMEZONES = (
    "UTC", "Europe/Paris", "Europe/London", "Europe/Berlin", "Europe/Moscow", "Europe/Istanbul",
    "America/New_York", "America/Chicago", "America/Denver", "America/Los_Angeles", "America/Sao_Paulo",
    "America/Mexico_City", "America/Toronto", "America/Santiago", "America/St_Johns", "Asia/Tokyo",
    "Asia/Shanghai", "Asia/Kolkata", "Asia/Kathmandu", "Asia/Dubai", "Asia/Singapore", "Asia/Tehran",
    "Asia/Jakarta", "Australia/Sydney", "Australia/Adelaide", "Australia/Perth", "Australia/Lord_Howe",
    "Pacific/Auckland", "Pacific/Chatham", "Pacific/Honolulu", "Africa/Cairo", "Africa/Johannesburg",
    "Africa/Lagos", "Atlantic/Azores", "America/Havana", "Europe/Dublin", "Asia/Gaza", "America/Asuncion",
    "Pacific/Apia", "Antarctica/Troll",
)  # fmt: skip
INTERVALS = ("1h", "2h", "4h", "6h", "8h", "12h", "1d", "1h30m")


@dataclass(frozen=True)
class JobSpec:
    """One job to declare: ``every`` or ``cron`` (with ``timezone``), a handler kind, options."""

    name: str
    every: str | None = None
    cron: str | None = None
    kind: str = "record"
    seconds: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)


def mixed(prefix: str, count: int) -> Iterator[JobSpec]:
    """``count`` jobs: half interval (1 h to 1 d), half cron (hourly to monthly) in 40 timezones."""
    for i in range(count):
        name = f"{prefix}-{i:06d}"
        if i % 2 == 0:
            yield JobSpec(name, every=INTERVALS[(i // 2) % len(INTERVALS)])
            continue
        minute, hour, tz = (i * 7) % 60, (i // 3) % 24, TIMEZONES[(i // 2) % len(TIMEZONES)]
        expression = (
            f"{minute} * * * *",
            f"{minute} {hour} * * *",
            f"{minute} {hour} * * {i % 7}",
            f"{minute} {hour} {1 + i % 28} * *",
            f"{minute} {hour} * * 1-5",
        )[(i // 2) % 5]
        yield JobSpec(name, cron=expression, options={"timezone": tz})


def expand(groups: list[dict[str, Any]]) -> list[JobSpec]:
    """Every job of ``groups`` (see the module docstring)."""
    specs: list[JobSpec] = []
    for raw in groups:
        group = dict(raw)
        prefix, count = group.pop("prefix"), int(group.pop("count"))
        if group.pop("mixed", False):
            specs.extend(mixed(prefix, count))
            continue
        every = group.pop("every")
        kind, seconds = group.pop("kind", "record"), float(group.pop("seconds", 0.0))
        width = len(str(count - 1))
        specs.extend(
            JobSpec(f"{prefix}-{i:0{width}d}", every=every, kind=kind, seconds=seconds, options=dict(group))
            for i in range(count)
        )
    return specs


def from_env() -> list[JobSpec]:
    return expand(json.loads(os.environ.get(ENV, "[]")))


def declare(scheduler: Any, specs: list[JobSpec], handler_for: Callable[[JobSpec], Callable[..., Any]]) -> None:
    """Declare ``specs`` on ``scheduler`` (a :class:`django_anarchon.Scheduler`)."""
    for spec in specs:
        handler = handler_for(spec)
        if spec.every is not None:
            scheduler.every(spec.name, spec.every, handler, **spec.options)
        else:
            scheduler.cron(spec.name, spec.cron, handler, **spec.options)
