"""The running scheduler: the loop, the lease keeper, the watchdog and the listener.

Four threads; the ones that query have their own database connection:

* the **loop** sleeps until the next due slot (a heap keyed by slot time, so a
  turn costs O(log n) in the number of jobs), claims every slot due at that
  instant in one transaction, and every ``POLL_INTERVAL`` looks for pending
  runs and expired leases (PostgreSQL wakes it at once via LISTEN/NOTIFY),
  coming back at the very moment a lease it saw about to expire does;
* the **keeper** renews the leases of every run this process holds in one
  UPDATE;
* the **watchdog** never touches the database: it ends runs that passed their
  timeout and fences runs whose lease could not be renewed in time (see
  :meth:`Engine._fence_overdue`), even while a renewal hangs;
* the **listener** (PostgreSQL with psycopg >= 3.2 only) waits on NOTIFY.

A database error never stops any of them: it is logged once, the connection
is dropped, and the thread retries with backoff. No query lives here; they
are all in :mod:`store`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import random
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.db import DatabaseError, connections

from . import signals, store
from .conf import AnarchonSettings
from .exceptions import AttemptsExhausted, Interrupted
from .keeper import Keeper
from .listener import Listener
from .models import Run, Status
from .recorder import Recorder
from .registry import Job
from .runner import ActiveRun, Runner, describe_loss, log_fields
from .timing import Clock, DuePlan, plan_due

logger = logging.getLogger("django_anarchon")
T = TypeVar("T")
_FAILED: Any = object()
BUSY_RETRY_MS = 20
# How far ahead of their slot the slots of other instances' shares are claimed (see _draw_claim_ahead).
BACKUP_AHEAD_MS = 30
# When the backup look at one slot comes, the other shares' slots whose look is due within
# this many ms are looked at in the same statement (see _dispatch_due).
BACKUP_WINDOW_MS = 20
# How old the list of live instances may be when slots are claimed (see _read_peers).
PEERS_REFRESH_S = 2.0
# A lease seen about to expire is looked at again this long after its expiry (by the
# database clock as estimated here), and a takeover the database refused this long after.
TAKEOVER_MARGIN_S = 0.005
TAKEOVER_RETRY_S = 0.05
# Hourly, each instance stamps its jobs as declared and prunes history. The runs of a job no
# instance has declared for three such turns are closed (see store.close_undeclared).
HOUSEKEEPING_EVERY_S = 3600.0
# The most slots of one job recorded skipped in one turn for want of a free worker; older ones
# go to catch-up's accounting (a missed count), as after an outage.
SHED_LIMIT = 100
UNDECLARED_GRACE_S = 3 * HOUSEKEEPING_EVERY_S


def share_ranks(names: Iterable[str]) -> dict[str, int]:
    """Each job's place in an order that every instance declaring the same jobs agrees on."""
    return {name: rank for rank, name in enumerate(sorted(names, key=lambda name: (zlib.crc32(name.encode()), name)))}


def share_index(rank: int, slot: int, count: int) -> int:
    """Which of ``count`` sorted live instances claims ``slot`` of the job ranked ``rank`` first.

    The jobs are dealt round the instances in :func:`share_ranks` order, from a
    starting instance that moves with the slot: of the jobs due at one instant,
    each instance gets an even share (exactly, to one, when all are due). A
    hash per (job, slot) shared them out only on average: of 100 jobs, one of
    three instances often got over 40, and its handlers started last.
    """
    return (rank + zlib.crc32(str(slot).encode())) % count


def _uncertainty_ms(rtt: float) -> float:
    """How far a clock sample's offset can be from the truth: half its round trip, plus 1 ms of resolution."""
    return rtt / 2 + 1.0


def clock_offset(samples: Iterable[tuple[float, float]]) -> float:
    """The database clock minus this host's, in ms, from ``(round trip, offset)`` samples.

    Estimated like NTP: the sample with the shortest round trip. An offset within
    its uncertainty (half the round trip, plus a millisecond) is noise on a host
    whose clock agrees with the database's and counts as zero; a larger one is used
    as measured, not shrunk toward zero, so that a skewed host is neither early nor
    late by a systematic margin and races its peers for slots on equal terms.
    """
    rtt, offset = min(samples)
    return offset if abs(offset) > _uncertainty_ms(rtt) else 0.0


