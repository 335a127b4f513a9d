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

from django.db import connections

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
    queued_at: float = field(default_factory=time.monotonic)

    def texts(self) -> dict[str, str]:
        """The text columns to write, made storable (see :func:`store.storable_text`)."""
        return {
            "error_type": store.storable_text(self.error_type),
            "error_message": store.storable_text(self.error_message),
            "traceback": store.storable_text(self.traceback),
            "detail": store.storable_text(self.detail),
        }

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
                try:
                    self._record(batch)
                except Exception as error:  # this thread must live on, or every later ending would wait for ever
                    logger.exception("Internal error while recording run endings")
                    for outcome in batch:
                        if not outcome.done.is_set():
                            self._give_up(outcome, error, "recording it failed")
        finally:
            connections.close_all()

    def _record(self, batch: list[Outcome]) -> None:
        """Write ``batch``; retry while the database is unreachable, for each outcome while its lease can be live.

        An outcome is given up (result None, logged at ERROR) once its lease may
        have run out, or once it has been retried for a whole ``LEASE_TTL``: the
        keeper renews the lease of a run whose end waits here, so a write that
        keeps failing must not hold the run (and this thread) for ever. A write
        that fails for a reason retrying cannot fix is degraded at once (see
        :meth:`_write_degraded`), never retried.
        """
        pending = batch
        delay = 0.05
        ttl = self.engine.settings.lease_ttl
        while pending:
            try:
                self._write(pending)
            except Exception as error:  # only errors a retry may fix get here
                self.engine.reset_connection()
                now = time.monotonic()
                for outcome in pending:
                    if not outcome.done.is_set() and (
                        now > outcome.active.renewed_at + ttl or now > outcome.queued_at + ttl
                    ):
                        self._give_up(outcome, error, "another instance will take the run over once its lease runs out")
                sleep(delay)
                delay = min(delay * 2, 1.0)
            pending = [outcome for outcome in pending if not outcome.done.is_set()]

    def _give_up(self, outcome: Outcome, error: BaseException, then: str) -> None:
        run = outcome.active.run
        logger.error(
            "Could not record the end of %s slot=%s attempt=%d (%s: %s); %s",
            run.job,
            run.slot,
            run.attempt,
            type(error).__name__,
            error,
            then,
            extra={"job": run.job, "slot": run.slot, "attempt": run.attempt, "instance": self.engine.instance_id},
        )
        outcome.settle(None)
        # The keeper stops renewing it: its lease runs out and another attempt takes over.
        outcome.active.done()

    def _write(self, outcomes: Sequence[Outcome]) -> None:
        """Write every outcome not yet settled; raise only what a retry may fix."""
        owner = self.engine.token
        successes = [o for o in outcomes if o.status == Status.SUCCESS and not o.done.is_set()]
        if successes:
            try:
                recorded = store.finish_many([o.active.run.id for o in successes], owner=owner)  # type: ignore[misc]
            except Exception as error:
                if not store.retry_cannot_fix(error):
                    raise
                # Written one by one below, where the one that cannot be written is degraded alone.
            else:
                for outcome in successes:
                    outcome.settle(outcome.active.run.id in recorded)
        for outcome in outcomes:
            if outcome.done.is_set():
                continue
            try:
                outcome.settle(self._write_one(outcome, outcome.texts()))
            except Exception as error:
                if not store.retry_cannot_fix(error):
                    raise
                self._write_degraded(outcome, error)

    def _write_degraded(self, outcome: Outcome, error: BaseException) -> None:
        """Record an outcome whose texts the database refused: texts made ASCII, then without them.

        The first try escapes every non-ASCII character (a 4-byte character in a
        MySQL ``utf8mb3`` column, a character the table's charset lacks); the
        second keeps the status and error type only, the message replaced by a
        note. If even that is refused, the outcome is given up (ERROR).
        """
        run = outcome.active.run
        texts = outcome.texts()
        ascii_texts = {key: value.encode("ascii", "backslashreplace").decode("ascii") for key, value in texts.items()}
        bare = {
            "error_type": ascii_texts["error_type"],
            "error_message": f"[the error message could not be stored: {type(error).__name__}]"
            if texts["error_message"]
            else "",
            "traceback": "",
            "detail": f"[the detail could not be stored: {type(error).__name__}]" if texts["detail"] else "",
        }
        for attempt in (ascii_texts, bare):
            try:
                outcome.settle(self._write_one(outcome, attempt))
            except Exception as again:
                if not store.retry_cannot_fix(again):
                    raise
                error = again
                continue
            logger.warning(
                "The database refused the text of the end of %s slot=%s attempt=%d (%s); recorded it %s",
                run.job,
                run.slot,
                run.attempt,
                error,
                "with its text escaped to ASCII" if attempt is ascii_texts else "without its error message",
                extra={"job": run.job, "slot": run.slot, "attempt": run.attempt, "instance": self.engine.instance_id},
            )
            return
        self._give_up(outcome, error, "nothing could be recorded; another instance will take the run over")

    def _write_one(self, outcome: Outcome, texts: dict[str, str]) -> Any:
        run_id: int = outcome.active.run.id  # type: ignore[assignment]
        owner = self.engine.token
        if outcome.status == HAND_OVER:
            return store.hand_over(
                run_id, owner=owner, detail=texts["detail"], max_attempts=self.engine.settings.max_attempts
            )
        return store.finish(run_id, owner=owner, status=outcome.status, **texts)
