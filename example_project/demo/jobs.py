"""The example project's jobs: an interval job, a cron job with a timezone, and a long
job that saves its progress and honours its signal."""

from __future__ import annotations

import logging

from django_anarchon import Context, scheduler

logger = logging.getLogger("demo")


@scheduler.every("heartbeat", "10s")
def heartbeat(ctx: Context) -> None:
    """Every 10 seconds, on exactly one instance."""
    logger.info("heartbeat for %s on %s", ctx.scheduled_at.isoformat(), ctx.instance_id)


@scheduler.cron("paris-report", "*/2 * * * *", timezone="Europe/Paris", timeout="1m", alert_after="10m")
def paris_report(ctx: Context) -> None:
    """Every two minutes of Paris wall time; the slot makes the report window the same on every attempt."""
    window_end = ctx.slot
    window_start = window_end - 2 * 60_000
    logger.info("report for [%s, %s) in %s", window_start, window_end, ctx.data)


@scheduler.every("reindex", "5m", timeout="4m")
def reindex(ctx: Context) -> None:
    """A long job: 30 pages, one per second; a takeover resumes after the last saved page."""
    first = 0 if ctx.progress is None else ctx.progress + 1
    if ctx.attempt > 1:
        logger.warning("reindex %s: attempt %d (%s), resuming at page %d", ctx.slot, ctx.attempt, ctx.reason, first)
    for page in range(first, 30):
        ctx.sleep(1)  # raises Interrupted or TimeoutError as soon as the signal aborts
        ctx.save_progress(page)


@scheduler.every("sync-customers", "1m", data={"fail": False})
async def sync_customers(ctx: Context) -> None:
    """An async handler. `run_now("sync-customers", data={"fail": True})` shows the failure e-mail."""
    await ctx.asleep(0.5)
    if ctx.data.get("fail"):
        raise RuntimeError("the customer API answered 503")
