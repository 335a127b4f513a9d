"""One closed-loop claiming client of the claim-throughput benchmark (see bench/scenarios/claims.py).

``--mode decide``: the engine's own claim path. Walks the same sequence of (job, slot)
batches as every other client, so that all clients race for every slot: for each batch it
runs :func:`django_anarchon.store.decide` the way the scheduler loop does (with
``skip_locked`` where the engine has it; jobs another client holds are tried again
``BUSY_RETRY_MS`` later while the client goes on with the next slots, as the loop does).
With ``--finish``, each batch's won runs are then recorded as ended
(:func:`django_anarchon.store.finish_many`, what the recorder does when handlers return).
Every claim decided is one decision: won, or lost to the client that got there first.
``--mode setup`` creates the job rows first, once, as an instance does when it starts.

With ``--share-out N --index I`` the client claims as an instance of an N-instance cluster
does (the engine's ``share_ranks`` and ``share_index``, which ``ShareOut.preferred`` uses): of
each batch it first claims the slots dealt to it, and the rest ``SHARE_LAG`` batches later (the engine's
backup look just before the slot), when their own client has usually decided them and the
look finds them taken. The batches are the clients' common clock, as the wall clock is the
instances': a client waits before a new batch while it is more than ``DRIFT`` batches ahead of
the slowest one (:class:`_Progress`). Without that, the clients drifted apart by more than
``SHARE_LAG`` (eight processes on two cores; the ones that won the most slots fell behind), and
the fastest claimed most of the others' shares. As the
engine takes the backup looks due within ``BACKUP_WINDOW_MS`` of one another in one
statement, the client takes with each backup look those due within the same share of
``SHARE_LAG`` (:func:`_look_window`), with room for all of them (an instance with free
workers). ``backup_won`` counts the slots a backup look won: their own client had not
claimed them by then.

``--mode insert``: the reference, a one-row INSERT with a primary-key conflict check on a
random key, one transaction each, through the same Django connection.

Both modes print their counts as JSON, with ``cpu_ms``: the client's own CPU time while it
measured.
"""

from __future__ import annotations

import collections
import inspect
import json
import mmap
import random
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DatabaseError, connection

from django_anarchon import Scheduler, engine, store

try:
    from django_anarchon import slots as sharing
except ImportError:  # engines from before the core was reshaped kept the share-out in engine.py
    sharing = engine  # type: ignore[assignment]

# With --share-out: how many batches later a client looks at the slots dealt to other clients.
SHARE_LAG = 50
# With --share-out: how many batches a client may be ahead of the slowest one (see _Progress).
DRIFT = 20


def _look_window() -> int:
    """How many batches after a backup look's own the looks taken with it may be due.

    ``SHARE_LAG`` stands for the engine's least gap from a first pass to the backup look
    (the least first lead, ``BACKUP_AHEAD_MS + BACKUP_WINDOW_MS + 40``, less the backup
    lead); the window is the same share of it: 16 batches. Engines without it: 0.
    """
    window_ms = getattr(sharing, "BACKUP_WINDOW_MS", 0)
    return SHARE_LAG * window_ms // (window_ms + 40)


class _Progress:
    """Each share-out client's batch count, in a file all of them map: their common clock."""

    def __init__(self, path: str, count: int, index: int) -> None:
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 8 * count)
        self._counts = memoryview(self._map).cast("q")
        self._index = index

    def publish(self, k: int) -> None:
        self._counts[self._index] = k

    def slowest(self) -> int:
        return min(self._counts)


def _noop(ctx: Any) -> None:
    """Never called: the clients claim, they run nothing."""


