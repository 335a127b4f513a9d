"""Runs one claimed run: context, handler, outcome, record, signals, log lines."""

from __future__ import annotations

import asyncio
import collections
import functools
import heapq
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.db import connections

from . import signals, store
from .conf import check_json
from .context import Context
from .exceptions import AttemptsExhausted
from .models import Reason, Run, Status
from .recorder import HAND_OVER, Outcome
from .registry import Job
from .signal import AbortSignal

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger("django_anarchon")
MAX_MESSAGE = 10_000
# The longest a run claimed ahead waits for its slot on one reading of the clock. The
# wall clock can be stepped at any time (NTP, an operator, a VM resumed); until the
# engine has measured the database clock again, a reading taken then is off by the
# step. A wait longer than this reads the clock again, so a run claimed 100 ms ahead
# never waits out a whole step back.
CLOCK_RECHECK_S = 0.25
MAX_TRACEBACK = 100_000
# The longest a run whose handler has returned holds back its ending for runs still
# starting (see Starting): a burst of a few hundred runs starts well within it.
ENDING_DEFER_S = 0.05

RUNNING, FINISHING, DONE = "running", "finishing", "done"
# An attempt's cause of ending, as log lines say it ("Run ended after it was timed out").
CAUSE_WORDS = {
    "stop": "stopped",
    "timeout": "timed out",
    "lost": "lost",
    "fenced": "fenced",
}


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
        self.deadline: float | None = None  # set when the handler starts (a run may be claimed ahead)
        self.returned = False  # the handler is over (or never started): no longer uses a worker
        self.returned_at: float | None = None  # monotonic time it did
        self.cause: str | None = None
        self.finished = threading.Event()  # set when its worker is done with it
        self._state = RUNNING
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<ActiveRun {self.run.job} slot={self.run.slot} attempt={self.run.attempt} {self._state}>"

    @property
    def state(self) -> str:
        return self._state

    def begin_finish(self) -> bool:
        """Claim the right to end this run; False if someone else already did."""
        with self._lock:
            if self._state != RUNNING:
                return False
            self._state = FINISHING
            return True

    def done(self) -> None:
        with self._lock:
            self._state = DONE

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
        self.signal.abort(reason)


