"""Signals sent around runs. Connect receivers with ``@receiver(run_failed)``.

Every signal is sent with ``sender=Run`` (the model class) and, but for
``job_overdue``, ``run=<Run>``, the run's record; the failure and interruption
signals add ``exception`` (the exception that ended the run, or None when
another instance recorded it).
A receiver that raises is logged on the ``django_anarchon`` logger and never
breaks the scheduler.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

logger = logging.getLogger("django_anarchon")

# A run's handler is about to start. Sent with: run.
run_started = Signal()
# The handler returned. Sent with: run.
run_succeeded = Signal()
# The handler raised, or ran past its timeout. Sent with: run, exception.
run_failed = Signal()
# The run was stopped (stop(), takeover, replace) and, after stop(), handed over. Sent with: run, exception.
run_interrupted = Signal()
# A slot was not run because the job's previous run still ran (or the job is paused). Sent with: run.
run_skipped = Signal()
# This instance took over a run whose runner stopped renewing its lease. Sent with: run (the new attempt).
run_taken_over = Signal()
# Slots nobody ran while the whole cluster was down were recorded missed (one record per job and
# outage; its detail says how many and when). Sent with: run (the missed record).
run_missed = Signal()
# A job declared with alert_after has had no successful run for that long. Sent once per lapse,
# by one instance of the cluster. Sent with: job (its name), last_success (datetime or None),
# without_success (timedelta since the last success, or since the job was first seen).
job_overdue = Signal()


def send(signal: Signal, **kwargs: Any) -> None:
    """Send ``signal`` robustly: a failing receiver is logged, the rest still run."""
    if not signal.receivers:
        return  # nobody connected: a run's start costs nothing more
    from .models import Run

    for receiver, result in signal.send_robust(sender=Run, **kwargs):
        if isinstance(result, Exception):
            run = kwargs.get("run")
            logger.error(
                "Signal receiver %r raised %s: %s",
                receiver,
                type(result).__name__,
                result,
                exc_info=(type(result), result, result.__traceback__),
                extra={"job": getattr(run, "job", None), "receiver": repr(receiver)},
            )
