"""Every database operation that decides who owns a run.

The rules, which every function below follows:

* **One winner per attempt.** A run attempt is the row (job, slot, attempt); the
  unique constraint on those three columns means at most one such row exists,
  and only the process whose token is in ``owner`` may run it.
* **Claims are serialised per job.** Every decision that depends on what else a
  job is doing (overlap, pause, catch-up) is made in one transaction that first
  locks the job's ``JobState`` row: ``SELECT ... FOR UPDATE`` ordered by name on
  PostgreSQL and MariaDB, an ``UPDATE`` on SQLite (which ignores
  ``select_for_update`` but takes its database write lock on the first write;
  starting with a write also keeps SQLite's busy timeout in force). Whoever
  holds the lock sees everything committed before it and decides alone.
* **A lease is live while ``lease_expires_at`` is ahead of the database clock**
  (:class:`DbNow`, never the local clock). Every write by the owner is a
  conditional UPDATE that requires the lease to be live and the status still
  ``running``; every takeover is a conditional UPDATE that requires it to have
  expired. Both lock the row, so exactly one of them wins; an expired lease is
  never revived.
* **Nothing is won until it is committed.** Callers learn what they won from
  the rows the claiming statement returned (``RETURNING``) or read back inside
  the transaction, once it has committed; a database error raises and wins
  nothing. On PostgreSQL the plain scheduled claim is one call of
  ``django_anarchon_claim()`` (migration 0003), which follows the same rules
  in one round trip (see :mod:`.sql`); on SQLite it is one ``INSERT ... SELECT``
  (``statements._claim_by_insert``), which holds the database's write lock
  from its start, as the job locks' UPDATE does; on MariaDB the same statement
  follows the job locks, in their transaction.
"""

from __future__ import annotations

from ..dbtime import DbNow, db_in
from ..slots import CatchUp, Claim
from .base import (
    CATCH_UP_LIMIT,
    NOTIFY_CHANNEL,
    Outcome,
    Poll,
    alias,
    notify,
    retry_cannot_fix,
    retry_deadlocks,
    slot_datetime,
    storable_text,
)
from .claims import decide
from .housekeeping import (
    Overdue,
    claim_overdue_alerts,
    close_undeclared,
    database_time,
    ensure_jobs,
    heartbeat,
    limit_idle_transactions,
    live_instances,
    namesakes,
    orphaned_holder,
    overdue_since,
    prune_batch,
    prune_instances,
    register_instance,
    unregister_instance,
)
from .leases import (
    finish,
    finish_enqueued,
    finish_many,
    hand_over,
    held_by,
    renew,
    save_progress,
    take_over,
)
from .pending import cancel_pending, claim_manual, claim_pending, create_manual, poll
from .statements import lock_jobs, newest_successes

__all__ = [
    "CATCH_UP_LIMIT",
    "NOTIFY_CHANNEL",
    "CatchUp",
    "Claim",
    "DbNow",
    "Outcome",
    "Overdue",
    "Poll",
    "alias",
    "cancel_pending",
    "claim_manual",
    "claim_overdue_alerts",
    "claim_pending",
    "close_undeclared",
    "create_manual",
    "database_time",
    "db_in",
    "decide",
    "ensure_jobs",
    "finish",
    "finish_enqueued",
    "finish_many",
    "hand_over",
    "held_by",
    "heartbeat",
    "limit_idle_transactions",
    "live_instances",
    "lock_jobs",
    "namesakes",
    "orphaned_holder",
    "newest_successes",
    "notify",
    "overdue_since",
    "poll",
    "prune_batch",
    "prune_instances",
    "register_instance",
    "renew",
    "retry_cannot_fix",
    "retry_deadlocks",
    "save_progress",
    "slot_datetime",
    "storable_text",
    "take_over",
    "unregister_instance",
]