def describe_error(error: BaseException) -> tuple[str, str, str]:
    """(type, message, traceback) of ``error``, bounded so a huge one cannot swamp the table."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    try:
        message = str(error)
    except Exception:  # a broken __str__ must not lose the record
        message = f"<unprintable {name}>"
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + f"… [{len(message) - MAX_MESSAGE} more characters]"
    text = "".join(traceback.format_exception(kind, error, error.__traceback__))
    if len(text) > MAX_TRACEBACK:
        text = text[: MAX_TRACEBACK // 2] + "\n… [traceback cut] …\n" + text[-MAX_TRACEBACK // 2 :]
    return name, message, text


def log_fields(run: Run, instance_id: str) -> dict[str, Any]:
    return {
        "job": run.job,
        "slot": run.slot,
        "attempt": run.attempt,
        "reason": run.reason,
        "instance": instance_id,
        "run_id": run.id,
    }


async def _invoke(handler: Callable[[Context], Any], ctx: Context) -> BaseException | None:
    """Await an async handler; return what it raised instead of letting it reach the loop.

    ``ThreadSensitiveContext`` gives the run its own thread for
    ``sync_to_async`` (and the ORM's ``a*`` methods), so that async runs do not
    queue behind each other on one shared thread.
    """
    try:
        async with ThreadSensitiveContext():
            try:
                await handler(ctx)
            finally:
                await sync_to_async(connections.close_all)()
    except BaseException as error:  # noqa: B036 - SystemExit/KeyboardInterrupt must not stop the loop
        return error
    return None


class Workers:
    """Daemon threads that run handlers: idle ones wait for work, a new one starts when none is idle.

    Reusing threads keeps the start of a run to a queue hand-off. A handler
    that ignores its signal past a timeout keeps its thread; the pool simply
    starts another, and being daemons, such threads never hold up exit.
    Threads idle for a minute leave.

    A task returns whether it queued a follow-up with :meth:`follow`: its
    thread then stays reserved for one queued task (it is not counted idle),
    so every task in the queue has a thread on its way.
    """

    IDLE_EXIT = 60.0

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[ActiveRun], bool], ActiveRun]] = queue.SimpleQueue()
        # One token per idle thread not yet reserved for a task. deque.append() and
        # pop() are atomic: a hundred runs released at once do not queue on a lock.
        self._idle: collections.deque[None] = collections.deque()
        self._count = itertools.count(1)

    def submit(self, active: ActiveRun, work: Callable[[ActiveRun], bool]) -> None:
        self._tasks.put((work, active))
        try:
            self._idle.pop()
        except IndexError:
            thread = threading.Thread(target=self._serve, name=f"anarchon-worker-{next(self._count)}", daemon=True)
            thread.start()

    def follow(self, active: ActiveRun, work: Callable[[ActiveRun], bool]) -> None:
        """Queue ``work`` behind the tasks already queued; only a worker's own task calls this.

        That task must then return True: its thread is the one reserved for the
        new task, and takes the first queued task when it is done with its own.
        """
        self._tasks.put((work, active))

    def _serve(self) -> None:
        while True:
            try:
                work, active = self._tasks.get(timeout=self.IDLE_EXIT)
            except queue.Empty:
                try:
                    self._idle.pop()
                except IndexError:
                    continue  # reserved for a task on its way
                return  # nobody reserved this thread: leave
            if not work(active):
                self._idle.append(None)


class Starter:
    """One thread that hands runs claimed ahead of their slot to the workers when the slot comes.

    Runs due at the same instant are released together, in one go, so the
    first free worker starts them back to back. A worker per run sleeping
    until the slot would have every one of those threads wake at the same
    instant and queue for the GIL: a hundred simultaneous runs then started
    over 5-30 ms instead of well under one. A run whose signal aborts first
    (stop, a lost lease) is released at once, to be ended by its worker.
    The thread exists while runs wait.
    """

    def __init__(
        self,
        now_ms: Callable[[], float],
        release: Callable[[ActiveRun], None],
        releasing: Callable[[int], None] | None = None,
    ) -> None:
        self._now_ms = now_ms
        self._release = release
        self._releasing = releasing  # told how many runs are about to be released, before the first
        self._waiting: list[tuple[int, int, ActiveRun]] = []  # a heap by slot
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, active: ActiveRun) -> None:
        with self._changed:
            heapq.heappush(self._waiting, (active.run.slot, next(self._order), active))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="anarchon-starter", daemon=True)
                self._thread.start()
            self._changed.notify()
        active.signal.on_abort(self._wake)

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify()

    def _serve(self) -> None:
        while True:
            with self._changed:
                while True:
                    if not self._waiting:
                        self._thread = None
                        return
                    now = self._now_ms()
                    due: list[tuple[int, int, ActiveRun]] = []
                    later: list[tuple[int, int, ActiveRun]] = []
                    for entry in self._waiting:
                        (due if entry[0] <= now or entry[2].signal.aborted else later).append(entry)
                    if due:
                        self._waiting = later
                        heapq.heapify(self._waiting)
                        break
                    self._changed.wait(min((self._waiting[0][0] - now) / 1000, CLOCK_RECHECK_S))
            if self._releasing is not None:
                self._releasing(len(due))
            for _, _, active in sorted(due, key=lambda entry: entry[:2]):
                try:
                    self._release(active)
                except Exception:  # a run that cannot be handed on must not stop the others
                    logger.exception("Internal error while starting %r", active.run.job, extra={"job": active.run.job})


class Starting:
    """Counts the runs handed to a worker whose handler has not been called yet.

    A handler that returns while other runs are still starting (a hundred due
    at the same instant) waits for them, for at most ``ENDING_DEFER_S``, before
    its ending is recorded: that work (the outcome handed to the recorder, the
    signals, the log line, waking the loop) would otherwise take the GIL from
    the starts still to come. Measured in one process with a hundred trivial
    runs due at once: 100-125 µs per start with the endings mixed in, 55 µs
    without them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._none = threading.Event()
        self._none.set()

    def add(self, count: int = 1) -> None:
        """``count`` runs are about to be handed to workers (counted before the first is, so
        that the first to begin cannot find none left while the rest are being handed on)."""
        with self._lock:
            self._count += count
            self._none.clear()

    def pending(self) -> bool:
        """Whether a run handed to a worker has not had its handler called yet."""
        return self._count > 0

    def begun(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count <= 0:
                self._count = 0
                self._none.set()

    def wait_done(self, timeout: float) -> bool:
        """Wait until no run is starting, or ``timeout`` seconds; whether none is."""
        return self._none.wait(timeout)


class Runner:
    """Executes runs on worker threads for an :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.workers = Workers()
        self.starting = Starting()
        self.starter = Starter(lambda: engine.clock.exact_ms(), self._hand_on, releasing=self.starting.add)

    def start(self, active: ActiveRun) -> None:
        """Execute ``active`` on a worker: at once, or at its slot if it was claimed ahead."""
        active.finished.clear()
        if active.run.slot > self.engine.clock.now_ms():
            self.starter.add(active)
        else:
            self._submit(active)

    def _submit(self, active: ActiveRun) -> None:
        self.starting.add()
        self._hand_on(active)

    def _hand_on(self, active: ActiveRun) -> None:
        """Give a run already counted in :attr:`starting` to a worker."""
        try:
            self.workers.submit(active, self._execute)
        except BaseException:
            self.starting.begun()
            raise

    # -- in the run's thread --------------------------------------------------------

    def _execute(self, active: ActiveRun) -> bool:
        """Wait for the run's slot, call its handler, end it; whether its ending was queued (see below).

        A handler that returns while runs of the same instant still wait for a
        worker (a hundred trivial jobs due at once) leaves its ending to a task
        of its own, queued behind those starts, and this thread, which holds the
        GIL, takes the next start at once. Otherwise every run of the burst
        woke a thread of its own: a hundred trivial runs started over 5 ms on
        this machine, one every ~50 µs, where threads that take the next run
        when free (as thread pools do) start them within ~1 ms.
        """
        starting = True
        ending = False  # _end() exits the run from here on
        try:
            run = active.run
            while (early := (run.slot - self.engine.clock.now_ms()) / 1000) > 0:
                if active.signal.wait(min(early, CLOCK_RECHECK_S)):
                    # Claimed ahead of its slot and stopped before it was due: end it
                    # like a handler that raised at once (handed over after stop()).
                    starting = False
                    self.starting.begun()
                    self._returned(active)
                    self._complete(active, active.signal.reason, started=False)
                    return False
            # The last moment before the handler: a run whose lease this instance may
            # no longer hold (the process was frozen while the run waited for its slot,
            # and another instance has taken it over) is fenced here, and a run already
            # lost, fenced or stopped is never started and sends no run_started.
            self.engine.keeper.fence_overdue()
            if active.state != RUNNING or active.signal.aborted:
                starting = False
                self.starting.begun()
                self._returned(active)
                self._complete(active, active.signal.reason, started=False)
                return False
            active.started = time.monotonic()
            if active.job.timeout_ms:
                active.deadline = active.started + active.job.timeout_ms / 1000
                self.engine.watch()
            if run.reason == Reason.TAKEOVER:
                signals.send(signals.run_taken_over, run=run)
            signals.send(signals.run_started, run=run)
            if logger.isEnabledFor(logging.INFO):  # spares building the fields in a burst of starts
                logger.info(
                    "Run started: %s slot=%s attempt=%d reason=%s instance=%s",
                    run.job,
                    run.slot,
                    run.attempt,
                    run.reason,
                    self.engine.instance_id,
                    extra=log_fields(run, self.engine.instance_id),
                )
            starting = False
            self.starting.begun()
            error = self._call(active)
            self._returned(active)
            if self.starting.pending():
                connections.close_all()  # the handler's own: the next run on this thread gets fresh ones
                self.workers.follow(active, functools.partial(self._end, error=error))
                ending = True
                return True
            ending = True
            self._end(active, error)
        except Exception:
            logger.exception("Internal error while running %r", active.run.job, extra={"job": active.run.job})
        finally:
            if starting:
                self.starting.begun()
            if not ending:
                self._exited(active)
        return False

    def _end(self, active: ActiveRun, error: BaseException | None) -> bool:
        """Record the ending of a run whose handler has returned, once the runs due with it have started."""
        try:
            self.starting.wait_done(ENDING_DEFER_S)
            self._complete(active, error)
        except Exception:
            logger.exception("Internal error while ending %r", active.run.job, extra={"job": active.run.job})
        finally:
            self._exited(active)
        return False

    def _exited(self, active: ActiveRun) -> None:
        connections.close_all()  # the handler's and the receivers' own: each run gets fresh ones
        active.finished.set()
        self.engine.run_exited(active)

    def _returned(self, active: ActiveRun) -> None:
        """The run's handler is over: its worker no longer counts against ``MAX_WORKERS``.

        Its end may still be waiting to be recorded (see ``recorder.COLLECT_S``);
        the lease stays renewed until it is.
        """
        active.returned_at = time.monotonic()
        active.returned = True
        self.engine.handler_returned()

    def _context(self, active: ActiveRun) -> Context:
        run = active.run

        def save(value: Any) -> None:
            check_json(value, f"Progress of job {run.job!r}")
            if active.cause != "stop":
                # After stop() the lease is still ours until the handler returns,
                # so "on abort, save the note, then raise" works; after a timeout
                # or a lost lease there is nothing left to write to.
                active.signal.throw_if_aborted()
            sent = time.monotonic()
            try:
                ours = store.save_progress(run.id, value, owner=self.engine.token, ttl=self.engine.settings.lease_ttl)
            finally:
                if active.job.is_async:
                    connections.close_all()  # an executor thread's connection
            if not ours:
                self.engine.keeper.lose(active, "its lease was lost while saving progress")
                active.signal.throw_if_aborted()
            active.renewed_at = max(active.renewed_at, sent)

        return Context(
            name=run.job,
            slot=run.slot,
            scheduled_at=store.slot_datetime(run.slot),
            instance_id=self.engine.instance_id,
            attempt=run.attempt,
            reason=run.reason,
            manual=run.manual,
            signal=active.signal,
            data=run.data,
            progress=run.progress,
            _save=save,
        )

    def _call(self, active: ActiveRun) -> BaseException | None:
        ctx = self._context(active)
        if active.job.is_async:
            future = asyncio.run_coroutine_threadsafe(_invoke(active.job.handler, ctx), self.engine.event_loop())
            try:
                return future.result()
            except BaseException as error:  # noqa: B036 - the loop was shut down under the run
                return error
        try:
            active.job.handler(ctx)
        except BaseException as error:  # noqa: B036 - every ending is recorded, none escapes
            return error
        return None

    def _complete(self, active: ActiveRun, error: BaseException | None, *, started: bool = True) -> None:
        if not active.begin_finish():
            if started:
                what = f"ended after it was {CAUSE_WORDS.get(active.cause or '', 'ended')}"
                self._log_end(active, what, after="; its end changes nothing")
            else:
                what = f"not started: it was {CAUSE_WORDS.get(active.cause or '', 'ended')} before its slot"
                self._log_end(active, what, level=logging.WARNING)
            return
        try:
            if error is not None and active.signal.aborted and active.cause == "stop":
                self.hand_over(active, error)
            elif error is None and active.overran():
                # It returned after its deadline, before the watchdog came round: what
                # happened first decides, and the timeout did.
                self.record(active, Status.FAILED, timeout_error(active))
            elif error is None:
                self.record(active, Status.SUCCESS, None)
            else:
                self.record(active, Status.FAILED, error)
        finally:
            active.done()

    # -- endings (also used by the engine) -------------------------------------------

    def record(self, active: ActiveRun, status: str, error: BaseException | None) -> None:
        """Record a final status for a run we are ending (through the recorder), then signal and log it."""
        run = active.run
        kind, message, text = describe_error(error) if error is not None else ("", "", "")
        ours = self.engine.recorder.record(
            Outcome(active, status, error_type=kind, error_message=message, traceback=text)
        )
        if ours is None:
            return  # logged by the recorder: the database stayed unreachable
        if not ours:
            self._log_end(
                active, "ended but was no longer ours to record (lease expired or taken over)", level=logging.WARNING
            )
            return
        run.status, run.error_type, run.error_message, run.traceback = status, kind, message, text
        run.finished_at = store.slot_datetime(self.engine.clock.now_ms())
        self._log_end(active)
        if status == Status.SUCCESS:
            signals.send(signals.run_succeeded, run=run)
        else:
            signals.send(signals.run_failed, run=run, exception=error)

    def hand_over(self, active: ActiveRun, error: BaseException | None) -> None:
        """Mark the run interrupted and leave its next attempt pending for another instance."""
        detail = f"interrupted on {self.engine.instance_id} by stop(); handed over to the next attempt"
        pair = self.engine.recorder.record(Outcome(active, HAND_OVER, detail=detail))
        if not pair:
            return
        old, new = pair
        active.run = old
        if new is None:
            self._log_end(active, level=logging.ERROR)
            signals.send(signals.run_failed, run=old, exception=AttemptsExhausted(old.error_message))
            return
        self._log_end(active)
        logger.info(
            "Handed over %s slot=%s: attempt %d is pending for another instance",
            old.job,
            old.slot,
            new.attempt,
            extra=log_fields(new, self.engine.instance_id),
        )
        signals.send(signals.run_interrupted, run=old, exception=error)

    def _log_end(
        self, active: ActiveRun, what: str | None = None, *, level: int = logging.INFO, after: str = ""
    ) -> None:
        """The one end line of a run (SPEC 7): ``Run <what>: job slot attempt reason instance duration``.

        ``what`` defaults to the status just recorded (then also a ``status`` field).
        """
        run = active.run
        duration = time.monotonic() - active.started
        fields = {**log_fields(run, self.engine.instance_id), "duration": duration}
        if what is None:
            fields["status"] = run.status
        logger.log(
            level,
            "Run %s: %s slot=%s attempt=%d reason=%s instance=%s duration=%.3fs%s",
            what if what is not None else run.status,
            run.job,
            run.slot,
            run.attempt,
            run.reason,
            self.engine.instance_id,
            duration,
            after,
            extra=fields,
        )


def timeout_error(active: ActiveRun) -> TimeoutError:
    seconds = (active.job.timeout_ms or 0) / 1000
    return TimeoutError(f"Job {active.job.name!r} ran past its timeout of {seconds:g}s")


def describe_loss(row: Run) -> str:
    if row.status == Status.INTERRUPTED and "replaced" in row.detail:
        return f"it was replaced: {row.detail}"
    if row.status == Status.RUNNING:
        return "its lease expired before it could be renewed"
    return f"another instance recorded it as {row.status}" + (f" ({row.detail})" if row.detail else "")


__all__ = ["ActiveRun", "Runner", "Workers", "describe_error", "describe_loss", "timeout_error"]
