"""Holding runs: lease renewal, and a watchdog that fences and times out runs.

Two threads of an :class:`Engine`: the renewal thread extends the leases of
every run this process holds in one UPDATE; the watchdog never touches the
database, so that a renewal hanging on a slow or unreachable database cannot
delay the moment a runner gives its runs up.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

from django.db import DatabaseError, connections

from . import store
from .exceptions import Interrupted
from .models import Status
from .runner import ActiveRun, describe_loss, timeout_error

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger("django_anarchon")


class Keeper:
    """Renews, fences and times out the runs an engine holds."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stopped = threading.Event()
        self.renew_wake = threading.Event()
        self.watch_wake = threading.Event()

    def wake(self) -> None:
        """A run was adopted or a deadline set: look again now."""
        self.renew_wake.set()
        self.watch_wake.set()

    def stop(self) -> None:
        self.stopped.set()
        self.wake()

    def run_renewals(self) -> None:
        """Extend leases as they age: each run's at most ``renew_every`` after its claim or last renewal.

        A run is renewed once its lease is ``renew_every`` old, together with
        every other run whose lease is at least half that old, so that runs of
        different ages still share one UPDATE. A run that ends within
        ``renew_every`` of its claim (most do) is never renewed: renewing the
        runs just claimed, as every claim used to trigger, cost an UPDATE a
        slot for nothing.
        """
        every = self.engine.settings.renew_every
        retry_at = 0.0
        failing_since: float | None = None

        def held_runs() -> list[ActiveRun]:
            return [a for a in self.engine.active_runs() if a.state != "done"]

        def due(held: list[ActiveRun]) -> float:
            """When the oldest of ``held`` leases is due (a failed renewal: retried no sooner than ``retry_at``)."""
            return max(min(a.renewed_at for a in held) + every, retry_at) if held else math.inf

        try:
            while not self.stopped.is_set():
                now = time.monotonic()
                held = held_runs()
                if now >= due(held):
                    held = [a for a in held if now - a.renewed_at >= every / 2]
                    sent = time.monotonic()
                    try:
                        kept, lost = store.renew(
                            [a.run.id for a in held], owner=self.engine.token, ttl=self.engine.settings.lease_ttl
                        )
                    except DatabaseError as error:
                        self.engine.reset_connection()
                        if failing_since is None:
                            failing_since = sent
                            logger.warning(
                                "Could not renew leases on %s (%s); retrying",
                                self.engine.instance_id,
                                error,
                                extra={"instance": self.engine.instance_id},
                            )
                        retry_at = sent + min(0.25, every)
                    else:
                        failing_since = None
                        for active in held:
                            if active.run.id in kept:
                                active.renewed_at = max(active.renewed_at, sent)
                        by_id = {a.run.id: a for a in held}
                        for row in lost:
                            gone = by_id.get(row.id)
                            if gone is not None:
                                self.lose(gone, describe_loss(row))
                        retry_at = 0.0
                self.renew_wake.wait(max(0.01, min(due(held_runs()) - time.monotonic(), 1.0)))
                self.renew_wake.clear()
        finally:
            connections.close_all()

    def run_watchdog(self) -> None:
        """Fence and time out runs on this host's monotonic clock alone.

        Kept apart from the keeper, whose renewal may hang on a slow or
        unreachable database: a runner must give its runs up on time even then.
        """
        while not self.stopped.is_set():
            now = time.monotonic()
            self.fence_overdue()
            self._time_out_overdue(now)
            candidates = [1.0]
            for active in self.engine.active_runs():
                if active.state == "running":
                    candidates.append(active.renewed_at + self.engine.settings.fence_after - now)
                    if active.deadline is not None and active.overran():
                        candidates.append(active.deadline - now)
            self.watch_wake.wait(max(0.005, min(candidates)))
            self.watch_wake.clear()

    def fence_overdue(self) -> None:
        """Give up runs whose lease we could not renew in time.

        Judged on this host's monotonic clock from the last renewal that
        committed: the lease lasts at least ``LEASE_TTL`` from when that
        renewal was sent, so aborting at ``fence_after`` (80 % of it) tells
        the handler to stop before any backup may take the run over.
        """
        now = time.monotonic()
        for active in self.engine.active_runs():
            if active.state == "running" and now >= active.renewed_at + self.engine.settings.fence_after:
                if active.begin_finish():
                    silent = now - active.renewed_at
                    active.abort(
                        "fenced",
                        Interrupted(
                            f"could not renew the lease for {silent:.1f}s (database unreachable or too slow); "
                            "stopping before another instance may take the run over"
                        ),
                    )
                    active.done()
                    logger.warning(
                        "Fenced %s slot=%s attempt=%d: no lease renewal for %.1fs",
                        active.run.job,
                        active.run.slot,
                        active.run.attempt,
                        silent,
                        extra={"job": active.run.job, "slot": active.run.slot, "instance": self.engine.instance_id},
                    )

    def _time_out_overdue(self, now: float) -> None:
        """End the runs whose handler was still running at its deadline, and only those.

        Not a handler that returned before its deadline (its ending may wait a
        moment behind a burst of starts), nor one that ``stop()`` aborted first
        (its grace period decides: it is handed over).
        """
        for active in self.engine.active_runs():
            if (
                active.deadline is not None
                and now >= active.deadline
                and active.state == "running"
                and active.overran()
            ):
                if active.begin_finish():
                    error = timeout_error(active)
                    active.abort("timeout", error)
                    threading.Thread(
                        target=self._record_timeout, args=(active, error), name="anarchon-timeout", daemon=True
                    ).start()

    def _record_timeout(self, active: ActiveRun, error: TimeoutError) -> None:
        try:
            self.engine.runner.record(active, Status.FAILED, error)
        finally:
            active.done()
            connections.close_all()
            self.engine.wake()  # the job is free for its next slot

    def lose(self, active: ActiveRun, why: str) -> None:
        """This process no longer holds ``active``: abort its handler, record nothing."""
        if not active.begin_finish():
            return
        active.abort("lost", Interrupted(f"this instance no longer holds the run: {why}"))
        active.done()
        logger.warning(
            "Lost %s slot=%s attempt=%d: %s",
            active.run.job,
            active.run.slot,
            active.run.attempt,
            why,
            extra={"job": active.run.job, "slot": active.run.slot, "instance": self.engine.instance_id},
        )

    def lose_local(self, run_id: int | None, why: str) -> None:
        active = self.engine.active_run(run_id)
        if active is not None:
            self.lose(active, why)
