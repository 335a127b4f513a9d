"""Deciding slots: scheduled and catch-up claims, in one transaction (or one statement on PostgreSQL and SQLite)."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import transaction

from ..dbtime import DbNow, db_in, db_not_before
from ..models import Reason, Run, Status
from ..slots import BEHIND_DETAIL, SHED_LIMIT, CatchUp, Claim
from . import statements
from .base import (
    CATCH_UP_LIMIT,
    WAITING_FOR_A_WORKER,
    WAITING_FOR_THE_CATCH_UP,
    WAITING_FOR_THE_PREVIOUS_RUN,
    Outcome,
    _busy_detail,
    _interrupt,
    _iso,
    _JobView,
    _resolved_data,
    _runs,
    _views_of,
    alias,
    first_attempt,
    first_attempt_values,
    logger,
    notify,
    retry_deadlocks,
    slot_datetime,
)

if TYPE_CHECKING:
    from ..registry import Job

REPLACED = "replaced by a newer slot (overlap='replace')"
_Missed = tuple[Run, int]  # a missed record (not yet saved) and how many slots it counts
# A catch-up waits for its job to be free; under replace, a job whose runs outlast its interval never is.
NO_TURN = (
    "replaced by a newer slot (overlap='replace'): a newer slot's run outlasted its interval "
    "before this catch-up had its turn"
)


@retry_deadlocks
def decide(
    claims: Sequence[Claim],
    catch_ups: Sequence[CatchUp] = (),
    *,
    owner: str,
    instance_id: str,
    ttl: float,
    capacity: int,
    default_data: Any = None,
    skip_locked: bool = False,
    now_ms: int | None = None,
    first_look: bool = True,
) -> Outcome:
    """Decide slots: the one transaction behind every scheduled and catch-up claim.

    Locks the JobState rows of every job involved, then, seeing everything
    committed before: skips paused jobs; expands ``catch_ups`` into catch-up
    claims and a ``missed`` record (per the job's ``catch_up`` policy, counting
    from the newest slot on record and the last resume); and decides each
    claim in slot order by the job's overlap policy: run (insert a ``running``
    row owned by ``owner``, up to ``capacity`` of them; the rest are deferred
    and left for others), skip (a ``skipped`` row), queue (a ``pending`` row),
    or replace (mark the active runs ``interrupted``, then run). A slot that
    already has a row was decided by someone else and is left alone. With
    ``skip_locked``, jobs whose row another transaction holds are returned in
    ``busy``, undecided, for the caller to retry. A claim for a slot after
    ``now_ms`` (claimed ahead of time) whose job is still busy is returned in
    ``early``, undecided: whether to skip, queue or replace is decided at the
    slot, when the running run may have ended.

    ``first_look``: scheduled claims are first looked up without a lock, so that
    an instance that comes after the slots were decided learns it without
    taking (or waiting for) any lock. An instance that knows of no other live
    one leaves it out (False): it would find nothing, and the locked decision
    tells a slot someone else decided all the same.
    """
    common: dict[str, Any] = {
        "owner": owner,
        "instance_id": instance_id,
        "ttl": ttl,
        "default_data": default_data,
        "skip_locked": skip_locked,
    }
    # The claim function tells a busy job by its running (or handed-over) run only; a queue job's
    # waiting slot must also hold back a new one, so those are decided on the Python path.
    plain = [c for c in claims if c.job.overlap != "queue"]
    if plain and not catch_ups and statements.can_claim_in_one_statement(plain):
        # PostgreSQL and SQLite: the plain case in one statement; what it leaves
        # undecided (busy jobs, jobs with no row yet) takes the Python path.
        queued = [c for c in claims if c.job.overlap == "queue"]
        plain = _outside_last_pauses(plain, now_ms)
        try:
            outcome, rest = (
                statements.claim_scheduled(plain, capacity=capacity, first_look=first_look, **common)
                if plain
                else (Outcome(), [])
            )
        except statements.NoClaimFunction:
            return _decide(claims, (), capacity=capacity, now_ms=now_ms, first_look=first_look, **common)
        rest = [*rest, *queued]
        if rest:
            more = _decide(rest, (), capacity=capacity - len(outcome.won), now_ms=now_ms, first_look=False, **common)
            for name in ("won", "skipped", "interrupted", "deferred", "missed", "busy", "early"):
                getattr(outcome, name).extend(getattr(more, name))
            if more.interrupted:
                # A replace job's older slot that the statement won, replaced by its next slot of the
                # same batch: recorded interrupted before it started, and never started.
                replaced = {r.id for r in more.interrupted}
                outcome.won = [r for r in outcome.won if r.id not in replaced]
            outcome.won.sort(key=lambda r: (r.slot, r.job))
        return outcome
    return _decide(claims, catch_ups, capacity=capacity, now_ms=now_ms, first_look=first_look, **common)


def _outside_last_pauses(claims: list[Claim], now_ms: int | None) -> list[Claim]:
    """``claims`` but those of slots, already due, that fell in their job's last pause.

    The one-statement claims read only whether a job is paused now. An instance that comes to a
    slot late (it was frozen, or busy) may find the job paused at the slot and resumed since: that
    slot is not run (as :func:`_decide` tells under the job locks). A slot still ahead cannot fall in
    a pause that has ended (it ended before now), and a pause that has not, the claim itself sees;
    and for a slot already due, its job's last pause cannot change any more to take it in (a new
    pause starts now, after it): so this unlocked look before the claim is enough.
    """
    late = sorted({c.job.name for c in claims if now_ms is None or c.slot <= now_ms})
    if not late:
        return claims
    windows = statements.last_pauses(late)
    if not windows:
        return claims
    return [
        c for c in claims if c.job.name not in windows or not _paused_then(c.slot, *_last_pause(*windows[c.job.name]))
    ]


def _decide(
    claims: Sequence[Claim],
    catch_ups: Sequence[CatchUp],
    *,
    owner: str,
    instance_id: str,
    ttl: float,
    capacity: int,
    default_data: Any,
    skip_locked: bool,
    now_ms: int | None,
    first_look: bool = True,
) -> Outcome:
    """The Python path of :func:`decide`: every case, in one transaction.

    ``first_look``: see :func:`decide` (False also when the claim function has just taken that look).
    """
    outcome = Outcome()
    if claims and not catch_ups and first_look:
        # Unlocked first look: an instance that arrives after the slots were
        # decided learns it without taking (or waiting for) any lock.
        done = statements.decided(sorted({c.job.name for c in claims}), sorted({c.slot for c in claims}))
        claims = [c for c in claims if (c.job.name, c.slot) not in done]
    if not claims and not catch_ups:
        return outcome
    db = alias()
    names = sorted({c.job.name for c in claims} | {c.job.name for c in catch_ups})
    later: list[Callable[[], None]] = []  # warnings to log once the transaction has committed
    with transaction.atomic(using=db):
        states = statements.lock_jobs(names, skip_locked=skip_locked)
        if len(states) < len(names):
            outcome.busy = sorted(set(names) - set(states))
            claims = [c for c in claims if c.job.name in states]
            catch_ups = [c for c in catch_ups if c.job.name in states]
            names = sorted(states)
        all_claims = list(claims)
        missed: list[_Missed] = []
        if catch_ups:
            extra, missed = _expand_catch_ups(catch_ups, states, owner, instance_id, later)
            all_claims = extra + all_claims
        slots = sorted({c.slot for c in all_claims})
        # One query for both "what is each job doing" and "was this slot decided".
        rows = statements.runs_for_decision(names, slots)
        taken = {(r.job, r.slot) for r in rows if r.attempt == 1 and not r.manual}
        views = _views_of(r for r in rows if r.status in (Status.RUNNING, Status.PENDING))
        inserts: list[Run] = []
        replace_ids: list[int] = []
        no_turn: list[int] = []
        budget = capacity
        # One expression object per value, so that each is compiled once per batch.
        now, lease, started = DbNow(), db_in(ttl), {}
        bases: dict[tuple[str, bool], dict[str, Any]] = {}  # what rows of one status share, by (status, waits)

        def base(status: str, waits: bool = False) -> dict[str, Any]:
            if (status, waits) not in bases:
                mine = "" if waits else instance_id, "" if waits else owner
                shared = first_attempt_values(status, instance_id=mine[0], owner=mine[1])
                shared["created_at"] = now
                bases[(status, waits)] = shared
            return bases[(status, waits)]

        for claim in sorted(all_claims, key=lambda c: (c.slot, c.job.name)):
            job = claim.job
            state = states[job.name]
            if state.paused or (job.name, claim.slot) in taken:
                continue
            if claim.reason == Reason.SCHEDULED and not claim.shed and _in_last_pause(claim.slot, state):
                continue  # due in the job's last pause, come to late: not run (see _outside_last_pauses)
            view = views[job.name]
            if claim.shed:
                row = first_attempt(claim, base(Status.SKIPPED), _resolved_data(job, default_data))
                row.finished_at = now
                row.detail = claim.shed
                inserts.append(row)
                taken.add((job.name, claim.slot))
                continue
            # Busy: a run of the job runs (or waits for its next attempt); under "queue", a slot
            # already waiting holds back a new one too, so that it is not overtaken by it. So does
            # a slot waiting its turn hold back a catch-up, which runs in slot order after it: an
            # earlier outage's catch-ups still waiting when the cluster went down again (helper 41).
            # (A manual run waiting does not: it is no slot of the schedule.)
            waiting = any(not r.manual for r in view.queued) if claim.wait else job.overlap == "queue" and view.queued
            busy = job.overlap != "allow" and bool(view.active or waiting)
            if busy and now_ms is not None and claim.slot > now_ms:
                outcome.early.append(claim)
                continue
            status, detail = _overlap(claim, view) if busy else (Status.RUNNING, "")
            if status == Status.RUNNING and budget <= 0:
                if claim.reason != Reason.CATCH_UP:
                    outcome.deferred.append(claim)  # and under replace, the active run goes on
                    continue
                # A missed slot is owed a run: it waits as a pending run for whichever
                # instance has a free worker first, rather than vanish unrecorded.
                status, detail = Status.PENDING, WAITING_FOR_A_WORKER
            if status == Status.RUNNING:
                budget -= 1
                if busy and job.overlap == "replace":
                    replace_ids.extend(r.id for r in view.active if r.id is not None)
                    no_turn.extend(_left_no_turn(view))
                    for older in view.active:
                        if older.id is None:
                            # Won in this very batch (an older slot, or a catch-up): replaced before
                            # it ever starts, and recorded so rather than run beside the new one.
                            older.status, older.detail = Status.INTERRUPTED, REPLACED
                            older.lease_expires_at = None
                            older.finished_at = now
                            budget += 1
            waits = status == Status.PENDING
            row = first_attempt(claim, base(status, waits), _resolved_data(job, default_data))
            if detail:
                row.detail = detail
            if status == Status.RUNNING:
                # Claimed a few ms ahead of the slot; the handler starts at the slot.
                if claim.slot not in started:
                    started[claim.slot] = db_not_before(row.scheduled_at)
                row.started_at = started[claim.slot]
                row.lease_expires_at = lease
                if job.overlap != "allow":
                    view.active = [row]  # later claims of this job in the batch see it busy
            elif status == Status.SKIPPED:
                row.finished_at = now
            elif status == Status.PENDING:
                view.queued.append(row)
            taken.add((job.name, claim.slot))
            inserts.append(row)
        if replace_ids:
            outcome.interrupted = _interrupt(replace_ids, REPLACED)
        if no_turn:
            outcome.interrupted.extend(_interrupt(no_turn, NO_TURN))
        if missed:
            inserts.extend(row for row, _ in missed)
            _count_missed(missed)
            later.extend(
                functools.partial(
                    logger.warning,
                    "Job %r: %s",
                    row.job,
                    row.detail,
                    extra={"job": row.job, "missed": count, "instance": instance_id},
                )
                for row, count in missed
            )
        if inserts:
            # No conflict is possible under the job locks, but run_now() may
            # pick the same millisecond; the INSERT leaves out a taken slot
            # and returns (or the read-back tells) what was really inserted.
            stored = statements.insert_runs(inserts)
            pairs = {(r.job, r.slot) for r in inserts}
            if stored is None:
                stored = list(
                    _runs().filter(
                        job__in=names, slot__in=sorted({r.slot for r in inserts}), attempt=1, manual=False, owner=owner
                    )
                )
            for row in stored:
                if (row.job, row.slot) not in pairs or row.owner != owner:
                    continue  # an older row of ours that only shares a job or a slot value
                if row.status == Status.RUNNING:
                    outcome.won.append(row)
                elif row.status == Status.SKIPPED:
                    outcome.skipped.append(row)
                elif row.status == Status.MISSED:
                    outcome.missed.append(row)
                elif row.status == Status.INTERRUPTED:
                    outcome.interrupted.append(row)
        if any(r.status == Status.PENDING for r in inserts):
            notify("queued")
    for say in later:  # once committed, and outside the locks
        say()
    outcome.won.sort(key=lambda r: (r.slot, r.job))
    return outcome


def _behind_catch_up(claim: Claim, view: _JobView) -> bool:
    """Whether ``claim``, a scheduled slot of a busy ``skip`` job, waits for the job's catch-up rather than be skipped.

    After an outage of the whole cluster the first instance back runs the job's newest missed
    slot (every one, under ``catch_up="all"``), and the job's current slot comes due while that
    runs: skipping it would leave the job run for a slot older than the one that is due. So the
    first slot that finds the job busy with catch-ups only (running, or won in the same batch,
    and any others waiting) waits behind them as a pending run, as a ``queue`` job's slot does;
    the slots after it are skipped as usual, for it already waits.
    """
    return (
        claim.job.overlap == "skip"
        and claim.reason == Reason.SCHEDULED
        and not claim.shed
        and bool(view.active)
        and all(r.reason == Reason.CATCH_UP for r in view.active)
        and all(r.reason == Reason.CATCH_UP for r in view.queued)
    )


def _left_no_turn(view: _JobView) -> list[int]:
    """The waiting catch-ups of a replace job that its newest slot, about to replace what runs, leaves no turn.

    A catch-up waits for the job to be free (see :func:`_expand_catch_ups`). A job whose runs
    outlast its interval never is: each slot replaces the run before it, and the catch-up would
    wait for ever. So once the run being replaced is of a slot newer than a waiting catch-up (a
    newer slot's run outlasted its interval while the catch-up waited), the catch-up is recorded
    replaced, as the run of an older slot is under replace: one such overrun is enough, as one
    replaced run is. A catch-up waiting behind a run older than itself (a run from before the
    outage, or the previous catch-up under ``catch_up="all"``) keeps its turn.
    """
    newest = max((r.slot for r in view.active if r.id is not None and not r.manual), default=None)
    if newest is None:
        return []
    return [
        r.id
        for r in view.queued
        if r.id is not None and r.reason == Reason.CATCH_UP and not r.manual and r.slot < newest
    ]


def _overlap(claim: Claim, view: _JobView) -> tuple[str, str]:
    """What a slot of a busy job becomes under its overlap policy: (status, detail).

    Under ``skip``, the slot that comes due while the job's catch-up runs waits behind it
    (see :func:`_behind_catch_up`). ``replace`` runs (the caller interrupts what runs); ``allow`` never gets here.
    Under ``queue`` the job may have no active run, only a slot waiting to start.
    """
    if claim.wait:  # a catch-up: every missed slot it runs waits its turn, one after another
        return Status.PENDING, WAITING_FOR_THE_PREVIOUS_RUN
    if claim.job.overlap == "queue" and view.queued:
        return Status.SKIPPED, f"a run is already queued (slot {_iso(view.queued[0].slot)})"
    active = view.active[0]
    if claim.job.overlap == "skip":
        if _behind_catch_up(claim, view):
            return Status.PENDING, WAITING_FOR_THE_CATCH_UP
        return Status.SKIPPED, _busy_detail(active)
    if claim.job.overlap == "queue":
        return Status.PENDING, "queued: " + _busy_detail(active)
    return Status.RUNNING, ""


def _expand_catch_ups(
    catch_ups: Sequence[CatchUp],
    states: dict[str, statements.Locked],
    owner: str,
    instance_id: str,
    later: list[Callable[[], None]],
) -> tuple[list[Claim], list[_Missed]]:
    """Turn windows of possibly missed slots into catch-up claims and ``missed`` records.

    The floor is the newest slot on record for the job (any status but manual,
    including runs that history pruning deleted: ``JobState.pruned_slot``) or
    the last resume, whichever is later; a job with no record at all has never
    run and has nothing to catch up. Caller holds the job locks, so two
    instances cannot both count the same missed slots.

    Instances that come back together after an outage may disagree about one
    slot: to the first it was still current (within its start-up grace), so it
    caught up only what came before and claims that slot as scheduled; to the
    next one, starting a few ms later, it is already past its grace. A window
    that holds just that one slot, which was due when the floor was decided by
    a catch-up (a catch-up run or a ``missed`` record created after the slot),
    is claimed as scheduled here too: whichever instance decides the slot,
    there is one catch-up for the outage and one record for the slot.
    """
    names = [c.job.name for c in catch_ups]
    newest = statements.newest_scheduled(names)
    last = {job: slot for job, (slot, _) in newest.items()}
    decided_by_catch_up = {job: created for job, (_, created) in newest.items() if created is not None}
    claims: list[Claim] = []
    missed: list[_Missed] = []
    for catch_up in catch_ups:
        job = catch_up.job
        state = states[job.name]
        floor = max(
            (slot for slot in (last.get(job.name), state.pruned_slot) if slot is not None),
            default=None,
        )
        if floor is None:
            continue
        if state.paused:
            # Paused now: nothing is run, and slots from the pause on stay unrecorded. The slots
            # between the newest record and the pause were the job's own and nobody ran them:
            # recorded missed now, as this window is not looked at again after the resume.
            why = "not run: the job was paused after them"
            missed.extend(
                _missed_before_pause(job, floor, _ms(state.paused_at), catch_up.until, why, owner, instance_id)
            )
            continue
        paused_from, resumed = _last_pause(_ms(state.paused_at), _ms(state.resumed_at))
        if catch_up.since is not None and catch_up.until < floor:
            # This instance came to these slots late, and the job's next slot is decided
            # already: whichever of them nobody decided was overtaken, and is recorded so.
            # (A paused period's slots stay unrecorded, as they would have been.)
            # So is a range another instance recorded missed (its cluster-wide outage
            # caught up) while this one was behind: counted once, there.
            spans = _missed_spans(job, catch_up.since)
            slot = catch_up.since
            for _ in range(SHED_LIMIT):
                if slot > catch_up.until:
                    break
                if not _paused_then(slot, paused_from, resumed) and not any(a <= slot <= b for a, b in spans):
                    claims.append(Claim(job, slot, shed=BEHIND_DETAIL))
                slot = job.schedule.next_after(slot)
            continue
        if resumed is not None and resumed > floor:
            # Slots due after the newest record and before the pause were the job's own:
            # nobody ran them (the cluster was down), and they are recorded as missed. They
            # are not run after the resume: the job was paused after them.
            why = "not run after the job was paused and resumed"
            missed.extend(_missed_before_pause(job, floor, paused_from, catch_up.until, why, owner, instance_id))
            floor = resumed
        came_back = decided_by_catch_up.get(job.name)
        if (
            came_back is not None
            and floor == last.get(job.name)
            and slot_datetime(catch_up.until) <= came_back
            and job.schedule.next_after(floor) == catch_up.until
        ):
            claims.append(Claim(job, catch_up.until))
            continue
        limit = {"latest": 1, "all": CATCH_UP_LIMIT, "none": 0}[job.catch_up]
        # One slot more than we may run, so that the newest one not run is known.
        recent, count = job.schedule.slots_between(floor, catch_up.until, limit + 1)
        if count == 0:
            continue
        to_run = recent[-limit:] if limit else []
        not_run_slots = recent[: len(recent) - len(to_run)]
        not_run = count - len(to_run)
        # Every catch-up waits for the job to be free rather than be skipped: a run still on
        # record as running is one from before the outage (taken over, or about to be), and
        # the missed slot is owed a run after it, under "latest" as under "all".
        for slot in to_run:
            claims.append(Claim(job, slot, Reason.CATCH_UP, wait=True))
        if job.catch_up == "all" and count > CATCH_UP_LIMIT:
            later.append(
                functools.partial(
                    logger.warning,
                    "Job %r missed %d slots; catch_up='all' runs the newest %d and records the rest as missed",
                    job.name,
                    count,
                    CATCH_UP_LIMIT,
                    extra={"job": job.name, "missed": count},
                )
            )
        if not_run:
            newest_not_run = not_run_slots[-1]
            first = job.schedule.next_after(floor)
            detail = (
                f"{not_run} slot(s) missed from {_iso(first)} to {_iso(newest_not_run)} while no instance "
                f"ran them; catch_up={job.catch_up!r}"
            )
            missed.append(_missed(job.name, newest_not_run, not_run, detail, owner=owner, instance_id=instance_id))
    return claims, missed


def _missed_spans(job: Job, since: int) -> list[tuple[int, int]]:
    """The ranges of ``job``'s slots from ``since`` on that ``missed`` records account for: (first, last).

    A ``missed`` record is one row, at the newest of the slots it counts, for the
    ``count`` slots of the job up to it (its detail begins with the count: see
    :func:`_expand_catch_ups`); a record whose detail does not is its own slot only.
    """
    rows = _runs().filter(job=job.name, slot__gte=since, attempt=1, manual=False, status=Status.MISSED)
    spans = []
    for last, detail in rows.values_list("slot", "detail"):
        head = (detail or "").split(" ", 1)[0]
        covered, _ = job.schedule.slots_between(since - 1, last, int(head) if head.isdigit() else 1)
        if covered:
            spans.append((covered[0], last))
    return spans


def _in_last_pause(slot: int, state: statements.Locked) -> bool:
    """Whether ``slot`` fell in the job's last pause, which has ended (see :func:`_paused_then`)."""
    return _paused_then(slot, *_last_pause(_ms(state.paused_at), _ms(state.resumed_at)))


def _last_pause(paused_at: int | None, resumed_at: int | None) -> tuple[int | None, int | None]:
    """The job's last pause, from when it was paused until it was resumed (ms), for :func:`_paused_then`.

    With no pause time on record, or none before the resume, every slot before the resume counts
    as paused. With no resume on record, nothing does.
    """
    if resumed_at is None or (paused_at is not None and paused_at >= resumed_at):
        return None, resumed_at
    return paused_at, resumed_at


def _paused_then(slot: int, paused_from: int | None, resumed: int | None) -> bool:
    """Whether ``slot`` fell in the job's last pause (from ``paused_from``, or from ever, to ``resumed``)."""
    return resumed is not None and slot < resumed and (paused_from is None or slot >= paused_from)


def _missed_before_pause(
    job: Job, floor: int, paused_from: int | None, until: int, why: str, owner: str, instance_id: str
) -> list[_Missed]:
    """The ``missed`` record of the slots after ``floor``, up to ``until`` and before the pause, if any."""
    if paused_from is None or paused_from <= floor:
        return []
    before, count = job.schedule.slots_between(floor, min(paused_from - 1, until), 1)
    if not count:
        return []
    first = job.schedule.next_after(floor)
    detail = f"{count} slot(s) missed from {_iso(first)} to {_iso(before[-1])} while no instance ran them; {why}"
    return [_missed(job.name, before[-1], count, detail, owner=owner, instance_id=instance_id)]


def _ms(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp() * 1000)


def _missed(job: str, slot: int, count: int, detail: str, *, owner: str, instance_id: str) -> _Missed:
    """The ``missed`` record of ``count`` slots up to ``slot`` (not yet saved), with that count."""
    row = Run(
        job=job,
        slot=slot,
        attempt=1,
        status=Status.MISSED,
        reason=Reason.SCHEDULED,
        scheduled_at=slot_datetime(slot),
        instance_id=instance_id,
        owner=owner,
        created_at=DbNow(),
        finished_at=DbNow(),
        detail=detail,
    )
    return row, count


def _count_missed(missed: Sequence[_Missed]) -> None:
    """Add the slots the ``missed`` records count to their jobs' ``missed_count`` (one UPDATE per 400 jobs)."""
    per_job: dict[str, int] = defaultdict(int)
    for row, count in missed:
        per_job[row.job] += count
    statements.add_missed(per_job)
