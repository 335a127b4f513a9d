"""Which slots are due, and who claims them first (pure: no database, no threads, no clock reading).

* :class:`SlotQueue` keeps every job's next slot in heaps keyed by the time it is
  to be looked at, so a loop turn costs O(log n) in the number of jobs, and turns
  the entries that have come due into a :class:`Batch` of claims and catch-up
  windows for one ``store.decide`` statement; :meth:`SlotQueue.settle` puts back
  what the database left undecided.
* :class:`ShareOut` deals the slots of one instant among the live instances.
* :func:`plan_due` says what a due job needs: a current slot to claim, a window
  of slots the cluster may have missed, or both.

The caller passes the time in: every decision here is a function of its inputs.
"""

from __future__ import annotations

import heapq
import itertools
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .registry import Job
    from .schedules import Schedule

SCHEDULED, CATCH_UP = "scheduled", "catch-up"  # models.Reason values; this module stays free of Django

# How far ahead of their slot the other instances' shares are looked at (in case their instance is gone).
BACKUP_AHEAD_MS = 30
# A backup look that has come takes with it the looks due within this many ms: one statement for the lot.
BACKUP_WINDOW_MS = 20
# An instance's own share is claimed at least this much before the earliest backup look of any other.
FIRST_PASS_MARGIN_MS = 40
CLAIM_AHEAD_MAX_MS = 250
# The most slots of one job recorded skipped in one turn for want of a free worker; older ones go to
# catch-up's accounting (a missed count), as after an outage.
SHED_LIMIT = 100
# What a skipped row says of a slot nobody ran before the job's next slot came (``Claim.shed``).
SHED_DETAIL = "no instance had a free worker for it before the job's next slot came (MAX_WORKERS)"
BEHIND_DETAIL = (
    "no instance claimed it before the job's next slot was decided: the instances were behind "
    "(too many runs for their CPU or MAX_WORKERS)"
)


@dataclass(frozen=True)
class Claim:
    """A slot this instance wants decided: run it, skip it, queue it, or nothing (paused)."""

    job: Job
    slot: int
    reason: str = SCHEDULED
    # catch_up="all": when the job is busy, wait as a pending run instead of being skipped.
    wait: bool = False
    # Overtaken by the job's next slot before anyone ran it: recorded skipped, if still
    # undecided, with this detail (SHED_DETAIL or BEHIND_DETAIL); empty for a slot to run.
    shed: str = ""


@dataclass(frozen=True)
class CatchUp:
    """A job whose slots up to ``until`` may have been missed by the whole cluster.

    ``since``: the oldest of them this instance found undecided when it came to
    them late (None at start-up). If the job's next slot has been decided
    meanwhile, those still undecided were overtaken, not missed by the
    cluster: they are recorded skipped (``BEHIND_DETAIL``), so that none goes
    unaccounted for.
    """

    job: Job
    until: int
    since: int | None = None


@dataclass
class Batch:
    """What one loop turn asks the database to decide, and each job's slot before the turn."""

    claims: list[Claim] = field(default_factory=list)
    catch_ups: list[CatchUp] = field(default_factory=list)
    previous: dict[str, int] = field(default_factory=dict)
    # Jobs whose slots came due with no free worker (see SlotQueue._owed): the first of them,
    # from which an undecided batch starts again, so that no slot it would shed is lost.
    owed: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.claims or self.catch_ups)


@dataclass(frozen=True)
class DuePlan:
    """What to do with a job whose next slot is due (see :func:`plan_due`)."""

    claim: int | None  # a current slot to claim as scheduled
    catch_up_until: int | None  # slots up to here may have been missed by everyone
    next_slot: int  # the job's next slot after this turn


def plan_due(schedule: Schedule, next_slot: int, now_ms: int, grace_ms: int) -> DuePlan:
    """Decide what a due job needs at ``now_ms`` (the instance's horizon: now and its claim-ahead).

    A slot is *current* while it is no more than ``grace_ms`` old: it is claimed
    as ``scheduled``, one slot a plan (the next plan starts after it; a job more
    frequent than the claim-ahead has several current slots in one loop turn,
    each claimed in its own plan, and none of them missed). Older due slots,
    which this instance did not claim in time (it was starting, frozen or cut off
    from the database), go to catch-up, where the database decides whether
    anyone missed them.
    """
    if next_slot > now_ms:  # nothing due yet
        return DuePlan(None, None, next_slot)
    following = schedule.next_after(next_slot)
    if now_ms - next_slot <= grace_ms:
        # The common case: current. No backward search (it is the costly one for cron),
        # and next_after() is memoised for jobs sharing the schedule.
        return DuePlan(next_slot, None, following)
    if following > now_ms:
        return DuePlan(None, next_slot, following)  # the one slot due is past its grace
    # Several slots due, the oldest past its grace: those past it go to catch-up, and the
    # first current one after them (if any) is claimed.
    stale = schedule.latest_at_or_before(now_ms - grace_ms - 1) or next_slot
    current = schedule.next_after(stale)
    if current <= now_ms:
        return DuePlan(current, stale, schedule.next_after(current))
    return DuePlan(None, stale, current)