class Command(BaseCommand):
    help = "A closed-loop claiming client for the claim-throughput benchmark."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--mode", choices=["setup", "decide", "insert"], required=True)
        parser.add_argument("--batch", type=int, default=1, help="claims per transaction (slots due at once)")
        parser.add_argument("--jobs", type=int, default=1000)
        parser.add_argument("--base", type=int, required=True, help="first slot (ms); the same for every client")
        parser.add_argument(
            "--start-at",
            type=float,
            default=None,
            help="time.time() to start at; without it, print 'ready' once set up and read it from stdin",
        )
        parser.add_argument("--seconds", type=float, required=True)
        parser.add_argument("--finish", action="store_true", help="also record each won run as ended (success)")
        parser.add_argument("--share-out", type=int, default=0, help="claim as one of this many instances")
        parser.add_argument("--index", type=int, default=0, help="with --share-out: which one (0-based)")
        parser.add_argument(
            "--progress-file", default=None, help="with --share-out: 8 bytes per client, zeroed (see _Progress)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        measure = self._insert if options["mode"] == "insert" else self._decide
        counts = measure(options)
        self.stdout.write(json.dumps(counts))

    @staticmethod
    def _share(jobs: list[Any], count: int, index: int) -> Callable[[str, int], bool] | None:
        """Whether this client, as instance ``index`` of ``count``, claims a slot first (None: no share-out).

        The engine's own functions; engines from before the share-out have none and raced for
        every slot, and those that hashed each (job, slot) had no ``share_ranks``.
        """
        share_index = getattr(sharing, "share_index", None)
        if count < 2 or share_index is None:
            return None
        share_ranks = getattr(sharing, "share_ranks", None)
        if share_ranks is None:
            return lambda name, slot: share_index(name, slot, count) == index
        ranks = share_ranks(job.name for job in jobs)
        return lambda name, slot: share_index(ranks[name], slot, count) == index

    def _wait(self, options: dict[str, Any]) -> tuple[float, int]:
        """Connect, wait for the start; return the deadline and how late this client starts (ms, should be 0).

        Without ``--start-at`` the start is a barrier: say "ready" on stdout, then read the
        start time from stdin (the parent sends it once every client is ready).
        """
        connection.ensure_connection()
        start_at = options["start_at"]
        if start_at is None:
            sys.stdout.write("ready\n")
            sys.stdout.flush()
            start_at = float(sys.stdin.readline())
        time.sleep(max(0.0, start_at - time.time()))
        return start_at + options["seconds"], round(max(0.0, time.time() - start_at) * 1000)

    def _decide(self, options: dict[str, Any]) -> dict[str, Any]:
        scheduler = Scheduler()
        for i in range(options["jobs"]):
            scheduler.every(f"claim-{i:05d}", "1s", _noop)
        jobs, batch, base = scheduler.jobs, options["batch"], options["base"]
        if options["mode"] == "setup":
            store.ensure_jobs(jobs)  # as an instance does when it starts: the job rows exist before any claim
            return {"jobs": len(jobs)}
        owner = uuid.uuid4().hex
        # What the loop passes (engines before skip_locked simply wait for the lock).
        extra: dict[str, Any] = {}
        if "skip_locked" in inspect.signature(store.decide).parameters:
            extra["skip_locked"] = True
        retry_s = getattr(engine, "BUSY_RETRY_MS", 5) / 1000
        finish_many = getattr(store, "finish_many", None)
        counts = {"decisions": 0, "won": 0, "skipped": 0, "deferred": 0, "busy": 0, "transactions": 0, "errors": 0}
        counts.update(backup_won=0, drift_waits=0)
        deadline, counts["late_start_ms"] = self._wait(options)
        cpu_started = time.process_time()
        k = 0
        retries: collections.deque[tuple[float, list[store.Claim]]] = collections.deque()
        others: collections.deque[tuple[int, list[store.Claim]]] = collections.deque()  # (due batch, claims)
        share_out, index = options["share_out"], options["index"]
        mine_first = self._share(jobs, share_out, index)
        look_window = _look_window()
        progress = None
        if mine_first is not None and options["progress_file"]:
            progress = _Progress(options["progress_file"], share_out, index)
        while (now := time.time()) < deadline:
            looking = False
            if retries and retries[0][0] <= now:
                claims = retries.popleft()[1]
            elif others and others[0][0] <= k:
                claims = others.popleft()[1]
                while others and others[0][0] <= k + look_window:
                    claims.extend(others.popleft()[1])
                looking = True
            elif progress is not None and k - progress.slowest() > DRIFT:
                counts["drift_waits"] += 1
                time.sleep(0.0002)  # the others' clock is behind: let them catch up
                continue
            else:
                first = k * batch
                slot = base + (first // len(jobs)) * 1000
                start = first % len(jobs)
                claims = [store.Claim(job, slot) for job in jobs[start : start + batch]]
                k += 1
                if progress is not None:
                    progress.publish(k)
                if mine_first is not None:
                    mine: list[store.Claim] = []
                    rest: list[store.Claim] = []
                    for claim in claims:
                        (mine if mine_first(claim.job.name, claim.slot) else rest).append(claim)
                    if rest:
                        others.append((k + SHARE_LAG, rest))
                    if not mine:
                        continue
                    claims = mine
            try:
                capacity = max(batch, len(claims))
                outcome = store.decide(claims, owner=owner, instance_id=owner[:8], ttl=30, capacity=capacity, **extra)
                if options["finish"] and outcome.won:
                    if finish_many is not None:  # what the recorder does for runs that succeeded
                        finish_many([run.id for run in outcome.won], owner=owner)
                    else:
                        for run in outcome.won:
                            store.finish(run.id, owner=owner, status="success")
            except DatabaseError as error:  # SQLite: "database is locked" past the busy timeout; the engine retries too
                counts["errors"] += 1
                if counts["errors"] == 1:
                    self.stderr.write(f"first error: {error!r}")
                connection.close()
                retries.append((time.time() + retry_s, claims))
                continue
            busy = set(getattr(outcome, "busy", ()))
            counts["transactions"] += 1 + (1 if options["finish"] and outcome.won else 0)
            counts["decisions"] += len(claims) - len(outcome.deferred) - len(busy)
            counts["won"] += len(outcome.won)
            if looking:
                counts["backup_won"] += len(outcome.won)
            counts["skipped"] += len(outcome.skipped)
            counts["deferred"] += len(outcome.deferred)
            counts["busy"] += len(busy)
            again = [c for c in claims if c.job.name in busy]
            if again:
                # As the loop does: another instance is deciding these right now; try
                # them again a little later and go on with the next slots meanwhile.
                retries.append((time.time() + retry_s, again))
        counts["lost"] = counts["decisions"] - counts["won"] - counts["skipped"]
        counts["cpu_ms"] = round((time.process_time() - cpu_started) * 1000)
        return counts

    def _insert(self, options: dict[str, Any]) -> dict[str, Any]:
        if connection.vendor == "mysql":
            sql = "INSERT IGNORE INTO benchapp_claimref (k) VALUES (%s)"
        else:
            sql = "INSERT INTO benchapp_claimref (k) VALUES (%s) ON CONFLICT (k) DO NOTHING"
        counts = {"decisions": 0, "won": 0, "transactions": 0, "errors": 0}
        deadline, counts["late_start_ms"] = self._wait(options)
        rng = random.Random()
        cpu_started = time.process_time()
        with connection.cursor() as cursor:
            while time.time() < deadline:
                try:
                    cursor.execute(sql, [rng.randrange(1, 2**62)])  # autocommit: one transaction
                except DatabaseError:
                    counts["errors"] += 1
                    continue
                counts["decisions"] += 1
                counts["won"] += cursor.rowcount
                counts["transactions"] += 1
        counts["cpu_ms"] = round((time.process_time() - cpu_started) * 1000)
        return counts
