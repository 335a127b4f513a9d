"""The running scheduler: wiring, start and stop, and the loop.

Each part has one job and is handed the few objects it needs (never the engine):

* :class:`~.slots.SlotQueue` and :class:`~.slots.ShareOut` (pure): which slots
  are due, and which of them this instance claims first;
* :class:`~.clock.Clock` and :class:`~.clock.ClockEstimate` (pure): the
  database-aligned clock;
* :class:`~.runs.RunTable`: the runs held here, and every ending;
* :class:`~.runner.Runner` (with :mod:`.workers`): one attempt on a worker thread;
* :class:`~.keeper.Keeper`: lease renewal and the watchdog;
* :class:`~.recorder.Recorder`: batched writes of run endings;
* :class:`~.outbox.Outbox`: the signals the loop sends, off the loop thread;
* :class:`~.listener.Listener`: PostgreSQL NOTIFY.

The loop turn: the due slots of the queue go to one ``store.decide`` statement,
the runs won are adopted (handed to the runner), the rest goes back to the queue;
every ``POLL_INTERVAL`` (at once on NOTIFY) pending runs are claimed and expired
leases taken over; every heartbeat the instance says it lives and measures the
database clock. A database error never stops the loop: it is logged once and the
loop backs off (:class:`~.dbtrouble.DbTrouble`). No query lives here; they are
all in :mod:`.store`.

Longer than the other parts because the loop's own steps (start-up catch-up,
the poll and takeovers, housekeeping, measuring the database clock) are each
short and only make sense in the order this loop runs them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from django.db import connections

from . import metrics, signals, store
from .clock import Clock, ClockEstimate, describe_offset
from .conf import AnarchonSettings
from .dbtrouble import FAILED, DbTrouble, forget_outage
from .durations import format_ms
from .keeper import Keeper
from .listener import Listener, listening_available
from .models import Reason, Run, Status
from .outbox import Outbox
from .recorder import Recorder
from .registry import Job
from .runner import Runner
from .runs import ActiveRun, Phase, RunTable, log_fields
from .slots import Batch, CatchUp, ShareOut, SlotQueue, draw_claim_ahead, first_current

logger = logging.getLogger("django_anarchon")
BUSY_RETRY_MS = 20
# How old the list of live instances may be when slots are claimed (see _read_peers).
PEERS_REFRESH_S = 2.0
# A lease seen about to expire is looked at again this long after its expiry (by the
# database clock as estimated here), and a takeover the database refused this long after.
TAKEOVER_MARGIN_S = 0.005
TAKEOVER_RETRY_S = 0.05
# An expiring run of this instance whose end waits for the recorder is looked at again this often
# (the recorder is hurried meanwhile): it is never taken over here, only watched until written.
OWN_ENDING_RECHECK_S = 0.5
# The most slots of failed claims remembered until the next poll looks them up (see _recover_in_doubt).
IN_DOUBT_LIMIT = 10_000
# Hourly, each instance stamps its jobs as declared. The runs of a job no instance has
# declared for three such turns are closed (see store.close_undeclared).
HOUSEKEEPING_EVERY_S = 3600.0
UNDECLARED_GRACE_S = 3 * HOUSEKEEPING_EVERY_S
# History is pruned hourly, off the loop, by one instance of the cluster (see _run_pruner), in
# batches of PRUNE_BATCH runs with a pause after each at least as long as the batch took.
PRUNE_EVERY_S = HOUSEKEEPING_EVERY_S
PRUNE_BATCH = 500
CATCH_UP_BATCH = 500
# A host clock this far off the database's (ms) is warned about (and again when it moves as much).
SKEW_WARN_MS = 1000.0
# On stopping, the least time the signal thread gets to send what is queued (see Engine.stop).
SIGNALS_GRACE_S = 5.0
# On stopping, how long the instance's row may take to be removed before the process goes on without.
UNREGISTER_WAIT_S = 2.0
# On stopping, what the waits after the grace period (ends being recorded, threads, the row) share
# at most, when the database does not answer: the process exits within the grace and this.
AFTER_GRACE_S = 4.0
# After an unexpected error (not a database outage) during start-up, the wait before trying again.
STARTUP_RETRY_S = 5.0
# A run claimed ahead waits for its slot, and a pause committed after its claim read the job's
# row (up to CLAIM_AHEAD_MAX_MS before the slot) would not stop it: this long before the slot,
# the loop reads the jobs' pause once more and withdraws the runs of the jobs paused since. The
# starter holds those runs until that look is made (or fails), even past their slot: a loop that
# comes late starts them late, it does not let a paused job's run through.
PAUSE_CHECK_LEAD_MS = 20
PAUSED_DETAIL = "the job was paused before its slot"
# How long the loop holds back the slots of a job whose run here has just ended, for its end to be
# written first (see Engine._ending_here).
OWN_ENDINGS_WAIT_S = 0.1


class Engine:
    """One running scheduler instance. Created by :meth:`Scheduler.start`."""

    def __init__(
        self,
        jobs: Iterable[Job],
        settings: AnarchonSettings,
        *,
        instance_id: str | None = None,
        clock: Clock | None = None,
        schedule_jobs: bool = True,
    ) -> None:
        self.jobs: dict[str, Job] = {job.name: job for job in jobs}
        self.settings = settings
        self.clock = clock or Clock()
        self.token = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.instance_id = instance_id or settings.instance_id or f"{self.host}:{self.pid}:{self.token[:4]}"
        self.schedule_jobs = schedule_jobs
        self.grace_ms = int(max(2 * settings.poll_interval, 0.5) * 1000)

        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._started = threading.Event()
        self.stopped = threading.Event()
        self.outbox = Outbox()
        forget_outage(self.instance_id)  # a new start: what an earlier engine of this name met is its own
        self.recorder = Recorder(self.token, self.instance_id, settings.lease_ttl)
        self.table = RunTable(
            settings,
            self.instance_id,
            self.recorder,
            self.outbox,
            on_exit=self._run_exited,
            on_returned=self._handler_returned,
        )
        self.keeper = Keeper(self.table, settings, token=self.token, instance_id=self.instance_id)
        self.runner = Runner(
            self.table,
            self.clock,
            token=self.token,
            instance_id=self.instance_id,
            lease_ttl=settings.lease_ttl,
            max_workers=settings.max_workers,
            event_loop=self.event_loop,
            watch=self.keeper.watch,
        )
        self.listener = Listener(self.request_poll, self._stopping, self.instance_id)
        self.queue = SlotQueue(self.jobs.values())
        self.shares = ShareOut(self.jobs, self.token)
        self.estimate = ClockEstimate()
        self.trouble = DbTrouble("the scheduler loop", self.instance_id, store.alias)

        self._poll_requested = True
        self._takeover_at = float("inf")  # time.monotonic() of the next look at a lease about to expire
        self._room_wanted = False  # due slots wait for a worker: wake the loop when a handler returns
        # Pending runs (a takeover, run_now) found no room: the next handler to return asks for a
        # poll, and that poll claims them before new slots take the room.
        self._owed_want_room = False
        self._waiting_jobs: set[str] = set()
        # Slots of claims that failed with no answer from the database: the commit may have gone
        # through (the connection died at the commit). Looked up at the next poll (_recover_in_doubt).
        self._in_doubt: dict[tuple[str, int], None] = {}
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self._warned: set[str] = set()
        self._skew_warned_ms: float | None = None  # the clock offset last warned about, while it lasts
        self._clock_unsure = False  # this host's clock was stepped and the database's not measured since
        self._next_prune = 0.0  # the first housekeeping turn closes runs no instance declares, then hourly
        self.claim_ms = 20.0  # how long claiming transactions take here: recent highs, decaying
        self._peers_read_at = -PEERS_REFRESH_S
        self._alerting = [job for job in self.jobs.values() if job.alert_after_ms]
        # Runs claimed ahead, by when their pause is looked at again (see PAUSE_CHECK_LEAD_MS).
        self._pause_checks: list[tuple[int, int, list[ActiveRun]]] = []
        self._pause_check_order = itertools.count()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        logger.debug(
            "Starting scheduler %s: %d job(s), %s",
            self.instance_id,
            len(self.jobs),
            "scheduling them" if self.schedule_jobs else "running one job in the foreground",
            extra={"instance": self.instance_id},
        )
        targets = [("keeper", self.keeper.run_renewals), ("watchdog", self.keeper.run_watchdog)]
        if self.schedule_jobs:
            targets.insert(0, ("loop", self._run_loop))
            targets.append(("pruner", self._run_pruner))
            if listening_available(self.instance_id):
                targets.append(("listener", self.listener.run))
        for name, target in targets:
            thread = threading.Thread(target=target, name=f"anarchon-{name}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop claiming, abort running handlers, wait for them, hand over the rest.

        Returns True if every handler ended within the grace period.
        """
        grace = self.settings.shutdown_grace if timeout is None else timeout
        deadline = time.monotonic() + grace
        self._stopping.set()
        self._wake.set()
        # The handlers' signals first: the loop may be held up in a query to a database that does
        # not answer, and waiting for it first spent the whole grace before any handler heard of
        # the stop. A run the loop wins after this is aborted as it is added (RunTable.stop).
        self.table.stop(self.instance_id)
        for thread in self._threads:
            if thread.name == "anarchon-loop":
                thread.join(max(0.0, deadline - time.monotonic()))
        for active in self.table.all():
            active.finished.wait(max(0.0, deadline - time.monotonic()))
        clean = self.table.hand_over_stragglers(grace)
        # What follows shares AFTER_GRACE_S past the grace: with a healthy database it takes no time,
        # and with one that does not answer each wait below would otherwise add its own seconds.
        after = deadline + AFTER_GRACE_S
        # Ends still being recorded (the stragglers' hand-overs too) get a moment more.
        for active in self.table.all():
            active.ended.wait(max(0.0, min(2.0, deadline + 2.0 - time.monotonic())))
        self.keeper.stop()
        joined_by = min(time.monotonic() + 2.0, after)  # for all of them: each may be held up by the database
        self.runner.workers.close(max(0.0, joined_by - time.monotonic()))
        self.runner.starter.close(max(0.0, joined_by - time.monotonic()))
        for thread in self._threads:
            thread.join(max(0.0, joined_by - time.monotonic()))
        self.recorder.stop(min(5.0, max(0.5, after - time.monotonic())))
        # The signals of the last ends (failure alerts among them) get what is left of the grace,
        # and at least SIGNALS_GRACE_S: a grace spent on handlers must not cost the alerts.
        self.outbox.close(max(deadline - time.monotonic(), SIGNALS_GRACE_S))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self.schedule_jobs:
            self._unregister(max(0.5, min(UNREGISTER_WAIT_S, after - time.monotonic())))
        connections.close_all()
        self.stopped.set()
        logger.info("Scheduler %s stopped", self.instance_id, extra={"instance": self.instance_id})
        return clean

    def _unregister(self, wait: float = UNREGISTER_WAIT_S) -> None:
        """Remove this instance's row from the live instances, waiting at most ``wait`` seconds.

        On a thread of its own, so that a database that does not answer (a frozen server, a
        network that drops packets) cannot keep the process from exiting: the row is then
        left to show as stale. The first try may fail on a connection an outage killed,
        which is dropped, and a second goes on a fresh one.
        """
        done = threading.Event()

        def unregister() -> None:
            try:
                for _ in range(2):
                    if self.trouble.call(store.unregister_instance, self.token) is not FAILED:
                        done.set()
                        return
            finally:
                connections.close_all()

        thread = threading.Thread(target=unregister, name="anarchon-unregister", daemon=True)
        thread.start()
        thread.join(wait)
        if not done.is_set():
            logger.warning(
                "Could not remove instance %s from the live instances on stopping%s; it shows as stale until pruned",
                self.instance_id,
                "" if not thread.is_alive() else f" (the database did not answer within {wait:.1f}s)",
                extra={"instance": self.instance_id},
            )

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def wait_started(self, timeout: float | None = None) -> bool:
        return self._started.wait(timeout)

    def request_poll(self) -> None:
        """Poll at the next loop turn (a NOTIFY arrived, or a run of a waiting job ended)."""
        self._poll_requested = True
        self._wake.set()

    def active_runs(self) -> list[ActiveRun]:
        return self.table.all()

    def capacity(self, *, headroom: bool = True) -> int:
        """How many more runs may start here (``MAX_WORKERS`` less the handlers running; see RunTable.capacity)."""
        return self.table.capacity(headroom=headroom)

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop async handlers run on, started on first use."""
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="anarchon-asyncio", daemon=True)
                thread.start()
                self._loop = loop
            return self._loop

    def _run_exited(self, active: ActiveRun) -> None:
        """A run is over (or timed out): its job is free; wake the loop if something waits for it.

        Pending runs of the job wait for it (a poll claims them), or due slots wait for room;
        otherwise the loop sleeps on: a wake-up per run would cost a loop turn per run.
        """
        if active.run.job in self._waiting_jobs:
            self._poll_requested = True
            self._wake.set()
        elif self._room_wanted:
            self._wake.set()

    def _handler_returned(self) -> None:
        """A run's handler is over: if runs or slots wait for room, let the loop claim them now."""
        if self._owed_want_room:
            self._poll_requested = True
            self._wake.set()
        elif self._room_wanted:
            self._wake.set()

    # -- the loop ------------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    ready = self._startup()
                except Exception:
                    # Not a database outage (those are retried inside): said loudly and tried
                    # again, rather than the loop thread dying while the process looks started.
                    logger.exception(
                        "Unexpected error while the scheduler started; trying again in %ss", STARTUP_RETRY_S
                    )
                    self._stopping.wait(STARTUP_RETRY_S)
                    continue
                self.trouble.end_turn()
                if ready:
                    break
                self._stopping.wait(max(self.trouble.backoff, 0.1))
            self._started.set()
            next_poll = next_house = time.monotonic()
            while not self._stopping.is_set():
                try:
                    next_poll, next_house = self._turn(next_poll, next_house)
                except Exception:
                    logger.exception("Unexpected error in the scheduler loop; carrying on")
                    self._stopping.wait(1.0)
            try:
                self._shed_overtaken()
            except Exception:
                logger.exception("Unexpected error while recording the slots shed at stop")
        finally:
            connections.close_all()

    def _turn(self, next_poll: float, next_house: float) -> tuple[float, float]:
        """One turn of the loop; returns when the next poll and housekeeping are due."""
        self.table.fence_overdue()
        # After a failed turn the back-off comes before any query: a query that failed
        # before the wait would make the turn after the database's return a failed one.
        if self.trouble.backoff:
            # The runs held for a look at their pause that comes due meanwhile go ahead as
            # claimed, as after a failed look, rather than wait out the back-off.
            self._withdraw_paused(self.clock.now_ms() + int(self.trouble.backoff * 1000), look=False)
            if self._stopping.wait(self.trouble.backoff):
                return next_poll, next_house
        # Once per connection: a frozen claim holds job locks for about a lease at most.
        self.trouble.call(store.limit_idle_transactions, self.settings.lease_ttl)
        self.queue.claim_ahead_ms = draw_claim_ahead(self.claim_ms, random.uniform(0.0, 20.0))  # noqa: S311
        self._follow_clock_steps()
        mono = time.monotonic()
        poll_now = mono >= next_poll or self._poll_requested or mono >= self._takeover_at
        if poll_now and self._owed_want_room:
            # Runs already owed (attempt 2 of a crashed run, a run_now) take the room a
            # returning handler left before new slots do: under load they would otherwise
            # wait behind every slot that comes due.
            next_poll, poll_now = self._poll_turn(), False
        # At capacity, due slots wait here (not in the database) until a handler
        # returns and wakes the loop; other instances may take them meanwhile.
        room = self.capacity() > 0
        self._room_wanted = not room
        now_ms = self.clock.now_ms()
        if not room:
            self.queue.note_no_room(now_ms)
        elif self.queue.due(now_ms):
            self.dispatch_due()
        if (
            self._pause_checks
            and self._pause_checks[0][0] <= self.clock.now_ms()
            and self._withdraw_paused(self.clock.now_ms())
        ):
            # The look was a poll: the next comes an interval after it. An instance whose slots come
            # every second or so then polls in the turns that look, not in turns of their own.
            next_poll, poll_now = time.monotonic() + self.settings.poll_interval, False
        if poll_now:
            next_poll = self._poll_turn()
        if mono >= next_house:
            self._housekeeping()
            next_house = time.monotonic() + self.settings.heartbeat_every
        wait = min(next_poll, next_house, self._takeover_at) - time.monotonic()
        if self.capacity() > 0:
            due_in = self.queue.wake_in_ms(self.clock.now_ms())
            if due_in is not None:
                wait = min(wait, due_in / 1000)
        else:
            # Asleep until a handler returns (the runs this turn won took the last room): slots
            # that come due meanwhile are owed a worker, not missed by the cluster (catch-up).
            self.queue.note_no_room(self.clock.now_ms())
            self._room_wanted = True
        if self._pause_checks:
            wait = min(wait, (self._pause_checks[0][0] - self.clock.now_ms()) / 1000)
        self.trouble.end_turn()
        if wait > 0 and not self._poll_requested:
            self._wake.wait(wait)
        self._wake.clear()
        return next_poll, next_house

    def _poll_turn(self) -> float:
        """Poll now; return when the next poll is due."""
        self._poll_requested = False
        self._poll()
        return time.monotonic() + self.settings.poll_interval

    def dispatch_due(self) -> None:
        """Decide the slots that have come due in one statement, adopt what was won, put back the rest."""
        if self.clock.monotonic() - self._peers_read_at >= PEERS_REFRESH_S:
            self._read_peers()
        now = self.clock.now_ms()
        batch = self.queue.take_due(now, self.grace_ms, self.shares.preferred)
        if not batch:
            self.queue.settle(batch, store.Outcome(), now, now)
            return
        held = self._ending_here(c.job for c in batch.claims)
        if held:
            batch.claims = [c for c in batch.claims if c.job.name not in held]
        outcome = self._decide(batch, skip_locked=True, now_ms=now) if batch else store.Outcome()
        if outcome is FAILED:
            self.queue.failed(batch, now + max(int(self.trouble.backoff * 1000), 50))
            return
        outcome.busy.extend(sorted(held))  # looked at again in a moment, as a job another instance held
        # A busy job is most often another instance deciding the very same slot: look
        # again once such a claim has had time to commit, when an unlocked read usually
        # settles it without a transaction. Retrying sooner only takes CPU from the holder.
        retry = now + int(max(BUSY_RETRY_MS, 1.5 * self.claim_ms) * random.uniform(1.0, 1.3))  # noqa: S311
        if self.queue.settle(batch, outcome, now, retry):
            self._room_wanted = True

    def _shed_overtaken(self) -> None:
        """On stopping: record skipped the slots owed here that their job's next slot has overtaken.

        Shed on the job's next look had the instance gone on, they would otherwise have no
        record at all: no other instance looks at a slot once it has come.
        """
        if self.trouble.backoff:
            return  # the database is failing: a stop must not wait for it (a later start catches up)
        claims = self.queue.overtaken(self.clock.now_ms())
        if not claims:
            return
        outcome = self._decide(Batch(claims=claims))
        if outcome is not FAILED:
            self._handle(outcome, time.monotonic())

    def _ending_here(self, jobs: Iterable[Job]) -> set[str]:
        """Which of ``jobs`` have a run here whose end is about to be written: decide their slots a moment later.

        The recorder collects endings for ``COLLECT_S`` before it writes them, and until then the
        database has the run running: a slot of its job decided meanwhile (the next slot of a
        handler that returned a moment before it, a manual run under replace) would be skipped,
        or would replace a run that has ended. Those jobs are held back (and the recorder told to
        write now), the others decided at once. A job is held back for ``OWN_ENDINGS_WAIT_S`` at
        most: a database too slow to write the end by then decides on what it holds.
        """
        names = {job.name for job in jobs if job.overlap != "allow"}
        if not names:
            return set()
        now = time.monotonic()
        held = {active.run.job for active in self.table.ending(names) if now - active.ending_since < OWN_ENDINGS_WAIT_S}
        if held:
            self.recorder.hurry()
        return held

    def _read_peers(self) -> None:
        """Read the live instances, including this one (heartbeats in the last three intervals).

        Read when slots are about to be claimed and the list is older than
        ``PEERS_REFRESH_S``, so that an instance that has just started gets its
        share within seconds, and an idle instance sends no query for it.
        """
        self._peers_read_at = self.clock.monotonic()
        tokens = self.trouble.call(store.live_instances, 3 * self.settings.heartbeat_every + 1)
        if tokens is not FAILED:
            self.shares.update(tokens)

    def _decide(self, batch: Batch, skip_locked: bool = False, now_ms: int | None = None) -> Any:
        sent = time.monotonic()
        outcome = self.trouble.call(
            store.decide,
            batch.claims,
            batch.catch_ups,
            owner=self.token,
            instance_id=self.instance_id,
            ttl=self.settings.lease_ttl,
            capacity=self.capacity(),
            default_data=self.settings.data,
            skip_locked=skip_locked,
            now_ms=now_ms,
            # Alone (as far as the last read of the live instances says): nobody else has decided them.
            first_look=len(self.shares.peers) > 1,
        )
        if outcome is FAILED:
            self._in_doubt.update(dict.fromkeys((c.job.name, c.slot) for c in batch.claims))
            while len(self._in_doubt) > IN_DOUBT_LIMIT:  # an outage's failed claims: the newest matter
                del self._in_doubt[next(iter(self._in_doubt))]
            # Looked up by the next turn's poll, after the back-off, not a poll interval later: a run
            # won by the lost commit holds its job until then, and the job's next slot may come.
            self._poll_requested = True
            return outcome
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "Decided %d slot(s) and %d catch-up window(s) in %.1f ms: won %d, skipped %d, deferred %d, busy %d",
                len(batch.claims),
                len(batch.catch_ups),
                (time.monotonic() - sent) * 1000,
                len(outcome.won),
                len(outcome.skipped),
                len(outcome.deferred),
                len(outcome.busy),
                extra={"instance": self.instance_id},
            )
        undecided = len(outcome.deferred) + len(outcome.early) + len(outcome.busy)
        metrics.CLAIMS.labels("won").inc(len(outcome.won))
        metrics.CLAIMS.labels("lost").inc(
            max(0, len(batch.claims) - len(outcome.won) - len(outcome.skipped) - undecided)
        )
        if outcome.won or outcome.skipped or outcome.missed:
            # Only claims that wrote rows say how long claiming takes (one that found
            # everything decided is quick). Rise at once, decay slowly: a large batch
            # must not be claimed late because small ones came before it.
            took = (time.monotonic() - sent) * 1000
            self.claim_ms = took if took > self.claim_ms else 0.98 * self.claim_ms + 0.02 * took
        self._handle(outcome, sent)
        return outcome

    def _handle(self, outcome: store.Outcome, sent: float) -> None:
        self.table.interrupted_elsewhere(outcome.interrupted)
        self.table.skipped(outcome.skipped)
        self.table.missed(outcome.missed)
        if outcome.won:
            self.adopt_all(outcome.won, sent)

    def adopt_all(self, runs: list[Run], sent: float) -> None:
        """Start executing the runs a claim has just won, as :meth:`adopt` does each, in one go.

        A claim wins a hundred runs at once: the run table, the keeper and the
        starter take them together, each once rather than once per run.
        """
        if time.monotonic() - sent > self.settings.fence_after / 2:
            for run in runs:
                self.adopt(run, sent)  # renewed first, one by one (see adopt)
            return
        self._take_on([ActiveRun(run, self.jobs[run.job], renewed_at=sent) for run in runs])

    def _take_on(self, actives: list[ActiveRun]) -> None:
        """Hold ``actives`` (all renewed at the same moment) and have them executed."""
        self.table.add_many(actives)
        self.keeper.held(actives[0])  # the one renewal moment they share decides for all
        self._check_pauses_before_slots(actives)
        self.runner.start_many(actives)

    def _check_pauses_before_slots(self, actives: list[ActiveRun]) -> None:
        """Have the pause of the jobs of scheduled runs claimed ahead read again just before their slots."""
        check_from = self.clock.now_ms() + PAUSE_CHECK_LEAD_MS
        by_slot: dict[int, list[ActiveRun]] = {}
        for active in actives:
            run = active.run
            if run.slot > check_from and run.reason == Reason.SCHEDULED and not run.manual:
                by_slot.setdefault(run.slot, []).append(active)
        for slot, ahead in by_slot.items():
            for active in ahead:
                active.pause_check_pending = True
            heapq.heappush(self._pause_checks, (slot - PAUSE_CHECK_LEAD_MS, next(self._pause_check_order), ahead))

    def _withdraw_paused(self, now_ms: int, *, look: bool = True) -> bool:
        """Withdraw the runs claimed ahead whose jobs were paused since (their checks are due by ``now_ms``).

        The look is a poll, which also names the paused ones among those jobs: True if it
        polled (whatever it found). Without ``look`` (the database is failing), the checks
        are given up and the runs go ahead as claimed.
        """
        due: list[ActiveRun] = []
        while self._pause_checks and self._pause_checks[0][0] <= now_ms:
            due.extend(heapq.heappop(self._pause_checks)[2])
        if not due:
            return False
        found: Any = None
        try:
            waiting = [active for active in due if active.state is Phase.RUNNING and not active.ran]
            if not waiting or not look:
                return False
            self._poll_requested = False
            found = self.trouble.call(
                store.poll,
                expiring_within=self.settings.poll_interval,
                paused_among={active.run.job for active in waiting},
            )
            if found is not FAILED:  # a failed look leaves them as claimed: the claim saw the job running
                for active in waiting:
                    if active.run.job in found.paused:
                        self.table.withdraw(active, PAUSED_DETAIL)
        finally:
            for active in due:
                active.pause_check_pending = False
            self.runner.starter.wake()  # the runs it held for this look (the withdrawn ones were aborted)
        self._poll(found)  # the rest of the poll, once the runs that waited for the look are on their way
        return True

    def adopt(self, run: Run, sent: float) -> ActiveRun | None:
        """Start executing a run this process has just won (claimed at monotonic ``sent``).

        A claim that took long to commit (a locked SQLite file, a slow server)
        is renewed once first: fencing counts from when the claim was sent, so
        its handler would otherwise be aborted on arrival. If that renewal does
        not commit, the handler is not started and the run is left to expire.
        """
        if time.monotonic() - sent > self.settings.fence_after / 2:
            fresh = time.monotonic()
            renewed = self.trouble.call(store.renew, [run.id], owner=self.token, ttl=self.settings.lease_ttl)
            if renewed is FAILED or run.id not in renewed[0]:
                logger.warning(
                    "Claim of %s slot=%s committed too late to run safely; leaving it to a backup",
                    run.job,
                    run.slot,
                    extra=log_fields(run, self.instance_id),
                )
                return None
            sent = fresh
        active = ActiveRun(run, self.jobs[run.job], renewed_at=sent)
        self._take_on([active])
        return active

    # -- start-up, polls, takeovers, housekeeping -----------------------------------------

    def _startup(self) -> bool:
        if self.trouble.call(store.limit_idle_transactions, self.settings.lease_ttl) is FAILED:
            return False
        if self.trouble.call(store.ensure_jobs, self.jobs.values()) is FAILED:
            return False
        if self.trouble.call(store.register_instance, self.token, self.instance_id, self.host, self.pid) is FAILED:
            return False
        others = self.trouble.call(store.namesakes, self.token, self.instance_id, 3 * self.settings.heartbeat_every + 1)
        if others is not FAILED and others:
            # Harmless to the claims (each instance has its own token), but the log, the admin, the
            # metrics and `--check --instance-id` tell instances apart by this name.
            logger.warning(
                "Another live instance is named %r too (%s): give each its own (--instance-id or "
                "ANARCHON['INSTANCE_ID']); the log, the admin, the metrics and --check tell instances apart by it",
                self.instance_id,
                ", ".join(f"host {host} pid {pid}" for host, pid in others),
                extra={"instance": self.instance_id},
            )
        self._measure_clock(samples=3)
        now = self.clock.now_ms()
        catch_ups = []
        for job in self.jobs.values():
            until = job.schedule.latest_at_or_before(first_current(job.schedule, now, self.grace_ms) - 1)
            if until is not None:
                catch_ups.append(CatchUp(job, until))
        for start in range(0, len(catch_ups), CATCH_UP_BATCH):
            if self._decide(Batch(catch_ups=catch_ups[start : start + CATCH_UP_BATCH])) is FAILED:
                return False
        self.queue.seed(now, self.grace_ms)
        logger.info(
            "Scheduler %s started with %d job(s) (host %s, pid %d)",
            self.instance_id,
            len(self.jobs),
            self.host,
            self.pid,
            extra={"instance": self.instance_id},
        )
        return True

    def _follow_clock_steps(self) -> None:
        """Measure the database clock again at once when this host's clock was stepped.

        Otherwise a clock stepped forward would make slots look due (and start
        handlers) seconds early until the next regular measurement.
        """
        step = self.clock.stepped()
        if step:
            logger.warning(
                "This host's clock was stepped by %+.3fs; measuring the database clock again",
                step,
                extra={"instance": self.instance_id},
            )
            self.estimate.forget()
            if connections[store.alias()].vendor != "sqlite":
                # The database's clock (another host's) did not step with this one: until it is
                # measured again, the corrected time carries on as it was. Left as it was, a
                # step made while the database is away would count from the step when it
                # returns, and slots not yet due would look due (or missed) until measured.
                self.clock.follow_step(step)
            self._clock_unsure = True
        if self._clock_unsure:
            # Again at every turn until a measurement succeeds (before the turn claims anything).
            self._clock_unsure = not self._measure_clock(samples=3)

    def _measure_clock(self, samples: int = 1) -> bool:
        """Align slot timing to the database clock, so that a skewed host still fires on time; whether it did."""
        if connections[store.alias()].vendor == "sqlite":
            return True  # the same host's clock
        for _ in range(samples):
            before = self.clock.reading()
            value = self.trouble.call(store.database_time)
            after = self.clock.reading()
            if value is FAILED:
                return False
            if not self.clock.steady_between(before, after):
                # This host's wall clock was stepped during the round trip (or read wrong once): the
                # sample is off by part of the step, and the corrected time would jump by all of it
                # until measured again. Not used; the next turn measures again.
                self._clock_unsure = True
                return False
            offset = self.estimate.add(before[0], after[0], value.timestamp())
            self.clock.measured(offset, wall_minus_monotonic=after[0] - after[1])
        offset, warned = self.clock.offset_ms, self._skew_warned_ms
        if abs(offset) > SKEW_WARN_MS:
            # Said again when it changes by as much (a clock stepped or drifting further).
            if warned is None or abs(offset - warned) > SKEW_WARN_MS:
                self._skew_warned_ms = offset
                logger.warning(
                    "This host's clock is %s the database's; slots follow the database clock",
                    describe_offset(offset),
                    extra={"instance": self.instance_id},
                )
        elif warned is not None:
            self._skew_warned_ms = None
            logger.info(
                "This host's clock agrees with the database's again (within %.0f ms)",
                SKEW_WARN_MS,
                extra={"instance": self.instance_id},
            )
        return True

    def _poll(self, found: Any = None) -> None:
        """Claim pending runs and take over expired leases; note when the next lease expires.

        The poll also returns the leases that expire before the next poll, so that
        the loop comes back when they do: a crashed runner is taken over
        ``LEASE_TTL`` after its last renewal, not up to a poll later. With ``found``,
        what a poll sent by the caller found (or ``FAILED``): no other is sent.
        """
        self._takeover_at = float("inf")
        if found is None:
            found = self.trouble.call(store.poll, expiring_within=self.settings.poll_interval)
        if found is FAILED:
            return
        if self._in_doubt:
            self._recover_in_doubt()
        owed: set[str] = set()
        for row in found.expiring:
            if row.job not in self.jobs:
                self._warn_undeclared(row.job)
                continue
            ending = self.table.get(row.id)
            if ending is not None and ending.state is Phase.FINISHING:
                # Its handler is over here and its end waits for the recorder (the database was
                # unreachable past the lease): written first, not taken over and run again.
                self.recorder.hurry()
                self._takeover_at = min(self._takeover_at, time.monotonic() + OWN_ENDING_RECHECK_S)
                continue
            expires = row.lease_expires_at.timestamp() if row.lease_expires_at else 0.0
            left_s = expires - self.clock.now_ms() / 1000
            if left_s > 0:  # not expired yet by this estimate of the database clock
                again_s = left_s + TAKEOVER_MARGIN_S
            elif not self._take_over(row, owed):  # not by the database's own: the estimate was early
                again_s = TAKEOVER_RETRY_S
            else:
                continue
            self._takeover_at = min(self._takeover_at, time.monotonic() + again_s)
        waiting = set(owed)
        for name in found.pending_jobs:
            if name in self.jobs:
                waiting.add(name)
            else:
                self._warn_undeclared(name)
        self._waiting_jobs = waiting
        held = self._ending_here(self.jobs[name] for name in waiting) if waiting else set()
        if held:
            waiting = waiting - held
            self._takeover_at = min(self._takeover_at, time.monotonic() + BUSY_RETRY_MS / 1000)  # poll again then
        # Pending runs are claimed for the workers free now, without the headroom quick slots earn:
        # a burst of manual runs of a slow job is left for the other instances' free workers.
        if waiting and self.capacity(headroom=False) > 0:
            sent = time.monotonic()
            outcome = self.trouble.call(
                store.claim_pending,
                waiting,
                self.jobs,
                owner=self.token,
                instance_id=self.instance_id,
                ttl=self.settings.lease_ttl,
                capacity=self.capacity(headroom=False),
            )
            if outcome is not FAILED:
                self._handle(outcome, sent)
        # Left waiting with no room here: the next handler to return asks for a poll (at worst
        # one poll too many, when the last claim took both the runs and the room).
        self._owed_want_room = bool(waiting) and self.capacity(headroom=False) <= 0

    def _recover_in_doubt(self) -> None:
        """Run the claims of this instance that committed although the database's answer was lost.

        A claim whose connection died at its commit failed here but may have been written: its
        run, ``running`` under this instance's token, would hold its job (slots skipped behind it)
        until its lease ran out and a backup ran it late. Only the slots of claims that failed
        are looked for, and only runs this instance does not hold: a run it held before (fenced,
        lost) is never started again here.
        """
        rows = self.trouble.call(store.held_by, self.token)
        if rows is FAILED:
            return
        doubted, self._in_doubt = self._in_doubt, {}
        for row in rows:
            if (row.job, row.slot) not in doubted or row.attempt != 1 or row.manual or row.job not in self.jobs:
                continue
            if self.table.get(row.id) is not None:
                continue
            logger.warning(
                "Claim of %s slot=%s committed although the database's answer was lost; running it now",
                row.job,
                row.slot,
                extra=log_fields(row, self.instance_id),
            )
            self.adopt(row, -math.inf)  # renewed first: the lease counts from the lost commit

    def _warn_undeclared(self, name: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            logger.warning(
                "Runs of job %r wait, but this instance does not declare that job (only jobs declared "
                "in the jobs.py of an installed app, or in a module it imports, are known to every instance)",
                name,
                extra={"job": name, "instance": self.instance_id},
            )

    def _take_over(self, row: Run, owed: set[str]) -> bool:
        """Try to take over ``row``, whose lease looks expired; whether this instance did.

        A new attempt recorded here without room to start it adds its job to ``owed``.
        """
        self.table.fence_overdue()
        sent = time.monotonic()
        start = self.capacity(headroom=False) > 0
        result = self.trouble.call(
            store.take_over,
            row,
            owner=self.token,
            instance_id=self.instance_id,
            ttl=self.settings.lease_ttl,
            start=start,
            max_attempts=self.settings.max_attempts,
        )
        if result is FAILED or result is None:
            return False
        old, new = result
        self.table.taken_over(old, new, starts_here=start)
        if new is not None and new.status == Status.RUNNING:
            self.adopt(new, sent)
        elif new is not None and new.status == Status.PENDING:
            owed.add(new.job)  # recorded here without room to start it: owed the next room
        return True

    # -- history pruning -----------------------------------------------------------------

    def _run_pruner(self) -> None:
        """Prune the run history hourly, on a thread of its own, if this instance is the cluster's pruner.

        Off the loop: a prune of a large history takes seconds to minutes, and on the loop it
        held up every claim of the instance meanwhile (and, every instance pruning at once
        after a deploy, of the cluster: slots recorded missed as if it had been down). One
        instance prunes, the live one whose token sorts first (two may, for a moment, while
        instances come and go: deleting the same old runs twice deletes them once).
        """
        trouble = DbTrouble("history pruning", self.instance_id, store.alias)
        try:
            # Start-up first; a heartbeat later this instance's row is on record with its peers'.
            while not self._started.wait(0.5):
                if self._stopping.is_set():
                    return
            if self._stopping.wait(self.settings.heartbeat_every):
                return
            while not self._stopping.is_set():
                tokens = trouble.call(store.live_instances, 3 * self.settings.heartbeat_every + 1)
                if tokens is not FAILED and (not tokens or min(tokens) == self.token):
                    self._prune(trouble)
                connections.close_all()  # an hour until the next: keep no connection open meanwhile
                trouble.end_turn()
                self._stopping.wait(PRUNE_EVERY_S if trouble.down_since is None else 60.0)
        finally:
            connections.close_all()

    def _prune(self, trouble: DbTrouble) -> None:
        """Delete the history older than ``HISTORY_RETENTION`` a batch at a time, pausing between batches."""
        retention = self.settings.history_retention
        began, deleted = time.monotonic(), 0
        while retention is not None and not self._stopping.is_set():
            sent = time.monotonic()
            done = trouble.call(store.prune_batch, retention, PRUNE_BATCH)
            if done is FAILED or not done:
                break
            if not deleted:
                logger.info(
                    "Pruning the run history: runs that ended more than %s ago",
                    format_ms(int(retention * 1000)),
                    extra={"instance": self.instance_id},
                )
            deleted += done
            # At most half of the time on it: the database and this process serve the runs first.
            self._stopping.wait(max(0.01, time.monotonic() - sent))
        if deleted:
            logger.info(
                "Pruned %d old run(s) in %.1fs", deleted, time.monotonic() - began, extra={"instance": self.instance_id}
            )
        trouble.call(store.prune_instances)

    def _housekeeping(self) -> None:
        self._measure_clock()
        self.trouble.call(
            store.heartbeat, self.token, self.instance_id, self.host, self.pid, clock_offset_ms=self.clock.offset_ms
        )
        if self._alerting:
            overdue = self.trouble.call(store.claim_overdue_alerts, self._alerting)
            for lapse in [] if overdue is FAILED else overdue:
                logger.warning(
                    "Job %r is overdue: no successful run for %s (alert_after); sending job_overdue",
                    lapse.job,
                    lapse.without_success,
                    extra={"job": lapse.job, "instance": self.instance_id},
                )
                self.outbox(
                    signals.job_overdue,
                    job=lapse.job,
                    last_success=lapse.last_success,
                    without_success=lapse.without_success,
                )
        now = time.monotonic()
        if now < self._next_prune:
            return
        if self._next_prune:  # not at start, where ensure_jobs() has just run
            self.trouble.call(store.ensure_jobs, self.jobs.values())
        closed = self.trouble.call(store.close_undeclared, UNDECLARED_GRACE_S)
        if closed is not FAILED:
            for name, count in sorted(closed.items()):
                logger.warning(
                    "Closed %d waiting run(s) of job %r: no running instance has declared it for %g hours",
                    count,
                    name,
                    UNDECLARED_GRACE_S / 3600,
                    extra={"job": name, "instance": self.instance_id},
                )
        self._next_prune = now + HOUSEKEEPING_EVERY_S


__all__ = ["Engine"]
