"""One attempt: wait for its slot, build the context, call the handler (or enqueue the task job's task),
hand the result to the run table."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.db import InterfaceError, OperationalError, connections

from . import metrics, signals, store, taskjobs
from .clock import Clock, sleep
from .conf import check_json
from .context import Context, make_context
from .dbtrouble import break_off, reset_connection, socket_of, sqlite_wait
from .models import Reason
from .registry import returned_generator
from .runs import ActiveRun, RunTable, log_fields
from .taskjobs import TaskArguments
from .workers import CLOCK_RECHECK_S, Starter, Workers, check_kept_connections, tidy_connections

logger = logging.getLogger("django_anarchon")
# Runs released together are started by one worker first, not by a worker each: sixteen threads
# woken at once pass the GIL back and forth at every blocking call (a write, a query), and that
# more than doubled the CPU a run cost, the handler's own included (docs/performance.md). How many
# workers a burst calls for is learnt from handlers that started alone: their time over their CPU time
# (a handler that mostly waits on the database or a service calls for more threads; one that mostly
# computes gains nothing from a second, which would only queue for the GIL). Every STALL_S while
# runs wait, workers are added up to that many; and doubled (up to MAX_WORKERS) when no worker has
# taken a run for STUCK_S, so that handlers that block hold up the runs behind them that long at most.
STALL_S = 0.001
STUCK_S = 0.005
# How long to wait before trying again when no worker thread could be started.
RETRY_S = 0.1
# save_progress() on a database error: the first wait before trying again, and the longest
# (doubling in between); it gives up when the run is fenced (see RunTable.fence_if_overdue).
SAVE_RETRY_S = 0.05
SAVE_RETRY_MAX_S = 1.0
# How the learnt fan-out follows each solo run it learns from (a moving average).
FANOUT_WEIGHT = 0.2
# Learn from one solo run in this long at most: timing a call reads the thread's CPU time and its
# switch counts before and after it (four system calls, more than the rest of a quick run costs
# its worker), and a moving average needs a sample now and then, not one per run.
LEARN_EVERY_S = 0.05
# A handler starting this long after the start its claim wrote (it waited for a worker) has its real
# start written with its end: the admin's start and duration are off by less than this.
LATE_START_MS = 500


try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

if resource is not None and hasattr(resource, "RUSAGE_THREAD"):  # Linux

    def _switches() -> tuple[int, int] | None:
        """How often this thread has waited (voluntary switches), and been taken off the CPU while it could run."""
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return usage.ru_nvcsw, usage.ru_nivcsw

else:

    def _switches() -> tuple[int, int] | None:
        return None  # not known here: every call counts as one that waited


def _calls_for(wall: float, cpu: float, before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Threads a handler calls for, from one call alone: its time over its CPU time; None when that says nothing.

    A call that never waited (no voluntary switch) computed all along: one
    thread, however long a busy machine held it off the CPU. A call that
    waited and was also held off the CPU is left out: what part of its time
    was waiting cannot be told.
    """
    if before is not None and after is not None:
        if after[0] == before[0]:
            return 1.0
        if after[1] != before[1]:
            return None
    return wall / max(cpu, 1e-6)


@contextlib.contextmanager
def _broken_off_when_aborted(active: ActiveRun, connection: Any) -> Iterator[None]:
    """While inside, a run's signal aborting (but for ``stop()``) breaks off what waits on ``connection``.

    After ``stop()`` the run is still this instance's until its handler returns, and a note saved
    then is kept: that wait goes on. A fence, a lost lease or a timeout ends the run here, and a
    statement still waiting on a database that stopped answering is broken off (see
    :func:`dbtrouble.break_off`): the handler gets the signal's reason at once.
    """
    descriptor = socket_of(connection)
    lock = threading.Lock()
    inside = True

    def interrupt() -> None:
        with lock:
            if inside and descriptor is not None and active.cause != "stop":
                break_off(descriptor)

    remove = active.signal.on_abort(interrupt)
    try:
        yield
    finally:
        with lock:
            inside = False
        remove()