def first_current(schedule: Schedule, now_ms: int, grace_ms: int) -> int:
    """The first slot an instance starting at ``now_ms`` claims as scheduled; the ones before it are for catch-up.

    The newest slot due, while it is no more than ``grace_ms`` old (the instance was
    restarted just after it); otherwise the next one.
    """
    latest = schedule.latest_at_or_before(now_ms)
    if latest is not None and now_ms - latest <= grace_ms:
        return latest
    return schedule.next_after(now_ms)


def draw_claim_ahead(claim_ms: float, jitter_ms: float) -> int:
    """How far ahead of its slot an instance claims its own share this turn (ms).

    At least twice its recent claim time, so that the claim commits before the
    slot, and at least ``FIRST_PASS_MARGIN_MS`` more than the earliest backup
    look (``BACKUP_AHEAD_MS + BACKUP_WINDOW_MS``), at most ``CLAIM_AHEAD_MAX_MS``,
    plus ``jitter_ms``. The backup lead is the same everywhere and below every
    first lead, so a peer's share is never taken before that peer's own first
    pass; a backup lead that followed the claim time let the instance with the
    slowest claims (the one writing the most rows) take the shares of the
    fastest, which then won nothing.
    """
    floor = BACKUP_AHEAD_MS + BACKUP_WINDOW_MS + FIRST_PASS_MARGIN_MS
    return int(min(float(CLAIM_AHEAD_MAX_MS), max(floor, 2 * claim_ms)) + jitter_ms)


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


class ShareOut:
    """Which slots this instance claims in the first pass: its share among the live instances.

    Every instance reads the same sorted list of live instances and deals the
    jobs round it (:func:`share_index`), so each slot has one preferred instance
    and the slots due at one instant are shared out evenly. This only orders the
    attempts: the claim itself is decided by the database, the other instances
    claim the slot too just before it is due if it is still undecided, and
    instances whose lists differ for a moment (one just started or stopped) at
    worst both try first.
    """

    def __init__(self, names: Iterable[str], token: str) -> None:
        self.token = token
        self.ranks = share_ranks(names)
        self.peers: tuple[str, ...] = ()

    def update(self, tokens: Iterable[str]) -> None:
        """The live instances' tokens (this one is added if missing)."""
        self.peers = tuple(sorted({*tokens, self.token}))

    def preferred(self, name: str, slot: int) -> bool:
        """Whether this instance claims ``slot`` of job ``name`` in the first pass."""
        peers = self.peers
        if len(peers) < 2:
            return True
        return peers[share_index(self.ranks[name], slot, len(peers))] == self.token


def _overtaken_from(job: Job, slot: int, now_ms: int) -> tuple[list[Claim], int, int]:
    """Shed claims for ``job``'s slots from ``slot`` on whose next slot has come by ``now_ms``
    (``SHED_LIMIT`` at most); then the first slot not shed and the one after it."""
    shed = []
    following = job.schedule.next_after(slot)
    for _ in range(SHED_LIMIT):
        if following > now_ms:
            break
        shed.append(Claim(job, slot, shed=SHED_DETAIL))
        slot, following = following, job.schedule.next_after(following)
    return shed, slot, following


