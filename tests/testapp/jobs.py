"""Jobs for the process tests, declared from the ANARCHON_TEST_JOBS environment variable.

ANARCHON_TEST_JOBS is a JSON list of {"name", "every" | "cron", "kind", "seconds", options...}.
A "fail" job raises ValueError(spec["message"]) when one is given.
Kind "task" declares a task job whose "task" names a task in tests/testapp/tasks.py.
Kinds: record, gc (records how many objects start-up froze), sleep (honours the signal), stubborn
(ignores it), fail, checkpoint, async_sleep, async_stubborn (blocks in sync_to_async, ignoring the
signal).
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any

from django_anarchon import Context, scheduler


def record(ctx: Context, event: str, note: str = "") -> None:
    """Log what the handler did: in the Execution table and, when the fault tests ask
    (ANARCHON_TEST_EVENTS names a directory), in a file that survives a database outage."""

    events = os.environ.get("ANARCHON_TEST_EVENTS")
    if events:
        line = {
            "job": ctx.name,
            "slot": ctx.slot,
            "attempt": ctx.attempt,
            "reason": ctx.reason,
            "instance": ctx.instance_id,
            "pid": os.getpid(),
            "event": event,
            "at": time.time(),
            # The host's monotonic clock, which a test's libfaketime leaves alone: the true time of the event.
            "mono": time.monotonic(),
            "note": note,
        }
        with open(os.path.join(events, f"{os.getpid()}.jsonl"), "a") as handle:
            handle.write(json.dumps(line) + "\n")
        try:
            _store(ctx, event, note)
        except Exception:  # the database may be down: the file has it
            from django.db import connection

            connection.close()
        return
    _store(ctx, event, note)


def _store(ctx: Context, event: str, note: str) -> None:
    from .models import Execution

    Execution.objects.create(
        job=ctx.name,
        slot=ctx.slot,
        attempt=ctx.attempt,
        reason=ctx.reason,
        manual=ctx.manual,
        instance_id=ctx.instance_id,
        pid=os.getpid(),
        event=event,
        at=time.time(),
        data=ctx.data,
        progress=ctx.progress,
        note=note,
    )


def make_handler(kind: str, seconds: float, steps: int, message: str = "") -> Any:
    if kind == "record":

        def handler(ctx: Context) -> None:
            record(ctx, "start")

    elif kind == "gc":

        def handler(ctx: Context) -> None:
            record(ctx, "start", note=str(gc.get_freeze_count()))

    elif kind == "sleep":

        def handler(ctx: Context) -> None:
            record(ctx, "start")
            try:
                ctx.sleep(seconds)
            except BaseException as error:
                record(ctx, "aborted", repr(error))
                raise
            record(ctx, "end")

    elif kind == "stubborn":

        def handler(ctx: Context) -> None:
            record(ctx, "start")
            time.sleep(seconds)
            record(ctx, "end", f"aborted={ctx.signal.aborted}")

    elif kind == "fail":

        def handler(ctx: Context) -> None:
            record(ctx, "start")
            raise ValueError(message or f"boom in {ctx.name}")

    elif kind == "checkpoint":

        def handler(ctx: Context) -> None:
            record(ctx, "start")
            first = (ctx.progress or 0) + (1 if ctx.progress is not None else 0)
            try:
                for step in range(first, steps):
                    ctx.sleep(seconds)
                    ctx.save_progress(step)
                    record(ctx, "checkpoint", str(step))
            except BaseException as error:
                record(ctx, "aborted", repr(error))
                raise
            record(ctx, "end")

    elif kind == "async_sleep":

        async def handler(ctx: Context) -> None:
            from asgiref.sync import sync_to_async

            await sync_to_async(record)(ctx, "start")
            try:
                await ctx.asleep(seconds)
            except BaseException as error:
                await sync_to_async(record)(ctx, "aborted", repr(error))
                raise
            await sync_to_async(record)(ctx, "end")

    elif kind == "async_stubborn":

        async def handler(ctx: Context) -> None:
            from asgiref.sync import sync_to_async

            await sync_to_async(record)(ctx, "start")
            await sync_to_async(time.sleep)(seconds)  # blocking work that ignores the signal
            await sync_to_async(record)(ctx, "end", f"aborted={ctx.signal.aborted}")

    else:
        raise ValueError(f"unknown test job kind {kind!r}")
    return handler


for spec in json.loads(os.environ.get("ANARCHON_TEST_JOBS", "[]")):
    spec = dict(spec)
    name = spec.pop("name")
    if spec.get("kind") == "task":  # a task job: {"kind": "task", "task": "<name in tasks.py>"}
        from . import tasks

        spec.pop("kind")
        spec["task"] = getattr(tasks, spec["task"])
        if "every" in spec:
            scheduler.every(name, spec.pop("every"), **spec)
        else:
            scheduler.cron(name, spec.pop("cron"), **spec)
        continue
    handler = make_handler(
        spec.pop("kind", "record"), spec.pop("seconds", 0.0), spec.pop("steps", 0), spec.pop("message", "")
    )
    if "every" in spec:
        scheduler.every(name, spec.pop("every"), handler, **spec)
    else:
        scheduler.cron(name, spec.pop("cron"), handler, **spec)


def note_overdue(sender: Any, job: str, without_success: Any = None, **kwargs: Any) -> None:
    """Process tests count job_overdue alerts: one row per alert, whichever instance sent it."""
    from .models import Execution

    Execution.objects.create(
        job=job, slot=0, attempt=0, reason="", instance_id=os.environ.get("ANARCHON_TEST_INSTANCE", ""),
        pid=os.getpid(), event="overdue", at=time.time(), note=str(without_success),
    )  # fmt: skip


if os.environ.get("ANARCHON_TEST_CHILD"):
    from django_anarchon.signals import job_overdue

    job_overdue.connect(note_overdue, weak=False)
