"""One attempt: wait for its slot, build the context, call the handler, hand the result to the run table."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.db import connections

from . import metrics, signals, store
from .clock import Clock
from .conf import check_json
from .context import Context
from .models import Reason
from .runs import ActiveRun, Phase, RunTable, log_fields
from .workers import CLOCK_RECHECK_S, Starter, Starting, Workers, tidy_connections

logger = logging.getLogger("django_anarchon")
# The longest a run whose handler has returned holds back its ending for runs still
# starting (see workers.Starting): a burst of a few hundred runs starts well within it.
ENDING_DEFER_S = 0.05


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
    """Executes the attempts an instance holds, on worker threads."""

    def __init__(
        self,
        table: RunTable,
        clock: Clock,
        *,
        token: str,
        instance_id: str,
        lease_ttl: float,
        event_loop: Callable[[], asyncio.AbstractEventLoop],
        watch: Callable[[], None],
    ) -> None:
        self.table = table
        self.clock = clock
        self.token = token
        self.instance_id = instance_id
        self.lease_ttl = lease_ttl
        self.event_loop = event_loop  # where async handlers run, started on first use
        self.watch = watch  # a deadline was just set: the watchdog should look again
        self.workers = Workers()
        self.starting = Starting()
        self.starter = Starter(clock.exact_ms, self._hand_on, releasing=self.starting.add)

    def start(self, active: ActiveRun) -> None:
        """Execute ``active`` on a worker: at once, or at its slot if it was claimed ahead."""
        active.finished.clear()
        if active.run.slot > self.clock.now_ms():
            self.starter.add(active)
        else:
            self.starting.add()
            self._hand_on(active)

    def _hand_on(self, active: ActiveRun) -> None:
        """Give a run already counted in :attr:`starting` to a worker."""
        try:
            self.workers.submit(active, self._execute)
        except BaseException:
            self.starting.begun()
            raise

    # -- in the run's thread --------------------------------------------------------------

    def _execute(self, active: ActiveRun) -> bool:
        """Wait for the run's slot, call its handler, end it; whether its ending was queued (see below).

        A handler that returns while runs of the same instant still wait for a
        worker (a hundred trivial jobs due at once) leaves its ending to a task
        of its own, queued behind those starts, and this thread, which holds the
        GIL, takes the next start at once, as thread pools do.
        """
        starting = True
        ending = False  # _end() exits the run from here on
        try:
            run = active.run
            while (early := (run.slot - self.clock.now_ms()) / 1000) > 0:
                if active.signal.wait(min(early, CLOCK_RECHECK_S)):
                    break  # stopped (or lost) before its slot: ended below, never started
            # The last moment before the handler: a run whose lease this instance may
            # no longer hold (the process was frozen while the run waited for its slot,
            # and another instance has taken it over) is fenced here, and a run already
            # lost, fenced or stopped is never started and sends no run_started.
            self.table.fence_if_overdue(active)
            if active.state is not Phase.RUNNING or active.signal.aborted:
                starting = False
                self.starting.begun()
                self.table.returned(active)
                self.table.finish(active, active.signal.reason, started=False)
                return False
            active.started = time.monotonic()
            metrics.LATENESS.labels(run.job).observe(max(0.0, self.clock.exact_ms() - run.slot) / 1000)
            if active.job.timeout_ms:
                active.deadline = active.started + active.job.timeout_ms / 1000
                self.watch()
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
                    self.instance_id,
                    extra=log_fields(run, self.instance_id),
                )
            starting = False
            self.starting.begun()
            error = self._call(active)
            tidy_connections()  # before this thread takes another task: no transaction left open
            self.table.returned(active)
            if self.starting.pending():
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
        """End a run whose handler has returned, once the runs due with it have started."""
        try:
            self.starting.wait_done(ENDING_DEFER_S)
            self.table.finish(active, error)
        except Exception:
            logger.exception("Internal error while ending %r", active.run.job, extra={"job": active.run.job})
        finally:
            self._exited(active)
        return False

    def _exited(self, active: ActiveRun) -> None:
        tidy_connections()  # the signal receivers': kept for the next run if still sound
        self.table.exited(active)

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
                ours = store.save_progress(run.id, value, owner=self.token, ttl=self.lease_ttl)
            finally:
                if active.job.is_async:
                    connections.close_all()  # an executor thread's connection
            if not ours:
                self.table.lose(active, "its lease was lost while saving progress")
                active.signal.throw_if_aborted()
            active.renewed_at = max(active.renewed_at, sent)

        return Context(
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
            active.job.handler(ctx)
        except BaseException as error:  # noqa: B036 - every ending is recorded, none escapes
            return error
        return None


__all__ = ["ENDING_DEFER_S", "Runner"]
