"""The benchmark's jobs, declared from ``ANARCHON_BENCH_JOBS`` (see :mod:`bench.jobset`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench import jobset
from bench.recorder import record
from django_anarchon import Context, scheduler


def handler_for(spec: jobset.JobSpec) -> Callable[[Context], Any]:
    if spec.kind == "record":

        def handler(ctx: Context) -> None:
            record(ctx.name, ctx.slot, time.time(), ctx.attempt, ctx.reason)

    elif spec.kind == "orm":
        from bench.benchapp.models import Tick

        def handler(ctx: Context) -> None:
            record(ctx.name, ctx.slot, time.time(), ctx.attempt, ctx.reason)
            Tick.objects.create(job=ctx.name, slot=ctx.slot)  # what real handlers do: a row written

    elif spec.kind == "sleep":
        seconds = spec.seconds

        def handler(ctx: Context) -> None:
            record(ctx.name, ctx.slot, time.time(), ctx.attempt, ctx.reason)
            ctx.sleep(seconds)  # raises Interrupted when the signal aborts

    else:
        raise ValueError(f"unknown benchmark job kind {spec.kind!r}")
    return handler


jobset.declare(scheduler, jobset.from_env(), handler_for)
