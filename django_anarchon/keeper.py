"""Holding runs: lease renewal, and a watchdog that fences and times out runs.

Two threads: the renewal thread extends the leases of every run this process
holds in one UPDATE; the watchdog never touches the database, so that a renewal
hanging on a slow or unreachable database cannot delay the moment a runner
gives its runs up. Both ask the run table to end what must end.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from django.db import DatabaseError, connections

from . import metrics, store
from .conf import AnarchonSettings
from .dbtrouble import DbTrouble, say_waiting
from .runs import ActiveRun, Phase, RunTable, describe_loss

logger = logging.getLogger("django_anarchon")


class Keeper:
    """Renews, fences and times out the runs in a run table."""

    def __init__(self, table: RunTable, settings: AnarchonSettings, *, token: str, instance_id: str) -> None:
        self.table = table
        self.settings = settings
        self.token = token
        self.trouble = DbTrouble("lease renewals", instance_id, store.alias)
        self.stopped = threading.Event()
        self.renew_wake = threading.Event()
        self.watch_wake = threading.Event()
        # When each thread means to look again (monotonic): a new run only wakes a thread that
        # would otherwise look too late for it (most runs end before either is due).
        self._renew_at = 0.0
        self._watch_at = 0.0

    def wake(self) -> None:
        """A run was adopted or a deadline set: look again now."""
        self.renew_wake.set()
        self.watch_wake.set()

    def watch(self) -> None:
        """A deadline was just set: the watchdog looks again."""
        self.watch_wake.set()

    def held(self, active: ActiveRun) -> None:
        """A run was just adopted: wake the threads only if they mean to look later than it needs."""
        if active.renewed_at + self.settings.renew_every < self._renew_at:
            self.renew_wake.set()
        if active.renewed_at + self.settings.fence_after < self._watch_at:
            self.watch_wake.set()

    def stop(self) -> None:
        self.stopped.set()
        self.wake()

    def run_renewals(self) -> None:
        """Extend leases as they age: each run's at most ``renew_every`` after its claim or last renewal.

        A run is renewed once its lease is ``renew_every`` old, together with
        every other run whose lease is at least half that old, so that runs of
        different ages still share one UPDATE. A run that ends within
        ``renew_every`` of its claim (most do) is never renewed.
        """
        every = self.settings.renew_every
        retry_at = 0.0

        def held_runs() -> list[ActiveRun]:
            return [a for a in self.table.all() if a.state is not Phase.DONE]

        def due(held: list[ActiveRun]) -> float:
            """When the oldest of ``held`` leases is due (a failed renewal: retried no sooner than ``retry_at``)."""
            return max(min(a.renewed_at for a in held) + every, retry_at) if held else math.inf

        try:
            while not self.stopped.is_set():
                now = time.monotonic()
                held = held_runs()
                if now >= due(held):
                    held = [a for a in held if now - a.renewed_at >= every / 2]
                    retry_at = self._renew(held, every)
                wait = max(0.01, min(due(held_runs()) - time.monotonic(), 1.0))
                self._renew_at = time.monotonic() + wait
                self.renew_wake.wait(wait)
                self.renew_wake.clear()
        finally:
            connections.close_all()

    def _renew(self, held: list[ActiveRun], every: float) -> float:
        """Renew ``held`` in one UPDATE; lose the ones no longer ours. When to retry after a failure (0: none)."""
        sent = time.monotonic()
        try:
            kept, lost = store.renew([a.run.id for a in held], owner=self.token, ttl=self.settings.lease_ttl)
        except DatabaseError as error:
            metrics.RENEWALS.labels("failed").inc()
            self.trouble.failed(error)
            self.trouble.end_turn()
            return sent + min(0.25, every)
        metrics.RENEWALS.labels("ok").inc()
        self.trouble.end_turn()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Renewed %d lease(s), lost %d", len(kept), len(lost))
        for active in held:
            if active.run.id in kept:
                active.renewed_at = max(active.renewed_at, sent)
        by_id = {a.run.id: a for a in held}
        for row in lost:
            gone = by_id.get(row.id)
            if gone is not None:
                self.table.lose(gone, describe_loss(row))
        return 0.0

    def run_watchdog(self) -> None:
        """Fence and time out runs on this host's monotonic clock alone.

        Kept apart from the renewals, which may hang on a slow or unreachable
        database: a runner must give its runs up on time even then.
        """
        fence_after = self.settings.fence_after
        while not self.stopped.is_set():
            now = time.monotonic()
            self.table.fence_overdue()
            self.table.time_out_overdue(now)
            say_waiting()
            candidates = [1.0]
            for active in self.table.all():
                if active.state is Phase.RUNNING:
                    candidates.append(active.renewed_at + fence_after - now)
                    if active.deadline is not None and active.overran():
                        candidates.append(active.deadline - now)
            wait = max(0.005, min(candidates))
            self._watch_at = now + wait
            self.watch_wake.wait(wait)
            self.watch_wake.clear()
