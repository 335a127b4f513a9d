"""Records how runs ended, on one database connection, in batches.

A run's own thread hands its outcome here and waits for the commit; it then
sends the signals and logs, so a slow signal receiver only delays its own run.
Recording from the run's thread instead would open a database connection per
run (on PostgreSQL, a forked server process per run), which is what made a
hundred simultaneous trivial jobs start hundreds of milliseconds late.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections

from . import store
from .models import Status
from .timing import sleep

if TYPE_CHECKING:
    from .engine import Engine
    from .runner import ActiveRun

logger = logging.getLogger("django_anarchon")
HAND_OVER = "hand-over"
BATCH = 200
# After the first outcome, collect others this long before writing. Runs due at
# the same instant end at about the same time, and their outcomes go in one
# UPDATE; writing (and waking the waiting runs' threads) while more runs of the
# same instant are still starting delayed those starts by several milliseconds.
COLLECT_S = 0.02


@dataclass
class Outcome:
    """One ending to record. ``result``: True (recorded), False (no longer ours), None (database
    unreachable until the lease ran out), or (old, new) attempts for a hand-over."""

    active: ActiveRun
    status: str
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    detail: str = ""
    result: Any = None
    done: threading.Event = field(default_factory=threading.Event)

    def settle(self, result: Any) -> None:
        self.result = result
        self.done.set()


class Recorder:
    """A thread that writes outcomes for an :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queue: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def record(self, outcome: Outcome) -> Any:
        """Queue ``outcome`` and wait until it is written (or given up); return its result."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="anarchon-recorder", daemon=True)
                self._thread.start()
        self._queue.put(outcome)
        outcome.done.wait()
        return outcome.result

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        try:
            stopping = False
            while not stopping:
                first = self._queue.get()
                if first is None:
                    break
                batch = [first]
                until = time.monotonic() + COLLECT_S
                while len(batch) < BATCH:
                    left = until - time.monotonic()
                    try:
                        item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        stopping = True
                        break
                    batch.append(item)
                self._record(batch)
        finally:
            connections.close_all()

    def _record(self, batch: list[Outcome]) -> None:
        """Write ``batch``, retrying database errors for each outcome while its lease can be live."""
        pending = batch
        delay = 0.05
        while pending:
            try:
                self._write(pending)
            except DatabaseError as error:
                self.engine.reset_connection()
                now = time.monotonic()
                for outcome in pending:
                    if not outcome.done.is_set() and now > outcome.active.renewed_at + self.engine.settings.lease_ttl:
                        run = outcome.active.run
                        logger.error(
                            "Could not record the end of %s slot=%s attempt=%d (%s); the lease has run out, "
                            "so another instance will take the run over",
                            run.job,
                            run.slot,
                            run.attempt,
                            error,
                            extra={"job": run.job, "slot": run.slot, "instance": self.engine.instance_id},
                        )
                        outcome.settle(None)
                sleep(delay)
                delay = min(delay * 2, 1.0)
            pending = [outcome for outcome in pending if not outcome.done.is_set()]

    def _write(self, outcomes: Sequence[Outcome]) -> None:
        owner = self.engine.token
        successes = [o for o in outcomes if o.status == Status.SUCCESS and not o.done.is_set()]
        if successes:
            recorded = store.finish_many([o.active.run.id for o in successes], owner=owner)  # type: ignore[misc]
            for outcome in successes:
                outcome.settle(outcome.active.run.id in recorded)
        for outcome in outcomes:
            if outcome.done.is_set():
                continue
            run_id = outcome.active.run.id
            if outcome.status == HAND_OVER:
                outcome.settle(store.hand_over(run_id, owner=owner, detail=outcome.detail))  # type: ignore[arg-type]
            else:
                outcome.settle(
                    store.finish(
                        run_id,  # type: ignore[arg-type]
                        owner=owner,
                        status=outcome.status,
                        error_type=outcome.error_type,
                        error_message=outcome.error_message,
                        traceback=outcome.traceback,
                        detail=outcome.detail,
                    )
                )