def add_clock_sample(samples: list[tuple[float, float]], sample: tuple[float, float]) -> list[tuple[float, float]]:
    """The recent ``(round trip, offset)`` samples to estimate from, with ``sample`` added.

    The database's timestamp was taken during the round trip, so each sample
    bounds the true offset to its offset ± its uncertainty. A new sample whose
    bounds do not meet the current
    best sample's means one of the clocks was stepped (NTP, an operator): the
    older samples describe a clock that no longer exists and are dropped, rather
    than outvoting the new one for the next eight measurements.
    """
    if samples:
        best_rtt, best = min(samples)
        rtt, offset = sample
        if abs(offset - best) > _uncertainty_ms(best_rtt) + _uncertainty_ms(rtt):
            return [sample]
    return [*samples[-7:], sample]


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
        self.runner = Runner(self)
        self.recorder = Recorder(self)
        self.keeper = Keeper(self)
        self.listener = Listener(self)
        self.grace_ms = int(max(2 * settings.poll_interval, 0.5) * 1000)

        self._active: dict[int, ActiveRun] = {}
        self._active_lock = threading.Lock()
        # (wake time ms, entry number, job): a job's entry number changes whenever it is
        # pushed again, so an older entry still in the heap is recognised and dropped.
        self._heap: list[tuple[int, int, str]] = []
        # Entries due at their exact time, without claiming ahead: a busy job's slot at the slot.
        self._exact: list[tuple[int, int, str]] = []
        # Backup looks: other instances' shares, at the backup lead before their slot.
        self._backup: list[tuple[int, int, str]] = []
        self._entry: dict[str, int] = {}
        self._entries = itertools.count()
        self._next_slot: dict[str, int] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._poll_requested = True
        self._takeover_at = float("inf")  # time.monotonic() of the next look at a lease about to expire
        self._room_wanted = False  # due slots wait for a worker: wake the loop when a handler returns
        self._waiting_jobs: set[str] = set()
        self._deferred: dict[str, int] = {}  # job -> a slot it was due at with no free worker here
        self._short_since: int | None = None  # since when (ms) slots wait for a free worker here
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self._backoff = 0.0
        self._turn_failed = False
        self._db_down_since: float | None = None
        self._warned: set[str] = set()
        self._next_prune = 0.0  # the first housekeeping turn prunes, then hourly
        self._claim_ms = 20.0  # how long claiming transactions take here: recent highs, decaying
        self.claim_ahead_ms = 80
        self.backup_ahead_ms = BACKUP_AHEAD_MS
        # Tokens of the live instances, sorted: the same list on every instance, which
        # shares out the slots of an instant among them (see _preferred).
        self._peers: tuple[str, ...] = ()
        self._share_ranks = share_ranks(self.jobs)
        self._peers_read_at = -PEERS_REFRESH_S
        self._clock_samples: list[tuple[float, float]] = []  # (round trip ms, offset ms)
        self.stopped = threading.Event()

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        for name, target in (
            ("loop", self._run_loop),
            ("keeper", self.keeper.run_renewals),
            ("watchdog", self.keeper.run_watchdog),
        ):
            if name == "loop" and not self.schedule_jobs:
                continue
            thread = threading.Thread(target=target, name=f"anarchon-{name}", daemon=True)
            self._threads.append(thread)
            thread.start()
        if self.schedule_jobs and self.listener.available():
            thread = threading.Thread(target=self.listener.run, name="anarchon-listener", daemon=True)
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
        for thread in self._threads:
            if thread.name == "anarchon-loop":
                thread.join(max(0.0, deadline - time.monotonic()))
        reason = Interrupted(
            f"the scheduler on {self.instance_id} is stopping (stop(), SIGTERM or SIGINT); "
            "raise to hand the run over, return if it is done"
        )
        for active in self.active_runs():
            active.abort("stop", reason)
        for active in self.active_runs():
            active.finished.wait(max(0.0, deadline - time.monotonic()))
        clean = True
        for active in self.active_runs():
            if active.state == "running" and active.begin_finish():
                clean = False
                logger.warning(
                    "Handler of %s slot=%s did not end within the %.1fs grace period; handing the run over",
                    active.run.job,
                    active.run.slot,
                    grace,
                    extra={"job": active.run.job},
                )
                try:
                    self.runner.hand_over(active, None)
                finally:
                    active.done()
        # Runs that are still recording their end get a moment to do so.
        for active in self.active_runs():
            if active.state == "finishing":
                active.finished.wait(max(0.0, min(2.0, deadline + 2.0 - time.monotonic())))
        self.keeper.stop()
        for thread in self._threads:
            thread.join(2.0)
        self.recorder.stop()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self.schedule_jobs:
            self._db(store.unregister_instance, self.token)
        connections.close_all()
        self.stopped.set()
        logger.info("Scheduler %s stopped", self.instance_id, extra={"instance": self.instance_id})
        return clean

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def wait_started(self, timeout: float | None = None) -> bool:
        return self._started.wait(timeout)

    def request_poll(self) -> None:
        """Poll at the next loop turn (a NOTIFY arrived, or a run of a waiting job ended)."""
        self._poll_requested = True
        self._wake.set()

    def wake(self) -> None:
        """Wake the loop (a run ended: its job and a worker are free)."""
        self._wake.set()

    def wait_stopping(self, seconds: float) -> bool:
        return self._stopping.wait(seconds)

    def active_run(self, run_id: int | None) -> ActiveRun | None:
        with self._active_lock:
            return self._active.get(run_id)  # type: ignore[arg-type]

    def active_runs(self) -> list[ActiveRun]:
        with self._active_lock:
            return list(self._active.values())

    def _draw_claim_ahead(self) -> None:
        """How far ahead of a slot to claim it this turn: its share first, then the rest.

        An instance claims the slots it is preferred for (:meth:`_preferred`)
        ``claim_ahead_ms`` ahead: at least twice its recent claim time, so that
        the claim commits before the slot, and at least 40 ms more than the
        earliest backup look (``BACKUP_AHEAD_MS + BACKUP_WINDOW_MS``), plus up
        to 20 ms of jitter, at most 270 ms. The other slots of the same instant,
        in case their preferred instance is gone or slow, ``BACKUP_AHEAD_MS``
        ahead on every instance, or up to ``BACKUP_WINDOW_MS`` before that
        together with another backup look. The backup lead is the same
        everywhere and below every first lead, so a peer's share is never
        taken before that peer's own first pass; a backup lead that followed the
        claim time let the instance with the slowest claims (the one writing the
        most rows) take the shares of the fastest, which then won nothing.
        """
        floor = BACKUP_AHEAD_MS + BACKUP_WINDOW_MS + 40.0
        lead = min(250.0, max(floor, 2 * self._claim_ms)) + random.uniform(0.0, 20.0)  # noqa: S311
        self.claim_ahead_ms = int(lead)

    def _preferred(self, name: str, slot: int) -> bool:
        """Whether this instance claims ``slot`` of job ``name`` in the first pass.

        Every instance reads the same sorted list of live instances and deals
        the jobs round it (:func:`share_index`), so each slot has one preferred
        instance and the slots due at one instant are shared out evenly among
        the instances (their handlers then start in several processes, not a
        hundred in one). This
        only orders the attempts: the claim itself is decided by the database as
        always, the other instances claim the slot too just before it is due if
        it is still undecided, and instances whose lists differ for a moment
        (one just started or stopped) at worst both try first.
        """
        peers = self._peers
        if len(peers) < 2:
            return True
        return peers[share_index(self._share_ranks[name], slot, len(peers))] == self.token

    def _read_peers(self) -> None:
        """Read the live instances, including this one (heartbeats in the last three intervals).

        Read when slots are about to be claimed and the list is older than
        ``PEERS_REFRESH_S``, so that an instance that has just started gets its
        share within seconds, and an idle instance sends no query for it.
        """
        self._peers_read_at = self.clock.monotonic()
        tokens = self._db(store.live_instances, 3 * self._heartbeat_every() + 1)
        if tokens is not _FAILED:
            self._peers = tuple(sorted({*tokens, self.token}))

    def capacity(self) -> int:
        """How many more runs may start here: ``MAX_WORKERS`` less the runs whose handler has not returned."""
        with self._active_lock:
            return self.settings.max_workers - sum(1 for active in self._active.values() if not active.returned)

    def handler_returned(self) -> None:
        """A run's handler is over: if slots wait for room, let the loop claim them now."""
        if self._room_wanted:
            self._wake.set()

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop async handlers run on, started on first use."""
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="anarchon-asyncio", daemon=True)
                thread.start()
                self._loop = loop
            return self._loop

    # -- database access with backoff ------------------------------------------------

    def reset_connection(self) -> None:
        """Drop this thread's connection so that the next query reconnects."""
        connection = connections[store.alias()]
        try:
            connection.close()
        except Exception:
            connection.connection = None

    def _db(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call a store function; on a database error log it, reset and return ``_FAILED``.

        An outage is logged once when it starts and once when a whole loop turn
        ran without a database error again (:meth:`_end_turn`), not per retry.
        """
        try:
            return function(*args, **kwargs)
        except DatabaseError as error:
            self.reset_connection()
            self._turn_failed = True
            if self._db_down_since is None:
                self._db_down_since = time.monotonic()
                logger.warning(
                    "Database error on %s (%s: %s); retrying with backoff",
                    self.instance_id,
                    type(error).__name__,
                    error,
                    extra={"instance": self.instance_id},
                )
            return _FAILED  # type: ignore[no-any-return]

    def _end_turn(self) -> None:
        if self._turn_failed:
            self._backoff = min(max(0.1, self._backoff * 2), 5.0) * random.uniform(0.8, 1.2)  # noqa: S311
        else:
            if self._db_down_since is not None:
                logger.warning(
                    "Database is back on %s after %.1fs",
                    self.instance_id,
                    time.monotonic() - self._db_down_since,
                    extra={"instance": self.instance_id},
                )
                self._db_down_since = None
            self._backoff = 0.0
        self._turn_failed = False

    # -- the loop ------------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                ready = self._startup()
                self._end_turn()
                if ready:
                    break
                self._stopping.wait(max(self._backoff, 0.1))
            self._started.set()
            next_poll = next_house = time.monotonic()
            while not self._stopping.is_set():
                try:
                    # Once per connection: a frozen claim holds job locks for about a lease at most.
                    self._db(store.limit_idle_transactions, self.settings.lease_ttl)
                    self._draw_claim_ahead()
                    self._follow_clock_steps()
                    self.keeper.fence_overdue()
                    if self._backoff:
                        self._stopping.wait(self._backoff)
                        if self._stopping.is_set():
                            break
                    # At capacity, due slots wait here (not in the database) until a handler
                    # returns and wakes the loop; other instances may take them meanwhile.
                    room = self.capacity() > 0
                    self._room_wanted = not room
                    if not room and self._short_since is None:
                        self._short_since = self.clock.now_ms()
                    if room and self._due(self.clock.now_ms()):
                        self._dispatch_due()
                    mono = time.monotonic()
                    if mono >= next_poll or self._poll_requested or mono >= self._takeover_at:
                        self._poll_requested = False
                        self._poll()
                        next_poll = time.monotonic() + self.settings.poll_interval
                    if mono >= next_house:
                        self._housekeeping()
                        next_house = time.monotonic() + self._heartbeat_every()
                    wait = min(next_poll, next_house, self._takeover_at) - time.monotonic()
                    if self.capacity() > 0:
                        now_ms = self.clock.now_ms()
                        if self._heap:
                            wait = min(wait, (self._heap[0][0] - self.claim_ahead_ms - now_ms) / 1000)
                        for timed in (self._exact, self._backup):
                            if timed:
                                wait = min(wait, (timed[0][0] - now_ms) / 1000)
                    self._end_turn()
                    if wait > 0 and not self._poll_requested:
                        self._wake.wait(wait)
                    self._wake.clear()
                except Exception:
                    logger.exception("Unexpected error in the scheduler loop; carrying on")
                    self._stopping.wait(1.0)
        finally:
            connections.close_all()

    def _heartbeat_every(self) -> float:
        return min(10.0, max(self.settings.lease_ttl / 3, self.settings.poll_interval))

    def _startup(self) -> bool:
        if self._db(store.limit_idle_transactions, self.settings.lease_ttl) is _FAILED:
            return False
        if self._db(store.ensure_jobs, self.jobs.values()) is _FAILED:
            return False
        if self._db(store.register_instance, self.token, self.instance_id, self.host, self.pid) is _FAILED:
            return False
        self._measure_clock(samples=3)
        now = self.clock.now_ms()
        catch_ups = []
        for job in self.jobs.values():
            until = job.schedule.latest_at_or_before(now - self.grace_ms)
            if until is not None:
                catch_ups.append(store.CatchUp(job, until))
        for start in range(0, len(catch_ups), 500):
            outcome = self._decide([], catch_ups[start : start + 500])
            if outcome is _FAILED:
                return False
        self._heap = []
        for job in self.jobs.values():
            slot = job.schedule.next_after(now - self.grace_ms - 1)
            self._next_slot[job.name] = slot
            self._entry[job.name] = entry = next(self._entries)
            self._heap.append((slot, entry, job.name))
        heapq.heapify(self._heap)
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
        if not step:
            return
        logger.warning(
            "This host's clock was stepped by %+.3fs; measuring the database clock again",
            step,
            extra={"instance": self.instance_id},
        )
        self._clock_samples = []
        self._measure_clock(samples=3)

    def _measure_clock(self, samples: int = 1) -> None:
        """Align slot timing to the database clock, so that a skewed host still fires on time.

        Measured at start and every few seconds; :func:`clock_offset` estimates the
        offset from the recent samples.
        """
        if connections[store.alias()].vendor == "sqlite":
            return  # the same host's clock
        for _ in range(samples):
            before = time.time()
            value = self._db(store.database_time)
            after = time.time()
            if value is _FAILED:
                return
            sample = ((after - before) * 1000, value.timestamp() * 1000 - (before + after) * 500)
            self._clock_samples = add_clock_sample(self._clock_samples, sample)
        self.clock.offset_ms = clock_offset(self._clock_samples)
        if abs(self.clock.offset_ms) > 1000 and "skew" not in self._warned:
            self._warned.add("skew")
            logger.warning(
                "This host's clock is %.1fs off the database's; slots follow the database clock",
                self.clock.offset_ms / 1000,
                extra={"instance": self.instance_id},
            )

    def _dispatch_due(self) -> None:
        if self.clock.monotonic() - self._peers_read_at >= PEERS_REFRESH_S:
            self._read_peers()
        now = self.clock.now_ms()
        # Claim a little ahead of the slot, so that the database round trips are
        # done by the time it is due; the run's worker starts the handler at the
        # slot itself, never before (Runner._execute).
        horizon = now + self.claim_ahead_ms
        # A backup look due now takes with it those due in the next BACKUP_WINDOW_MS: one
        # statement for the lot, where each took its own round trip (and, with several
        # instances, the looks are most of the statements; nearly all find the slot decided).
        window = BACKUP_WINDOW_MS if self._backup and self._backup[0][0] <= now else 0
        backup = now + self.backup_ahead_ms + window
        claims: list[store.Claim] = []
        catch_ups: list[store.CatchUp] = []
        previous: dict[str, int] = {}
        while self._due(now, now + window):
            if self._exact and self._exact[0][0] <= now:
                _, entry, name = heapq.heappop(self._exact)
            elif self._backup and self._backup[0][0] <= now + window:
                _, entry, name = heapq.heappop(self._backup)
            else:
                _, entry, name = heapq.heappop(self._heap)
            if self._entry[name] != entry:
                continue  # superseded by a later push
            job = self.jobs[name]
            slot = self._next_slot[name]
            if self._deferred.pop(name, None) == slot or (
                self._short_since is not None and self._short_since <= slot < horizon - self.grace_ms
            ):
                # Due while this instance had no free worker: not missed by the cluster
                # (catch-up), but owed. While the job's next slot has not come it is
                # claimed late, as scheduled; slots overtaken by a newer one are recorded
                # skipped (unless another instance ran them).
                following = job.schedule.next_after(slot)
                for _ in range(SHED_LIMIT):
                    if following > now:
                        break
                    claims.append(store.Claim(job, slot, shed=True))
                    slot, following = following, job.schedule.next_after(following)
                if following > now:
                    claims.append(store.Claim(job, slot))
                    previous[name] = slot
                    self._next_slot[name] = following
                    self._push(following, name)
                    continue
                self._next_slot[name] = slot
            plan = plan_due(job.schedule, slot, horizon, self.grace_ms)
            if plan.catch_up_until is not None:
                catch_ups.append(store.CatchUp(job, plan.catch_up_until))
            if (
                plan.claim is not None
                and plan.catch_up_until is None
                and plan.claim > backup
                and not self._preferred(name, plan.claim)
            ):
                # Another instance's share: claim it only if still undecided just before the slot.
                self._next_slot[name] = plan.claim
                self._push_backup(plan.claim - self.backup_ahead_ms, name)
                continue
            if plan.claim is not None:
                claims.append(store.Claim(job, plan.claim))
            previous[name] = slot
            self._next_slot[name] = plan.next_slot
            self._push(plan.next_slot, name)
        outcome = self._decide(claims, catch_ups, skip_locked=True, now_ms=now)
        if outcome is not _FAILED and not outcome.deferred:
            self._short_since = None  # every due slot had a worker (or another instance)
        if outcome is _FAILED:
            retry = now + max(int(self._backoff * 1000), 50)
            for name, slot in previous.items():
                self._reschedule(name, slot, retry)
            return
        if outcome.busy:
            # Another instance holds these jobs, almost always deciding these very
            # slots. Look again once such a claim has had time to commit; the retry
            # starts with decide()'s unlocked read, which then usually settles it
            # without a transaction. Retrying sooner only takes CPU from the holder.
            retry = now + int(max(BUSY_RETRY_MS, 1.5 * self._claim_ms) * random.uniform(1.0, 1.3))  # noqa: S311
            for name in outcome.busy:
                self._reschedule(name, previous[name], retry)
        for claim in outcome.early:
            # Claimed ahead while the job's previous run still ran: decide at the slot.
            name = claim.job.name
            self._next_slot[name] = min(claim.slot, self._next_slot[name])
            self._push_exact(claim.slot, name)
        if outcome.deferred:
            # No room for these here: they stay due and are retried as soon as a handler returns.
            self._room_wanted = True
            for claim in outcome.deferred:
                slot = min(claim.slot, previous.get(claim.job.name, claim.slot))
                self._deferred[claim.job.name] = slot
                self._reschedule(claim.job.name, slot, now)

    def _reschedule(self, name: str, slot: int, at_ms: int) -> None:
        """Try ``slot`` of job ``name`` again at ``at_ms`` (it was not decided)."""
        self._next_slot[name] = min(slot, self._next_slot[name])
        self._push(at_ms, name)

    def _due(self, now_ms: int, backup_until: int | None = None) -> bool:
        """Whether a heap entry is within the claim-ahead margin, or an exact one or a backup look has come.

        ``backup_until``: backup looks due by then count too (the window of one that has come).
        """
        if self._heap and self._heap[0][0] <= now_ms + self.claim_ahead_ms:
            return True
        if self._exact and self._exact[0][0] <= now_ms:
            return True
        return bool(self._backup) and self._backup[0][0] <= (now_ms if backup_until is None else backup_until)

    def _push_on(self, heap: list[tuple[int, int, str]], at_ms: int, name: str) -> None:
        """Put job ``name`` on ``heap`` at ``at_ms``, superseding whatever entry it has on any heap."""
        self._entry[name] = entry = next(self._entries)
        heapq.heappush(heap, (at_ms, entry, name))

    def _push(self, at_ms: int, name: str) -> None:
        self._push_on(self._heap, at_ms, name)

    def _push_exact(self, at_ms: int, name: str) -> None:
        """Look at job ``name`` again at ``at_ms`` itself, not ``claim_ahead_ms`` before it."""
        self._push_on(self._exact, at_ms, name)

    def _push_backup(self, at_ms: int, name: str) -> None:
        """Look at job ``name`` (another instance's share) at ``at_ms``, or with a backup look just before."""
        self._push_on(self._backup, at_ms, name)

    def _decide(
        self,
        claims: list[store.Claim],
        catch_ups: list[store.CatchUp],
        skip_locked: bool = False,
        now_ms: int | None = None,
    ) -> Any:
        if not claims and not catch_ups:
            return store.Outcome()
        sent = time.monotonic()
        outcome = self._db(
            store.decide,
            claims,
            catch_ups,
            owner=self.token,
            instance_id=self.instance_id,
            ttl=self.settings.lease_ttl,
            capacity=self.capacity(),
            default_data=self.settings.data,
            skip_locked=skip_locked,
            now_ms=now_ms,
        )
        if outcome is _FAILED:
            return outcome
        if outcome.won or outcome.skipped or outcome.missed:
            # Only claims that wrote rows say how long claiming takes (one that found
            # everything decided is quick). Rise at once, decay slowly: a large batch
            # must not be claimed late because small ones came before it.
            took = (time.monotonic() - sent) * 1000
            self._claim_ms = took if took > self._claim_ms else 0.98 * self._claim_ms + 0.02 * took
        self._handle(outcome, sent)
        return outcome

    def _handle(self, outcome: store.Outcome, sent: float) -> None:
        for row in outcome.interrupted:
            signals.send(signals.run_interrupted, run=row, exception=None)
            self.keeper.lose_local(row.id, f"it was {describe_loss(row)}")
        for row in outcome.skipped:
            logger.info(
                "Run skipped: %s slot=%s (%s)",
                row.job,
                row.slot,
                row.detail,
                extra={"job": row.job, "slot": row.slot, "instance": self.instance_id},
            )
            signals.send(signals.run_skipped, run=row)
        for row in outcome.won:
            self.adopt(row, sent)

    def adopt(self, run: Run, sent: float) -> ActiveRun | None:
        """Start executing a run this process has just won (claimed at monotonic ``sent``).

        A claim that took long to commit (a locked SQLite file, a slow server)
        is renewed once first: fencing counts from when the claim was sent, so
        its handler would otherwise be aborted on arrival. If that renewal does
        not commit, the handler is not started and the run is left to expire.
        """
        if time.monotonic() - sent > self.settings.fence_after / 2:
            fresh = time.monotonic()
            renewed = self._db(store.renew, [run.id], owner=self.token, ttl=self.settings.lease_ttl)
            if renewed is _FAILED or run.id not in renewed[0]:
                logger.warning(
                    "Claim of %s slot=%s committed too late to run safely; leaving it to a backup",
                    run.job,
                    run.slot,
                    extra=log_fields(run, self.instance_id),
                )
                return None
            sent = fresh
        active = ActiveRun(run, self.jobs[run.job], renewed_at=sent)
        with self._active_lock:
            self._active[run.id] = active  # type: ignore[index]
        self.keeper.wake()
        self.runner.start(active)
        return active

    def watch(self) -> None:
        """Have the watchdog look at the runs' deadlines again (one was just set)."""
        self.keeper.watch_wake.set()

    def run_exited(self, active: ActiveRun) -> None:
        with self._active_lock:
            self._active.pop(active.run.id, None)  # type: ignore[arg-type]
        if active.run.job in self._waiting_jobs:
            self._poll_requested = True
        self._wake.set()

    def _poll(self) -> None:
        """Claim pending runs and take over expired leases; note when the next lease expires.

        The poll also returns the leases that expire before the next poll, so that
        the loop comes back when they do: a crashed runner is taken over
        ``LEASE_TTL`` after its last renewal, not up to a poll later.
        """
        self._takeover_at = float("inf")
        found = self._db(store.poll, expiring_within=self.settings.poll_interval)
        if found is _FAILED:
            return
        for row in found.expiring:
            if row.job not in self.jobs:
                self._warn_undeclared(row.job)
                continue
            expires = row.lease_expires_at.timestamp() if row.lease_expires_at else 0.0
            left_s = expires - self.clock.now_ms() / 1000
            if left_s > 0:  # not expired yet by this estimate of the database clock
                again_s = left_s + TAKEOVER_MARGIN_S
            elif not self._take_over(row):  # not by the database's own: the estimate was early
                again_s = TAKEOVER_RETRY_S
            else:
                continue
            self._takeover_at = min(self._takeover_at, time.monotonic() + again_s)
        waiting = set()
        for name in found.pending_jobs:
            if name in self.jobs:
                waiting.add(name)
            else:
                self._warn_undeclared(name)
        self._waiting_jobs = waiting
        if waiting and self.capacity() > 0:
            sent = time.monotonic()
            outcome = self._db(
                store.claim_pending,
                waiting,
                self.jobs,
                owner=self.token,
                instance_id=self.instance_id,
                ttl=self.settings.lease_ttl,
                capacity=self.capacity(),
            )
            if outcome is not _FAILED:
                self._handle(outcome, sent)

    def _warn_undeclared(self, name: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            logger.warning(
                "Runs of job %r wait, but this instance does not declare that job",
                name,
                extra={"job": name, "instance": self.instance_id},
            )

    def _take_over(self, row: Run) -> bool:
        """Try to take over ``row``, whose lease looks expired; whether this instance did."""
        self.keeper.fence_overdue()
        sent = time.monotonic()
        start = self.capacity() > 0
        result = self._db(
            store.take_over,
            row,
            owner=self.token,
            instance_id=self.instance_id,
            ttl=self.settings.lease_ttl,
            start=start,
            max_attempts=self.settings.max_attempts,
        )
        if result is _FAILED or result is None:
            return False
        old, new = result
        self.keeper.lose_local(old.id, "its lease expired and another attempt started")
        if new is None:
            logger.error(
                "Gave up %s slot=%s: %s",
                old.job,
                old.slot,
                old.error_message,
                extra={"job": old.job, "slot": old.slot, "attempt": old.attempt, "instance": self.instance_id},
            )
            signals.send(signals.run_failed, run=old, exception=AttemptsExhausted(old.error_message))
            return True
        logger.warning(
            "Took over %s slot=%s: attempt %d on %s stopped renewing its lease; attempt %d %s",
            old.job,
            old.slot,
            old.attempt,
            old.instance_id or "?",
            new.attempt,
            "starts here" if start else "is pending",
            extra={"job": old.job, "slot": old.slot},
        )
        signals.send(signals.run_interrupted, run=old, exception=None)
        if new.status == Status.RUNNING:
            self.adopt(new, sent)
        return True

    def _housekeeping(self) -> None:
        self._db(store.heartbeat, self.token, self.instance_id, self.host, self.pid)
        self._measure_clock()
        now = time.monotonic()
        if now >= self._next_prune:
            deleted = self._db(store.prune, self.settings.history_retention)
            if deleted not in (_FAILED, 0):
                logger.info("Pruned %d old run(s)", deleted, extra={"instance": self.instance_id})
            if self._next_prune:  # not at start, where ensure_jobs() has just run
                self._db(store.ensure_jobs, self.jobs.values())
            closed = self._db(store.close_undeclared, UNDECLARED_GRACE_S)
            if closed is not _FAILED:
                for name, count in sorted(closed.items()):
                    logger.warning(
                        "Closed %d waiting run(s) of job %r: no running instance has declared it for %g hours",
                        count,
                        name,
                        UNDECLARED_GRACE_S / 3600,
                        extra={"job": name, "instance": self.instance_id},
                    )
            self._next_prune = now + HOUSEKEEPING_EVERY_S


__all__ = ["Clock", "DuePlan", "Engine", "plan_due"]
