"""Records how runs ended, on one database connection, in batches.

A run's own thread hands its :class:`Ending` here and waits for the commit; it
then sends the signals and logs, so a slow signal receiver only delays its own
run. Recording from the run's thread instead would open a database connection
per run wherever the worker's own connection is not kept.

The recorder knows rows, not the runs an instance holds: an ending carries the
run's row, how long its lease can be live (``lease_until``) and what to do once
it is written or given up (``then``, called on the recorder's thread with the
result). A worker hands its run's ending over with :meth:`Recorder.submit` and
goes on to the next run without waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connections

from . import store
from .dbtrouble import DbTrouble
from .latch import Latch
from .models import Run, Status

logger = logging.getLogger("django_anarchon")
BATCH = 200
# After the first ending, collect others this long before writing. Runs due at the same
# instant end at about the same time, and their endings go in one UPDATE; writing (and
# waking the waiting runs' threads) while more runs of the same instant are still
# starting delays those starts.
COLLECT_S = 0.02
# How long an ending is retried while the database cannot be reached (past its lease, too: see
# Recorder._record), before it is given up and the run left to a takeover.
END_PATIENCE_S = 600.0
OUTLIVED_RETRY_S = 0.25  # how often an ending past its lease is tried again


@dataclass
class Ending:
    """One ending to record: a final ``status``, or a hand-over (``hand_over``: interrupted, next attempt pending).

    ``result``: True (recorded), False (no longer ours), None (given up: nothing
    could be recorded in time), or (old, new) attempts for a hand-over.
    """

    run: Run
    lease_until: Callable[[], float]  # monotonic time after which the run's lease may have run out
    then: Callable[[Any], None] | None = None  # called with the result once settled (recorder's thread)
    status: str = ""
    hand_over: bool = False
    started: bool = True  # whether the handler was called (if not, the row keeps no start time)
    max_attempts: int | None = None
    # When the handler started, if well after the claim's started_at (it waited for a worker): written with the end.
    started_at: datetime | None = None
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    detail: str = ""
    result: Any = None
    done: Latch = field(default_factory=Latch)
    outlived_lease: bool = False  # said once: its lease ran out while the database was unreachable
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
        if self.then is not None:
            try:
                self.then(result)
            except Exception:
                logger.exception("Internal error after recording the end of %r", self.run.job)


class Recorder:
    """A thread that writes the endings of one instance's runs."""

    def __init__(self, token: str, instance_id: str, lease_ttl: float) -> None:
        self.token = token
        self.instance_id = instance_id
        self.lease_ttl = lease_ttl
        self.trouble = DbTrouble("recording run endings", instance_id, store.alias)
        self._queue: queue.SimpleQueue[Ending | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._hurry = threading.Event()  # set: write what is queued without collecting more first

    def submit(self, ending: Ending) -> None:
        """Queue ``ending`` to be written; its ``then`` is called once it is (or was given up)."""
        if self._thread is None:  # looked at again under the lock: started once
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="anarchon-recorder", daemon=True)
                    self._thread.start()
        self._queue.put(ending)

    def hurry(self) -> None:
        """Write the endings queued now at once, rather than after collecting others for ``COLLECT_S``,
        or try again now a write that failed (rather than after its back-off)."""
        self._hurry.set()

    def record(self, ending: Ending) -> Any:
        """Queue ``ending`` and wait until it is written (or given up); return its result."""
        self.submit(ending)
        ending.done.wait()
        return ending.result

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
                if self._queue.qsize() < BATCH - 1 and not self._hurry.is_set():
                    # Sleep through the window rather than wake for every ending queued in it:
                    # each wake-up took the GIL from the workers starting that instant's runs.
                    # (An event's wait: time.sleep fails under libfaketime, and this thread must live.)
                    self._hurry.wait(COLLECT_S)
                self._hurry.clear()
                while len(batch) < BATCH:
                    try:
                        item = self._queue.get_nowait()
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
                    for ending in batch:
                        if not ending.done.is_set():
                            self._give_up(ending, error, "recording it failed")
        finally:
            connections.close_all()

    def _record(self, batch: list[Ending]) -> None:
        """Write ``batch``; retry while the database is unreachable, for each ending up to ``END_PATIENCE_S``.

        An ending outlives its lease here: its handler is over, and the end is
        written when the database answers again unless a backup took the run
        over first (the row decides; see ``statements.end_held``), so a run that
        finished during an outage longer than ``LEASE_TTL`` is not run again.
        Past ``END_PATIENCE_S`` (or ``LEASE_TTL``, if longer) it is given up
        (result None, logged at ERROR), and the run left to a takeover. A write
        that fails for a reason retrying cannot fix is degraded at once (see
        :meth:`_write_degraded`), never retried.
        """
        pending = batch
        patience = max(END_PATIENCE_S, self.lease_ttl)
        while pending:
            try:
                with self.trouble.waiting():  # a write that hangs is said while it does
                    self._write(pending)
            except Exception as error:  # only errors a retry may fix get here
                self.trouble.failed(error)
                now = time.monotonic()
                for ending in pending:
                    if ending.done.is_set():
                        continue
                    if now > ending.queued_at + patience:
                        self._give_up(ending, error, "another instance will take the run over")
                    elif now > ending.lease_until() and not ending.outlived_lease:
                        ending.outlived_lease = True
                        self._outlived(ending, error)
                self.trouble.end_turn()
                # An ending past its lease races a backup's takeover for the row once the database is
                # back: tried again four times a second rather than once.
                racing = any(e.outlived_lease and not e.done.is_set() for e in pending)
                # hurry() cuts the wait short: the loop calls it when its poll, which has just gone
                # through, finds this instance's own ending run with its lease running out.
                if self._hurry.wait(min(self.trouble.backoff, OUTLIVED_RETRY_S if racing else 1.0)):
                    self._hurry.clear()
            else:
                self.trouble.end_turn()
            pending = [ending for ending in pending if not ending.done.is_set()]

    def _outlived(self, ending: Ending, error: BaseException) -> None:
        run = ending.run
        logger.warning(
            "The end of %s slot=%s attempt=%d waits for the database past its lease (%s: %s); it is written "
            "when the database answers, unless another instance takes the run over first",
            run.job,
            run.slot,
            run.attempt,
            type(error).__name__,
            error,
            extra={"job": run.job, "slot": run.slot, "attempt": run.attempt, "instance": self.instance_id},
        )

    def _give_up(self, ending: Ending, error: BaseException, then: str) -> None:
        run = ending.run
        logger.error(
            "Could not record the end of %s slot=%s attempt=%d (%s: %s); %s",
            run.job,
            run.slot,
            run.attempt,
            type(error).__name__,
            error,
            then,
            extra={"job": run.job, "slot": run.slot, "attempt": run.attempt, "instance": self.instance_id},
        )
        ending.settle(None)  # its then() stops the renewals: the lease runs out and a takeover runs it

    def _write(self, endings: Sequence[Ending]) -> None:
        """Write every ending not yet settled; raise only what a retry may fix."""
        successes = [
            e
            for e in endings
            if e.status == Status.SUCCESS
            and e.started
            and not e.hand_over
            and e.started_at is None
            and not e.done.is_set()
        ]
        if successes:
            try:
                recorded = store.finish_many([e.run.id for e in successes], owner=self.token)  # type: ignore[misc]
            except Exception as error:
                if not store.retry_cannot_fix(error):
                    raise
                # Written one by one below, where the one that cannot be written is degraded alone.
            else:
                for ending in successes:
                    ending.settle(ending.run.id in recorded)
        for ending in endings:
            if ending.done.is_set():
                continue
            try:
                ending.settle(self._write_one(ending, ending.texts()))
            except Exception as error:
                if not store.retry_cannot_fix(error):
                    raise
                self._write_degraded(ending, error)

    def _write_degraded(self, ending: Ending, error: BaseException) -> None:
        """Record an ending whose texts the database refused: texts made ASCII, then without them.

        The first try escapes every non-ASCII character (a 4-byte character in a
        MySQL ``utf8mb3`` column, a character the table's charset lacks); the
        second keeps the status and error type only, the message replaced by a
        note. If even that is refused, the ending is given up (ERROR).
        """
        run = ending.run
        texts = ending.texts()
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
                result = self._write_one(ending, attempt)
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
                extra={"job": run.job, "slot": run.slot, "attempt": run.attempt, "instance": self.instance_id},
            )
            ending.settle(result)  # after the log line: whoever waits for the ending finds it logged
            return
        self._give_up(ending, error, "nothing could be recorded; another instance will take the run over")

    def _write_one(self, ending: Ending, texts: dict[str, str]) -> Any:
        run_id: int = ending.run.id  # type: ignore[assignment]
        if ending.hand_over:
            return store.hand_over(
                run_id,
                owner=self.token,
                detail=texts["detail"],
                max_attempts=ending.max_attempts,
                started=ending.started,
            )
        return store.finish(
            run_id,
            owner=self.token,
            status=ending.status,
            started_at=ending.started_at,
            started=ending.started,
            **texts,
        )
