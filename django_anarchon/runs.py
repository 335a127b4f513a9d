"""The runs an instance holds, and the one place where an attempt ends.

:class:`RunTable` keeps the held runs (:class:`ActiveRun`) and says how many
more may start (``MAX_WORKERS``). Every way an attempt can end goes through it,
in one order: who ends it is decided under the run's lock (the first to call
:meth:`ActiveRun.begin_finish`), then the end is recorded (through the
recorder), then the signal is sent, then the one log line is written.

=====================  ==================================================  ============================
how it ends            recorded                                            signal
=====================  ==================================================  ============================
handler returned       ``success`` (``failed``/TimeoutError if it overran)  ``run_succeeded``/``run_failed``
handler raised         ``failed``                                          ``run_failed``
timed out              ``failed`` with ``TimeoutError``                    ``run_failed``
stop(), raised/ended   ``interrupted``, next attempt pending (hand-over)   ``run_interrupted``
lost / fenced          nothing (another instance records it)               none
last allowed attempt   ``failed`` with ``AttemptsExhausted``               ``run_failed``
=====================  ==================================================  ============================

Longer than most parts on purpose: every ending is here, so that they are
decided, recorded, signalled and logged the same way.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import traceback
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from typing import Any

from . import metrics, signals, store
from .conf import AnarchonSettings
from .exceptions import AttemptsExhausted, Interrupted, TaskFailed
from .latch import Latch
from .models import Run, Status
from .recorder import Ending, Recorder
from .registry import Job
from .signal import AbortSignal

logger = logging.getLogger("django_anarchon")
MAX_MESSAGE = 10_000
MAX_TRACEBACK = 100_000


class Phase(str, enum.Enum):
    """Where an attempt this instance holds stands (not a run status: it never reaches the database)."""

    RUNNING = "running"  # held: nobody has begun ending it
    FINISHING = "finishing"  # someone is ending it (recording its end)
    DONE = "done"  # ended; its lease is no longer renewed


# Runs beyond MAX_WORKERS that an instance claims when its handlers are quick: as many as its
# free workers start within this long, judged by recent handler durations (see capacity()), and
# at most HEADROOM_FACTOR times MAX_WORKERS.
QUICK_WINDOW_S = 0.1
HEADROOM_FACTOR = 8
# How loud the end line of a run is, by the status recorded (anything else: INFO).
END_LEVELS: dict[str, int] = {
    Status.FAILED: logging.ERROR,
    Status.INTERRUPTED: logging.WARNING,
    Status.SKIPPED: logging.WARNING,
}
# A handler ending this soon after its timeout aborted its signal honoured the signal (see finish()).
PROMPT_END_S = 1.0
# An attempt's cause of ending, as log lines say it ("Run ended after it was timed out").
CAUSE_WORDS = {"stop": "stopped", "timeout": "timed out", "lost": "lost", "fenced": "fenced", "paused": "paused"}


class ActiveRun:
    """A run this process holds: its signal, lease bookkeeping and end state.

    Exactly one party ends a run (the handler's thread, the timeout, a lost or
    fenced lease, or a forced hand-over at stop); :meth:`begin_finish` decides
    which, under a lock.
    """

    def __init__(self, run: Run, job: Job, renewed_at: float) -> None:
        self.run = run
        self.job = job
        self.signal = AbortSignal()
        self.renewed_at = renewed_at  # monotonic time the last committed renewal was sent
        self.started = time.monotonic()
        self.released_at = 0.0  # monotonic time it was handed on to a worker (see Runner)
        self.deadline: float | None = None  # set when the handler starts (a run may be claimed ahead)
        self.returned = False  # the handler is over (or never started): no longer uses a worker
        self.returned_at: float | None = None  # monotonic time it did
        self.cause: str | None = None
        self.aborted_at: float | None = None  # monotonic time its signal aborted
        self.finished = Latch()  # set when its handler is over and its end recorded (or given up)
        self.ended = Latch()  # set when its end is recorded, given up, or decided elsewhere
        self.ran = False  # its handler was called
        # Claimed ahead: the loop reads its job's pause once more before the slot, and the starter
        # holds it until then, even past its slot (see Engine._check_pauses_before_slots).
        self.pause_check_pending = False
        self.late_start: datetime | None = None  # when its handler started, if well after the claim said (see Runner)
        self._state = Phase.RUNNING
        self._finishing_at: float | None = None  # monotonic time its ending began
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<ActiveRun {self.run.job} slot={self.run.slot} attempt={self.run.attempt} {self._state.value}>"

    @property
    def state(self) -> Phase:
        return self._state

    @property
    def ending_since(self) -> float:
        """Since when (monotonic) this run has been ending: its end decided, or else its handler returned."""
        return self._finishing_at or self.returned_at or time.monotonic()

    def begin_finish(self) -> bool:
        """Claim the right to end this run; False if someone else already did."""
        with self._lock:
            if self._state is not Phase.RUNNING:
                return False
            self._state = Phase.FINISHING
            self._finishing_at = time.monotonic()
            return True

    def begin_start(self) -> bool:
        """Mark the handler as started; False if the run was ended, or its signal aborted, first.

        Under the same lock as :meth:`withdraw`: a run is either started or
        withdrawn, never both.
        """
        with self._lock:
            if self._state is not Phase.RUNNING or self.signal.aborted:
                return False
            self.started = time.monotonic()
            self.ran = True
            return True

    def withdraw(self) -> bool:
        """Claim the right to end this run before its handler starts; False if it started (or ended) first."""
        with self._lock:
            if self._state is not Phase.RUNNING or self.ran:
                return False
            self._state = Phase.FINISHING
            self._finishing_at = time.monotonic()
            return True

    def done(self) -> None:
        with self._lock:
            self._state = Phase.DONE
        self.ended.set()

    def overran(self) -> bool:
        """Whether the handler was still running when its timeout passed (decided by what came first)."""
        if self.deadline is None or self.cause == "stop":
            return False  # no timeout, or stop() came first: stopping decides, not the timeout
        return self.returned_at is None or self.returned_at >= self.deadline

    def abort(self, cause: str, reason: BaseException) -> None:
        """Abort the signal, remembering why (the first cause wins, like the signal's reason)."""
        with self._lock:
            if self.signal.aborted:
                return
            self.cause = cause
            self.aborted_at = time.monotonic()
        self.signal.abort(reason)


def describe_error(error: BaseException) -> tuple[str, str, str]:
    """(type, message, traceback) of ``error``, bounded so a huge one cannot swamp the table."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(error, TaskFailed) and error.exception_class_path:
        # The task's own exception, raised where the task ran, named as a handler's would be.
        name = error.exception_class_path.removeprefix("builtins.")
    try:
        message = str(error)
    except Exception:  # a broken __str__ must not lose the record
        message = f"<unprintable {name}>"
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + f"… [{len(message) - MAX_MESSAGE} more characters]"
    if isinstance(error, TaskFailed) and error.task_traceback:
        text = error.task_traceback
    else:
        text = "".join(traceback.format_exception(kind, error, error.__traceback__))
    if len(text) > MAX_TRACEBACK:
        text = text[: MAX_TRACEBACK // 2] + "\n… [traceback cut] …\n" + text[-MAX_TRACEBACK // 2 :]
    return name, message, text


def log_fields(run: Run, instance_id: str) -> dict[str, Any]:
    """The structured fields of every log record about a run."""
    return {
        "job": run.job,
        "slot": run.slot,
        "attempt": run.attempt,
        "reason": run.reason,
        "instance": instance_id,
        "run_id": run.id,
    }


def timeout_error(active: ActiveRun) -> TimeoutError:
    return active.job.timeout_error()


def describe_loss(row: Run) -> str:
    if row.status == Status.INTERRUPTED and "replaced" in row.detail:
        return f"it was replaced: {row.detail}"
    if row.status == Status.RUNNING:
        return "its lease expired before it could be renewed"
    return f"another instance recorded it as {row.status}" + (f" ({row.detail})" if row.detail else "")


class RunTable:
    """The runs this instance holds, their capacity, and every ending."""

    def __init__(
        self,
        settings: AnarchonSettings,
        instance_id: str,
        recorder: Recorder,
        outbox: Callable[..., None],
        *,
        on_exit: Callable[[ActiveRun], None] = lambda active: None,
        on_returned: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.instance_id = instance_id
        self.recorder = recorder
        # Sends a signal from a thread that is not the loop's (the project's receivers must not delay claims).
        self.outbox = outbox
        self.on_exit = on_exit  # a run's worker is done with it: its job and a worker are free
        self.on_returned = on_returned  # a handler returned: a worker is free
        self._active: dict[int, ActiveRun] = {}
        self._lock = threading.Lock()
        self._typical_s: float | None = None  # recent handler durations (moving average), for capacity()
        self._stopping: Interrupted | None = None  # set by stop(): runs added from then on are aborted at once

    # -- the table -------------------------------------------------------------------------

    def add(self, active: ActiveRun) -> None:
        self.add_many([active])

    def add_many(self, actives: list[ActiveRun]) -> None:
        with self._lock:
            self._active.update((active.run.id, active) for active in actives)  # type: ignore[misc]
            stopping = self._stopping
        if stopping is not None:
            # Won by a claim that was still under way when stop() aborted the others (the loop
            # can be held up by a database that does not answer): never started, handed over.
            for active in actives:
                active.abort("stop", stopping)

    def get(self, run_id: int | None) -> ActiveRun | None:
        with self._lock:
            return self._active.get(run_id)  # type: ignore[arg-type]

    def all(self) -> list[ActiveRun]:
        with self._lock:
            return list(self._active.values())

    def capacity(self, *, headroom: bool = True) -> int:
        """How many more runs this instance may claim now.

        ``MAX_WORKERS`` less the runs whose handler has not returned (running,
        waiting for a worker, or claimed ahead of their slot), plus a
        *headroom* when handlers are quick: as many more as the workers not
        tied up in a long handler can start within ``QUICK_WINDOW_S``, judged
        by recent handler durations. A hundred trivial jobs due at once are
        then claimed together and started a few milliseconds apart by sixteen
        workers, rather than sixteen at a time, each round a claim of its own;
        a slow handler leaves no headroom, so nobody waits behind it.

        Without ``headroom``, the workers free now only: for runs of any job at all (pending
        manual runs, takeovers), whose handlers the recent durations say nothing about. A
        burst of manual runs of a slow job, claimed with the headroom quick jobs had earned,
        waited here for a whole handler while other instances had workers free.
        """
        now = time.monotonic()
        with self._lock:
            busy = long = 0
            for active in self._active.values():
                if not active.returned:
                    busy += 1
                    if active.ran and now - active.started > QUICK_WINDOW_S:
                        long += 1
        limit = self.settings.max_workers
        extra = 0
        if headroom and self._typical_s is not None:
            free_soon = max(0, limit - long)
            extra = min(HEADROOM_FACTOR * limit, int(free_soon * QUICK_WINDOW_S / max(self._typical_s, 1e-4)))
        return limit + extra - busy

    def ending(self, jobs: Collection[str]) -> list[ActiveRun]:
        """This instance's runs of ``jobs`` that are ending: their end is decided, or their handler is
        over, and the end is not written yet (a timed-out run's handler may still be running).

        The database has them running until the recorder writes their end: a slot of the job
        decided meanwhile would find the job busy.
        """
        with self._lock:
            return [
                active
                for active in self._active.values()
                if active.run.job in jobs
                and (active.state is Phase.FINISHING or (active.returned and active.state is Phase.RUNNING))
            ]

    def returned(self, active: ActiveRun) -> None:
        """The run's handler is over: its worker no longer counts against ``MAX_WORKERS``.

        Its end may still be waiting to be recorded; the lease stays renewed until it is.
        """
        active.returned_at = time.monotonic()
        active.returned = True
        if active.ran:
            took = active.returned_at - active.started
            typical = self._typical_s
            self._typical_s = took if typical is None else 0.9 * typical + 0.1 * took
        self.on_returned()

    def exited(self, active: ActiveRun) -> None:
        """The run's handler is over and its end recorded (or decided elsewhere): it leaves the table."""
        active.finished.set()
        with self._lock:
            self._active.pop(active.run.id, None)  # type: ignore[arg-type]
        self.on_exit(active)

    # -- endings decided here --------------------------------------------------------------

    def finish(self, active: ActiveRun, error: BaseException | None, *, started: bool = True) -> None:
        """End a run whose handler returned (``error`` None) or raised, or that never started.

        The end is handed to the recorder without waiting: the worker is free
        for the next run at once, and the run leaves the table (its lease
        renewed until then) once the end is recorded, when the log line is
        written and the signal sent.
        """
        if not active.begin_finish():
            cause = CAUSE_WORDS.get(active.cause or "", "ended")
            if started:
                # A timed-out run has its end line already ("Run failed ... TimeoutError"): a handler
                # that honoured its signal adds only a debug line; one that went on long after, a line.
                level = logging.INFO
                if active.cause == "timeout" and active.aborted_at is not None:
                    late = (active.returned_at or time.monotonic()) - active.aborted_at
                    level = logging.DEBUG if late < PROMPT_END_S else logging.INFO
                self._log_end(active, f"ended after it was {cause}", level=level, after="; its end changes nothing")
            else:
                # A withdrawn run has its end line already ("Run skipped ... paused before its slot").
                level = logging.DEBUG if active.cause == "paused" else logging.WARNING
                self._log_end(active, f"not started: it was {cause} before its slot", level=level)
            self.exited(active)
            return
        if error is not None and active.signal.aborted and active.cause == "stop":
            self._hand_over(active, error, leave=True)
        elif error is None and active.overran():
            # It returned after its deadline, before the watchdog came round: the timeout came first.
            self._record(active, Status.FAILED, timeout_error(active), leave=True)
        elif error is None:
            self._record(active, Status.SUCCESS, None, leave=True)
        else:
            self._record(active, Status.FAILED, error, leave=True)

    def withdraw(self, active: ActiveRun, detail: str) -> bool:
        """Record ``active`` skipped (``detail`` says why) if its handler has not started; False if it had.

        For a run claimed ahead whose job was paused before its slot: it is
        released from waiting at once and never started (see :meth:`ActiveRun.withdraw`).
        """
        if not active.withdraw():
            return False
        active.abort("paused", Interrupted(detail))
        self._record(active, Status.SKIPPED, None, leave=False, detail=detail)
        return True

    def lose(self, active: ActiveRun, why: str) -> None:
        """This process no longer holds ``active``: abort its handler, record nothing."""
        if not active.begin_finish():
            return
        active.abort("lost", Interrupted(f"this instance no longer holds the run: {why}"))
        active.done()
        run = active.run
        # Ended here, and recorded interrupted by whoever took it over or replaced it.
        metrics.RUNS.labels(run.job, Status.INTERRUPTED).inc()
        logger.warning(
            "Lost %s slot=%s attempt=%d: %s",
            run.job,
            run.slot,
            run.attempt,
            why,
            extra=log_fields(run, self.instance_id),
        )

    def lose_id(self, run_id: int | None, why: str) -> None:
        active = self.get(run_id)
        if active is not None:
            self.lose(active, why)

    def fence_overdue(self) -> None:
        """Give up every run whose lease we could not renew in time (see :meth:`fence_if_overdue`)."""
        now = time.monotonic()
        for active in self.all():
            self.fence_if_overdue(active, now)

    def fence_if_overdue(self, active: ActiveRun, now: float | None = None) -> None:
        """Give up ``active`` if its lease could not be renewed in time.

        Judged on this host's monotonic clock from the last renewal that
        committed: the lease lasts at least ``LEASE_TTL`` from when that
        renewal was sent, so aborting at ``fence_after`` (80 % of it) tells
        the handler to stop before any backup may take the run over.
        """
        now = time.monotonic() if now is None else now
        if active.state is not Phase.RUNNING or now < active.renewed_at + self.settings.fence_after:
            return
        if not active.begin_finish():
            return
        silent = now - active.renewed_at
        active.abort(
            "fenced",
            Interrupted(
                f"could not renew the lease for {silent:.1f}s (the database unreachable or too slow, or this "
                "process frozen: SIGSTOP, a suspended VM); "
                "stopping before another instance may take the run over"
            ),
        )
        active.done()
        run = active.run
        metrics.FENCINGS.labels(run.job).inc()
        metrics.RUNS.labels(run.job, Status.INTERRUPTED).inc()  # as the backup that takes it over records it
        logger.warning(
            "Fenced %s slot=%s attempt=%d: no lease renewal for %.1fs",
            run.job,
            run.slot,
            run.attempt,
            silent,
            extra=log_fields(run, self.instance_id),
        )

    def time_out_overdue(self, now: float) -> None:
        """End the runs whose handler was still running at its deadline, and only those.

        Not a handler that returned before its deadline (its ending may wait a
        moment behind a burst of starts), nor one that ``stop()`` aborted first
        (its grace period decides: it is handed over). The end is recorded on a
        thread of its own, so that the watchdog never waits for the database.
        """
        for active in self.all():
            if (
                active.deadline is not None
                and now >= active.deadline
                and active.state is Phase.RUNNING
                and active.overran()
                and active.begin_finish()
            ):
                error = timeout_error(active)
                active.abort("timeout", error)
                # Recorded now; the run leaves the table when its handler returns (it holds a worker).
                self._record(active, Status.FAILED, error, leave=False)

    def stop(self, instance_id: str) -> None:
        """Abort every handler's signal: the scheduler is stopping."""
        reason = Interrupted(
            f"the scheduler on {instance_id} is stopping (stop(), SIGTERM or SIGINT); "
            "raise to hand the run over, return if it is done"
        )
        with self._lock:
            self._stopping = reason
            held = list(self._active.values())
        for active in held:
            active.abort("stop", reason)

    def hand_over_stragglers(self, grace: float) -> bool:
        """Hand over the runs whose handler outlived the stop's grace period; True if there were none."""
        clean = True
        for active in self.all():
            if active.state is Phase.RUNNING and active.begin_finish():
                clean = False
                logger.warning(
                    "Handler of %s slot=%s did not end within the %.1fs grace period; handing the run over",
                    active.run.job,
                    active.run.slot,
                    grace,
                    extra=log_fields(active.run, self.instance_id),
                )
                self._hand_over(active, None, leave=False)
        return clean

    # -- endings decided elsewhere (the loop's claims and takeovers) -----------------------

    def interrupted_elsewhere(self, rows: list[Run]) -> None:
        """Runs a claim just recorded interrupted (``overlap="replace"``): abort ours, signal.

        A run of ours is signalled with the ``Interrupted`` its handler was given.
        """
        for row in rows:
            active = self.get(row.id)
            if active is not None:
                self.lose(active, describe_loss(row))
            reason = active.signal.reason if active is not None and active.cause == "lost" else None
            self._announce(signals.run_interrupted, run=row, exception=reason)

    def skipped(self, rows: list[Run]) -> None:
        """Slots a claim just recorded skipped (the job was busy, or no free worker)."""
        for row in rows:
            metrics.SKIPPED.labels(row.job, metrics.skip_reason(row.detail)).inc()
            logger.warning(
                "Run skipped: %s slot=%s (%s)",
                row.job,
                row.slot,
                row.detail,
                extra={**log_fields(row, self.instance_id), "status": row.status},
            )
            self._announce(signals.run_skipped, run=row)

    def missed(self, rows: list[Run]) -> None:
        """Records of slots nobody ran while the whole cluster was down (one per outage and job)."""
        for row in rows:
            metrics.missed(row.job, row.detail)
            self._announce(signals.run_missed, run=row)

    def taken_over(self, old: Run, new: Run | None, starts_here: bool) -> None:
        """This instance took over ``old`` (its lease expired): ``new`` is the next attempt, or None (given up)."""
        self.lose_id(old.id, "its lease expired and another attempt started")
        if new is None:
            self._gave_up(old)
            return
        metrics.TAKEOVERS.labels(old.job).inc()
        logger.warning(
            "Took over %s slot=%s: attempt %d on %s stopped renewing its lease; attempt %d %s",
            old.job,
            old.slot,
            old.attempt,
            old.instance_id or "?",
            new.attempt,
            "starts here" if starts_here else "is pending",
            extra={**log_fields(old, self.instance_id), "status": old.status},
        )
        self._announce(signals.run_interrupted, run=old, exception=None)

    def _gave_up(self, old: Run) -> None:
        logger.error(
            "Gave up %s slot=%s: %s",
            old.job,
            old.slot,
            old.error_message,
            extra={**log_fields(old, self.instance_id), "status": old.status},
        )
        self._announce(signals.run_failed, run=old, exception=AttemptsExhausted(old.error_message))

    # -- recording -------------------------------------------------------------------------

    def _ending(self, active: ActiveRun, then: Any, **fields: Any) -> Ending:
        ttl = self.settings.lease_ttl
        return Ending(
            run=active.run,
            lease_until=lambda: active.renewed_at + ttl,
            then=then,
            started_at=active.late_start,
            started=active.ran,  # a run withdrawn before its slot keeps no start time
            **fields,
        )

    def _settled(self, active: ActiveRun, leave: bool) -> None:
        """The end of ``active`` is recorded (or given up): stop renewing; leave the table if the handler is over."""
        active.done()
        if leave:
            self.exited(active)
        else:
            self.on_exit(active)  # the job is free for its next slot; the handler still holds its worker

    def _record(
        self, active: ActiveRun, status: str, error: BaseException | None, *, leave: bool, detail: str = ""
    ) -> None:
        """Have a final status recorded for a run we are ending; then it is logged and signalled."""
        kind, message, text = describe_error(error) if error is not None else ("", "", "")

        def recorded(ours: Any) -> None:  # on the recorder's thread
            self._recorded(active, ours, status, error, (kind, message, text), leave=leave, detail=detail)

        ending = self._ending(
            active, recorded, status=status, error_type=kind, error_message=message, traceback=text, detail=detail
        )
        self.recorder.submit(ending)

    def _recorded(
        self,
        active: ActiveRun,
        ours: bool | None,
        status: str,
        error: BaseException | None,
        texts: tuple[str, str, str] = ("", "", ""),
        *,
        leave: bool,
        detail: str = "",
    ) -> None:
        """The end of ``active`` was written (``ours``), was no longer ours, or given up (None): log, signal."""
        run = active.run
        try:
            if ours is None:
                return  # logged by the recorder: nothing could be recorded in time
            if not ours:
                self._log_end(
                    active,
                    "ended but was no longer ours to record (lease expired, taken over, or replaced)"
                    + ("; its task was not enqueued" if active.job.is_task_job and status == Status.SUCCESS else ""),
                    level=logging.WARNING,
                )
                return
            run.status = status
            run.error_type, run.error_message, run.traceback = texts
            run.detail = detail or run.detail
            run.finished_at = datetime.now(UTC)  # the row holds the database's clock; receivers get ours
            if not active.ran:
                run.started_at = None  # withdrawn before its slot: the start its claim planned never came
            if status != Status.SKIPPED:  # skipped slots are counted as such (below), not as runs
                metrics.RUNS.labels(run.job, status).inc()
            if active.ran:
                metrics.DURATION.labels(run.job).observe((active.returned_at or time.monotonic()) - active.started)
            self._log_end(active, error=error, after=f" ({detail})" if detail else "")
            if status == Status.SUCCESS:
                self._announce(signals.run_succeeded, run=run)
            elif status == Status.SKIPPED:
                metrics.SKIPPED.labels(run.job, metrics.skip_reason(detail)).inc()
                self._announce(signals.run_skipped, run=run)
            else:
                self._announce(signals.run_failed, run=run, exception=error)
        finally:
            self._settled(active, leave)

    def finish_enqueued(self, active: ActiveRun, enqueue: Callable[[], Any]) -> None:
        """End a task job's run on its worker: enqueue the task and record ``success`` in one transaction.

        Decided first, as every ending is (nobody else may end the run while
        its task is being enqueued), then written by
        :func:`store.finish_enqueued`, which rolls the enqueue back if the run
        is no longer ours; then logged and signalled like any other ending. An
        enqueue that raised is recorded ``failed`` through the recorder.
        """
        if not active.begin_finish():
            self.returned(active)
            cause = CAUSE_WORDS.get(active.cause or "", "ended")
            self._log_end(active, f"not enqueued: it was {cause}", level=logging.WARNING)
            self.exited(active)
            return
        try:
            enqueued = store.finish_enqueued(active.run.id, owner=self.recorder.token, enqueue=enqueue)  # type: ignore[arg-type]
        except BaseException as error:  # noqa: B036 - every ending is recorded, none escapes
            self.returned(active)
            self._record(active, Status.FAILED, error, leave=True)
            return
        self.returned(active)
        if enqueued is not None:
            active.run.task_result_id = enqueued.result_id
        self._recorded(active, enqueued is not None, Status.SUCCESS, None, leave=True)

    def _hand_over(self, active: ActiveRun, error: BaseException | None, *, leave: bool) -> None:
        """Have the run marked interrupted and its next attempt left pending for another instance."""
        detail = f"interrupted on {self.instance_id} by stop(); handed over to the next attempt"

        def handed(pair: Any) -> None:  # on the recorder's thread
            try:
                if not pair:
                    return
                old, new = pair
                active.run = old
                metrics.RUNS.labels(old.job, old.status).inc()
                self._log_end(active)
                if new is None:
                    self._announce(signals.run_failed, run=old, exception=AttemptsExhausted(old.error_message))
                    return
                metrics.HAND_OVERS.labels(old.job).inc()
                logger.info(
                    "Handed over %s slot=%s: attempt %d is pending for another instance",
                    old.job,
                    old.slot,
                    new.attempt,
                    extra=log_fields(new, self.instance_id),
                )
                self._announce(signals.run_interrupted, run=old, exception=error)
            finally:
                self._settled(active, leave)

        ending = self._ending(active, handed, hand_over=True, detail=detail, max_attempts=self.settings.max_attempts)
        self.recorder.submit(ending)

    def _announce(self, signal: Any, **kwargs: Any) -> None:
        """Send a signal through the outbox, unless nobody listens (a run's end costs nothing then)."""
        if signal.receivers and signal.has_listeners(Run):
            self.outbox(signal, **kwargs)

    def _log_end(
        self,
        active: ActiveRun,
        what: str | None = None,
        *,
        level: int | None = None,
        after: str = "",
        error: BaseException | None = None,
    ) -> None:
        """The one end line of a run: ``Run <what>: job slot attempt reason instance duration``.

        ``what`` defaults to the status just recorded (then also a ``status``
        field). A failure is logged at ERROR with the handler's exception as
        ``exc_info`` (so Sentry's logging integration sees it), an interruption
        at WARNING, a success at INFO.
        """
        run = active.run
        if level is None:
            status = run.status if what is None else ""
            level = END_LEVELS.get(status, logging.INFO)
        if not logger.isEnabledFor(level):
            return  # most ends are INFO lines: a project logging from WARNING builds none of it
        # A run ended before its handler was called (stopped, lost or paused before its slot) ran for
        # no time at all: its line says so, and its duration field is None.
        duration = (active.returned_at or time.monotonic()) - active.started if active.ran else None
        fields = {**log_fields(run, self.instance_id), "duration": duration}
        if what is None:
            fields["status"] = run.status
            if run.error_type:
                after = f"{after} error={run.error_type}: {run.error_message}"
        logger.log(
            level,
            "Run %s: %s slot=%s attempt=%d reason=%s instance=%s %s%s",
            what if what is not None else run.status,
            run.job,
            run.slot,
            run.attempt,
            run.reason,
            self.instance_id,
            "handler not started" if duration is None else f"duration={duration:.3f}s",
            after,
            exc_info=(type(error), error, error.__traceback__) if error is not None else None,
            extra=fields,
        )