class SlotQueue:
    """Every job's next slot, and when to look at it.

    Three heaps of ``(time ms, entry number, job name)``: the main one, looked
    at ``claim_ahead_ms`` before its time; the exact one, at its time (a busy
    job's slot claimed ahead is decided at the slot); and the backup looks at
    other instances' shares. A job's entry number changes whenever it is pushed
    again, so an older entry still in a heap is recognised and dropped.
    """

    def __init__(self, jobs: Iterable[Job]) -> None:
        self.jobs: dict[str, Job] = {job.name: job for job in jobs}
        self.claim_ahead_ms = BACKUP_AHEAD_MS + BACKUP_WINDOW_MS + FIRST_PASS_MARGIN_MS
        self.backup_ahead_ms = BACKUP_AHEAD_MS
        self._heap: list[tuple[int, int, str]] = []
        self._exact: list[tuple[int, int, str]] = []
        self._backup: list[tuple[int, int, str]] = []
        self._entry: dict[str, int] = {}
        self._entries = itertools.count()
        self._next_slot: dict[str, int] = {}
        self._deferred: dict[str, int] = {}  # job -> a slot it was due at with no free worker here
        self._short_since: int | None = None  # since when (ms) slots wait for a free worker here

    def __len__(self) -> int:
        """How many entries the heaps hold, stale ones included."""
        return len(self._heap) + len(self._exact) + len(self._backup)

    def live(self) -> int:
        """How many entries are current (one per job once seeded)."""
        return sum(
            1
            for heap in (self._heap, self._exact, self._backup)
            for _, entry, name in heap
            if self._entry[name] == entry
        )

    def next_slot(self, name: str) -> int:
        """The slot of job ``name`` that this instance looks at next."""
        return self._next_slot[name]

    def seed(self, now_ms: int, grace_ms: int) -> None:
        """Start every job at its first current slot (:func:`first_current`; older ones were for catch-up)."""
        self._heap = []
        for job in self.jobs.values():
            slot = first_current(job.schedule, now_ms, grace_ms)
            self._next_slot[job.name] = slot
            self._entry[job.name] = entry = next(self._entries)
            self._heap.append((slot, entry, job.name))
        heapq.heapify(self._heap)

    def push(self, at_ms: int, name: str, slot: int | None = None) -> None:
        """Look at job ``name`` ``claim_ahead_ms`` before ``at_ms`` (for ``slot``, if given)."""
        self._push_on(self._heap, at_ms, name, slot)

    def push_exact(self, at_ms: int, name: str, slot: int | None = None) -> None:
        """Look at job ``name`` at ``at_ms`` itself, not ``claim_ahead_ms`` before it."""
        self._push_on(self._exact, at_ms, name, slot)

    def push_backup(self, at_ms: int, name: str, slot: int | None = None) -> None:
        """Look at job ``name`` (another instance's share) at ``at_ms``, or with a backup look just before."""
        self._push_on(self._backup, at_ms, name, slot)

    def _push_on(self, heap: list[tuple[int, int, str]], at_ms: int, name: str, slot: int | None) -> None:
        if slot is not None:
            self._next_slot[name] = slot
        self._entry[name] = entry = next(self._entries)
        heapq.heappush(heap, (at_ms, entry, name))

    def reschedule(self, name: str, slot: int, at_ms: int) -> None:
        """Try ``slot`` of job ``name`` again at ``at_ms`` (it was not decided)."""
        self.push(at_ms, name, min(slot, self._next_slot[name]))

    def due(self, now_ms: int, backup_until: int | None = None) -> bool:
        """Whether a main entry is within the claim-ahead margin, or an exact one or a backup look has come.

        ``backup_until``: backup looks due by then count too (the window of one that has come).
        """
        if self._heap and self._heap[0][0] <= now_ms + self.claim_ahead_ms:
            return True
        if self._exact and self._exact[0][0] <= now_ms:
            return True
        return bool(self._backup) and self._backup[0][0] <= (now_ms if backup_until is None else backup_until)

    def wake_in_ms(self, now_ms: int) -> float | None:
        """How long until the next entry is due (None: no entry)."""
        times = [heap[0][0] for heap in (self._exact, self._backup) if heap]
        if self._heap:
            times.append(self._heap[0][0] - self.claim_ahead_ms)
        return min(times) - now_ms if times else None

    def note_no_room(self, now_ms: int) -> None:
        """Every worker is busy from ``now_ms``: slots that come due meanwhile are owed, not missed."""
        if self._short_since is None:
            self._short_since = now_ms

    def take_due(self, now_ms: int, grace_ms: int, preferred: Callable[[str, int], bool]) -> Batch:
        """Pop the entries that have come due and say what to claim.

        Own share (``preferred``) ``claim_ahead_ms`` ahead; the others' slots
        ``backup_ahead_ms`` ahead (with the backup looks due within
        ``BACKUP_WINDOW_MS``); slots past their grace go to catch-up, unless
        they came due while this instance had no free worker: then they are
        claimed late, as scheduled, until the job's next slot comes, and
        recorded skipped (``shed``) after that.
        """
        horizon = now_ms + self.claim_ahead_ms
        window = BACKUP_WINDOW_MS if self._backup and self._backup[0][0] <= now_ms else 0
        backup = now_ms + self.backup_ahead_ms + window
        batch = Batch()
        while self.due(now_ms, now_ms + window):
            if self._exact and self._exact[0][0] <= now_ms:
                _, entry, name = heapq.heappop(self._exact)
            elif self._backup and self._backup[0][0] <= now_ms + window:
                _, entry, name = heapq.heappop(self._backup)
            else:
                _, entry, name = heapq.heappop(self._heap)
            if self._entry[name] != entry:
                continue  # superseded by a later push
            job = self.jobs[name]
            slot = self._next_slot[name]
            if self._deferred.pop(name, None) == slot or (
                self._short_since is not None and self._short_since <= slot < horizon - grace_ms
            ):
                slot = self._owed(job, slot, now_ms, batch)
                if slot < 0:
                    continue
            plan = plan_due(job.schedule, slot, horizon, grace_ms)
            if plan.catch_up_until is not None:
                batch.catch_ups.append(CatchUp(job, plan.catch_up_until, since=slot))
            if (
                plan.claim is not None
                and plan.catch_up_until is None
                and plan.claim > backup
                and not preferred(name, plan.claim)
            ):
                # Another instance's share: claim it only if still undecided just before the slot.
                self.push_backup(plan.claim - self.backup_ahead_ms, name, plan.claim)
                continue
            if plan.claim is not None:
                batch.claims.append(Claim(job, plan.claim))
            batch.previous.setdefault(name, slot)  # the oldest: where to look again if undecided
            self.push(plan.next_slot, name, plan.next_slot)
        return batch

    def _owed(self, job: Job, slot: int, now_ms: int, batch: Batch) -> int:
        """A slot due while this instance had no free worker: claim it late, or shed it; -1 when it was claimed."""
        name = job.name
        batch.owed[name] = slot
        shed, slot, following = _overtaken_from(job, slot, now_ms)
        batch.claims.extend(shed)
        if following > now_ms:
            batch.claims.append(Claim(job, slot))
            batch.previous.setdefault(name, slot)
            self.push(following, name, following)
            return -1
        self._next_slot[name] = slot
        return slot

    def overtaken(self, now_ms: int) -> list[Claim]:
        """The slots owed here (due with no free worker) that the job's next slot has overtaken, to shed.

        For a stop: each would be recorded skipped (``SHED_DETAIL``) on its job's next look,
        and no other instance looks at a slot once it has come. Slots still current are
        left to a later start's catch-up, as any slot undecided at a stop is.
        """
        claims = []
        for name, job in self.jobs.items():
            if name not in self._next_slot:
                continue  # stopped before the queue was seeded
            slot = min(self._deferred.get(name, self._next_slot[name]), self._next_slot[name])
            if name not in self._deferred and (self._short_since is None or slot < self._short_since):
                continue
            claims.extend(_overtaken_from(job, slot, now_ms)[0])
        return claims

    def failed(self, batch: Batch, retry_at_ms: int) -> None:
        """The batch could not be decided (a database error): look at its slots again at ``retry_at_ms``."""
        for name in batch.previous:
            self._again(batch, name, retry_at_ms)

    def _again(self, batch: Batch, name: str, at_ms: int) -> None:
        """Look at job ``name`` again at ``at_ms``: its batch was not decided (busy, or a database error)."""
        if name in batch.owed:
            # Its oldest owed slot, owed still: shed or claimed late when looked at again.
            self._deferred[name] = batch.owed[name]
            self.reschedule(name, batch.owed[name], at_ms)
        else:
            self.reschedule(name, batch.previous[name], at_ms)

    def settle(self, batch: Batch, outcome: Any, now_ms: int, busy_retry_at_ms: int) -> bool:
        """Put back what the database left undecided; whether some slots wait for a free worker here.

        ``outcome`` (a ``store.Outcome``): ``busy`` jobs another instance held are
        looked at again at ``busy_retry_at_ms``; slots claimed ahead while their
        job still ran (``early``) are decided at the slot; slots with no free
        worker (``deferred``) stay due and are claimed again when one is free.
        """
        for name in outcome.busy:
            self._again(batch, name, busy_retry_at_ms)
        for claim in outcome.early:
            name = claim.job.name
            self.push_exact(claim.slot, name, min(claim.slot, self._next_slot[name]))
        for claim in outcome.deferred:
            name = claim.job.name
            slot = min(claim.slot, batch.previous.get(name, claim.slot))
            self._deferred[name] = slot
            self.reschedule(name, slot, now_ms)
        if not outcome.deferred:
            self._short_since = None  # every due slot had a worker (or another instance)
        return bool(outcome.deferred)


__all__ = [
    "BACKUP_AHEAD_MS",
    "BACKUP_WINDOW_MS",
    "BEHIND_DETAIL",
    "Batch",
    "CatchUp",
    "Claim",
    "DuePlan",
    "SHED_DETAIL",
    "ShareOut",
    "SlotQueue",
    "draw_claim_ahead",
    "first_current",
    "plan_due",
    "share_index",
    "share_ranks",
]