async def _invoke(handler: Callable[[Context], Any], ctx: Context) -> BaseException | None:
    """Await an async handler; return what it raised instead of letting it reach the loop.

    ``ThreadSensitiveContext`` gives the run its own thread for
    ``sync_to_async`` (and the ORM's ``a*`` methods), so that async runs do not
    queue behind each other on one shared thread. That thread ends with the
    run, so its connections are closed with it.
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


class Runner:
    """Executes the attempts an instance holds, on at most ``MAX_WORKERS`` worker threads at once.

    A run released when no worker is free waits in a local queue, and the next
    worker whose handler returns takes it at once: the instance may hold more
    runs than it has workers when its handlers are quick (see
    :meth:`RunTable.capacity`), and those start a moment later instead of being
    left undecided and claimed again. A burst of runs is taken by one worker
    first, and by as many more as handlers call for (``STALL_S``; the
    starter's thread looks after runs left waiting).
    """

    def __init__(
        self,
        table: RunTable,
        clock: Clock,
        *,
        token: str,
        instance_id: str,
        lease_ttl: float,
        max_workers: int,
        event_loop: Callable[[], asyncio.AbstractEventLoop],
        watch: Callable[[], None],
    ) -> None:
        self.table = table
        self.clock = clock
        self.token = token
        self.instance_id = instance_id
        self.lease_ttl = lease_ttl
        self.max_workers = max_workers
        self.event_loop = event_loop  # where async handlers run, started on first use
        self.watch = watch  # a deadline was just set: the watchdog should look again
        self.workers = Workers()
        self.starter = Starter(clock.exact_ms, self._hand_on, self._unstall)
        self._lock = threading.Lock()
        self._executing = 0  # tasks on workers (each runs attempts until the local queue is empty)
        self._ready: collections.deque[ActiveRun] = collections.deque()  # released, waiting for a worker
        self._watched = False  # the starter looks after runs left waiting (see _unstall)
        self._fanout: float | None = None  # workers a burst calls for, learnt from solo runs (see STALL_S)
        self._taken_at = 0.0  # monotonic time a worker last took a run
        self._retry_at = 0.0  # no worker could be started: not before this monotonic time again
        self._learn_at = 0.0  # monotonic time from which a solo run is timed to learn from (LEARN_EVERY_S)

    def start(self, active: ActiveRun) -> None:
        """Execute ``active`` on a worker: at once, or at its slot if it was claimed ahead."""
        self.start_many([active])

    def start_many(self, actives: list[ActiveRun]) -> None:
        """:meth:`start` each of ``actives``: those claimed ahead go to the starter together."""
        now = self.clock.now_ms()
        ahead = [active for active in actives if active.run.slot > now]
        if ahead:
            self.starter.add_many(ahead)
        if len(ahead) < len(actives):
            for active in actives:
                if active.run.slot <= now:
                    self._hand_on(active)

    def waiting(self) -> int:
        """How many released runs wait for a free worker."""
        return len(self._ready)

    def _hand_on(self, active: ActiveRun) -> None:
        """Give a released run to a worker, or queue it for the next worker that is free."""
        active.released_at = time.monotonic()
        with self._lock:
            self._ready.append(active)
            wake = self._executing == 0
            if wake:
                self._executing += 1
                active = self._ready.popleft()  # the oldest waiting: runs start in the order released
                self._taken_at = active.released_at
            watch = not wake and not self._watched and self._executing < self.max_workers
            if watch:
                self._watched = True
        if wake:
            self._submit([active])
        elif watch:
            self.starter.watch()

    def _submit(self, taken: list[ActiveRun]) -> None:
        """Start a worker task for each of ``taken`` (already counted in ``_executing``).

        If a worker cannot be had (the process may start no more threads), that
        run and the ones after it go back to the front of the queue, in order,
        no longer counted, and the starter tries again in a moment (RETRY_S).
        """
        for done, active in enumerate(taken):
            try:
                self.workers.submit(active, self._work)
            except Exception:
                logger.exception("Could not start a worker for %r; trying again shortly", active.run.job)
                rest = taken[done:]
                with self._lock:
                    self._executing -= len(rest)
                    self._ready.extendleft(reversed(rest))
                    self._retry_at = time.monotonic() + RETRY_S
                    watch = not self._watched
                    self._watched = True
                if watch:
                    self.starter.watch()
                return

    def _unstall(self) -> float | None:
        """On the starter's thread: more workers for runs left waiting (see ``STALL_S``); seconds to the next look.

        None once no run waits (or every worker is taken): nothing to look after.
        """
        with self._lock:
            if not self._ready or self._executing >= self.max_workers:
                self._watched = False
                return None
            now = time.monotonic()
            oldest = self._ready[0].released_at
            start_at = max(oldest + STALL_S, self._retry_at)
            if now < start_at:
                return start_at - now
            stuck_at = max(self._taken_at, oldest) + STUCK_S
            if self._fanout is None or now >= stuck_at:
                wanted = 2 * self._executing
            else:
                wanted = math.ceil(self._fanout)
            more = min(max(wanted, 1) - self._executing, self.max_workers - self._executing, len(self._ready))
            if more <= 0:
                # As many workers as these handlers call for: only the STUCK_S mark
                # can change that (a worker taking a run moves it on).
                return max(stuck_at - now, STALL_S)
            self._executing += more
            taken = [self._ready.popleft() for _ in range(more)]
            self._taken_at = now
        self._submit(taken)
        return STALL_S

    def _learn(self, ratio: float | None) -> None:
        """A handler started alone called for ``ratio`` threads (see ``_calls_for``): learn what bursts call for."""
        if ratio is None:
            return
        ratio = min(ratio, self.max_workers)
        fanout = self._fanout
        self._fanout = ratio if fanout is None else (1 - FANOUT_WEIGHT) * fanout + FANOUT_WEIGHT * ratio

    def _work(self, active: ActiveRun) -> None:
        """A worker's task: run ``active``, then every run that waits for a worker, then leave."""
        current: ActiveRun | None = active
        while current is not None:
            try:
                self._execute(current)
            except Exception:
                logger.exception("Internal error while running %r", current.run.job, extra={"job": current.run.job})
            with self._lock:
                if self._ready:
                    current = self._ready.popleft()
                    self._taken_at = time.monotonic()
                else:
                    current = None
                    self._executing -= 1

    # -- in the run's thread --------------------------------------------------------------

    def _execute(self, active: ActiveRun) -> None:
        """Wait for the run's slot, call its handler, hand the ending to the run table (which records it)."""
        run = active.run
        while (early := (run.slot - self.clock.now_ms()) / 1000) > 0:
            if active.signal.wait(min(early, CLOCK_RECHECK_S)):
                break  # stopped (or lost) before its slot: ended below, never started
        # The last moment before the handler: a run whose lease this instance may
        # no longer hold (the process was frozen while the run waited for its slot,
        # and another instance has taken it over) is fenced here, and a run already
        # lost, fenced or stopped is never started and sends no run_started.
        self.table.fence_if_overdue(active)
        if not active.begin_start():
            self.table.returned(active)
            self.table.finish(active, active.signal.reason, started=False)
            return
        started_ms = self.clock.exact_ms()
        metrics.LATENESS.labels(run.job).observe(max(0.0, started_ms - run.slot) / 1000)
        if run.started_at is not None and started_ms - run.started_at.timestamp() * 1000 > LATE_START_MS:
            # It waited for a worker well past what its claim wrote as its start (the claim itself,
            # or its slot): the real start is written with its end, and its receivers get it.
            active.late_start = run.started_at = datetime.fromtimestamp(started_ms / 1000, UTC)
        if active.job.timeout_ms:
            active.deadline = active.started + active.job.timeout_ms / 1000
            self.watch()
        # Logged before the receivers run: a slow one may outlast the run's timeout, whose end line
        # would otherwise come before this one.
        if logger.isEnabledFor(logging.INFO):  # spares building the fields in a burst of starts
            logger.info(
                "Run started: %s slot=%s attempt=%d reason=%s instance=%s",
                run.job,
                run.slot,
                run.attempt,
                run.reason,
                self.instance_id,
                extra=log_fields(run, self.instance_id),
            )
        if run.reason == Reason.TAKEOVER:
            signals.send(signals.run_taken_over, run=run)
        signals.send(signals.run_started, run=run)
        job = active.job
        if active.signal.aborted:
            # Stopped, timed out, fenced or lost while run_started's receivers ran (a slow one can
            # outlast SHUTDOWN_GRACE, and the run is handed over meanwhile): the handler is not
            # called, as if it had raised the signal's reason at once, so that it cannot run here
            # after the next attempt was given to another instance.
            tidy_connections()  # the receivers may have used this thread's connections
            self.table.returned(active)
            self.table.finish(active, active.signal.reason)
            return
        check_kept_connections()
        if job.task is not None:
            arguments = job.task_arguments or TaskArguments(data=False)
            self.table.finish_enqueued(active, lambda: taskjobs.enqueue(job.task, arguments, run.slot, run.data))
            tidy_connections()
            return
        before = None
        if self._executing == 1 and not job.is_async and active.started >= self._learn_at:
            self._learn_at = active.started + LEARN_EVERY_S
            before = (time.monotonic(), time.thread_time(), _switches())
        error = self._call(active)
        if before is not None:
            wall, cpu, switches = before
            self._learn(_calls_for(time.monotonic() - wall, time.thread_time() - cpu, switches, _switches()))
        tidy_connections()  # before this thread takes another run: no transaction left open
        self.table.returned(active)
        self.table.finish(active, error)

    def _context(self, active: ActiveRun) -> Context:
        run = active.run

        def save(value: Any) -> None:
            check_json(value, f"Progress of job {run.job!r}")
            if active.cause != "stop":
                # After stop() the lease is still ours until the handler returns,
                # so "on abort, save the note, then raise" works; after a timeout
                # or a lost lease there is nothing left to write to.
                active.signal.throw_if_aborted()
            fence_after = self.table.settings.fence_after
            delay, give_up_at = SAVE_RETRY_S, time.monotonic() + fence_after
            connection = connections[store.alias()]
            while True:
                sent = time.monotonic()
                try:
                    # A database that stopped answering must not hold the handler past the moment its
                    # run is fenced (or lost, or timed out): it would still be waiting here when a
                    # backup starts the next attempt (helper 35).
                    with (
                        _broken_off_when_aborted(active, connection),
                        sqlite_wait(connection, active.renewed_at + fence_after - sent),
                    ):
                        ours = store.save_progress(run.id, value, owner=self.token, ttl=self.lease_ttl)
                    break
                except (OperationalError, InterfaceError):
                    # The database went away for a moment (a restart, a failover): the note waits
                    # for it as the lease's renewals do, and the run goes on. Never past the moment
                    # the run is fenced, though (the handler gets the fence's Interrupted), nor
                    # longer than that while renewals do go through (it gets the error).
                    reset_connection(store.alias())
                    now = time.monotonic()
                    left = min(active.renewed_at + self.table.settings.fence_after, give_up_at) - now
                    if left <= 0:
                        self.table.fence_if_overdue(active, now)
                        active.signal.throw_if_aborted()
                        raise
                    if active.cause == "stop":
                        sleep(min(delay, left))  # the run is still ours after stop(): keep trying
                    elif active.signal.wait(min(delay, left)):
                        active.signal.throw_if_aborted()
                    delay = min(2 * delay, SAVE_RETRY_MAX_S)
                finally:
                    if active.job.is_async:
                        connections.close_all()  # an executor thread's connection
            if not ours:
                self.table.lose(active, "its lease was lost while saving progress")
                active.signal.throw_if_aborted()
            active.renewed_at = max(active.renewed_at, sent)

        return make_context(
            name=run.job,
            slot=run.slot,
            scheduled_at=store.slot_datetime(run.slot),
            instance_id=self.instance_id,
            attempt=run.attempt,
            reason=run.reason,
            manual=run.manual,
            signal=active.signal,
            data=run.data,
            progress=run.progress,
            _save=save,
            # A sleep that outlasted the lease (the process was frozen) wakes before the
            # keeper has looked: the handler is fenced at once rather than let go on.
            _recheck=lambda: self.table.fence_if_overdue(active),
        )

    def _call(self, active: ActiveRun) -> BaseException | None:
        ctx = self._context(active)
        if active.job.is_async:
            future = asyncio.run_coroutine_threadsafe(_invoke(active.job.handler, ctx), self.event_loop())
            try:
                return future.result()
            except BaseException as error:  # noqa: B036 - the loop was shut down under the run
                return error
        try:
            result = active.job.handler(ctx)
        except BaseException as error:  # noqa: B036 - every ending is recorded, none escapes
            return error
        if result is None:
            return None  # most handlers: nothing to look into
        if (refused := returned_generator(active.run.job, result)) is not None:
            return refused
        if inspect.isawaitable(result):
            # A plain callable that returned a coroutine (a lambda calling an async function, an
            # object whose __call__ returns one): awaited on the event loop as an async def's
            # would be, not recorded a success with its body never run.
            future = asyncio.run_coroutine_threadsafe(_invoke(lambda _: result, ctx), self.event_loop())
            try:
                return future.result()
            except BaseException as error:  # noqa: B036 - the loop was shut down under the run
                return error
        return None


__all__ = ["Runner"]
