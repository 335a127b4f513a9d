"""The threads that run handlers: a reusable pool, the starter that releases runs at their slot.

Worker threads keep their database connections from one run to the next, as a
Django process keeps a connection between requests when ``CONN_MAX_AGE`` allows
it (see :func:`tidy_connections`): opening a connection per run was the largest
part of what a run cost the scheduler.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import connections
from django.db.backends.signals import connection_created

from .dbtrouble import drop_connection, errors_seen

if TYPE_CHECKING:
    from .runs import ActiveRun

logger = logging.getLogger("django_anarchon")
# The longest a run claimed ahead waits for its slot on one reading of the clock. The
# wall clock can be stepped at any time (NTP, an operator, a VM resumed); until the
# engine has measured the database clock again, a reading taken then is off by the
# step. A wait longer than this reads the clock again, so a run claimed ahead never
# waits out a whole step back.
CLOCK_RECHECK_S = 0.25
# With CONN_HEALTH_CHECKS, a worker's kept connections are checked before a run once the
# worker has been idle this long. A thread that ran a run a moment ago has just used them;
# checking them again is a round trip per run (a quarter of a millisecond of CPU each, on
# PostgreSQL, more than the rest of what a run costs the scheduler).
HEALTH_CHECK_IDLE_S = 1.0


# Per thread: the connection wrappers it has used, and whether it opened one since they were listed.
# Listing them (connections.all(initialized_only=True)) goes through asgiref's Local for every
# database and cost more than the rest of a trivial run's tidying; they change only when the
# thread connects somewhere, which Django announces (connection_created) on that same thread.
_opened = threading.local()


def _connection_opened(sender: object, connection: object, **kwargs: object) -> None:
    _opened.new = True


connection_created.connect(_connection_opened, dispatch_uid="django_anarchon.workers.connection_opened")


def tidy_connections() -> None:
    """After a run, on its worker thread: keep the connections a next run can use, close the others.

    Closed: one the handler left inside a transaction (``atomic()`` not exited,
    autocommit switched off: closing rolls it back), one that raised an error
    and no longer answers, one older than a positive ``CONN_MAX_AGE``. Kept:
    every other, whatever ``CONN_MAX_AGE`` says when it is ``0`` (Django's
    default, meant for a connection per request): a scheduler has at most
    ``MAX_WORKERS`` worker threads, each keeping one connection per database
    for as long as it lives (threads idle for a minute leave, and close theirs).
    With ``CONN_HEALTH_CHECKS``, see :func:`check_kept_connections`.
    """
    if getattr(_opened, "new", True):  # this thread's first run, or it opened a connection since the last
        _opened.new = False
        _opened.wrappers = connections.all(initialized_only=True)
    _opened.idle_since = time.monotonic()
    for connection in _opened.wrappers:
        if connection.connection is None:
            continue
        try:
            # .autocommit, not get_autocommit(): connected already, and get_autocommit() asks
            # asyncio whether a loop runs on this thread, the larger part of tidying a run.
            if connection.in_atomic_block or connection.autocommit != connection.settings_dict["AUTOCOMMIT"]:
                connection.close()
                continue
            if connection.errors_occurred:
                if not connection.is_usable():
                    connection.close()
                    continue
                connection.errors_occurred = False
            max_age = connection.settings_dict.get("CONN_MAX_AGE") or 0
            if max_age and connection.close_at is not None and time.monotonic() >= connection.close_at:
                connection.close()
                continue
        except Exception:  # a connection that cannot even say its state is not worth keeping
            drop_connection(connection)


def check_kept_connections() -> None:
    """Before a run, on its worker thread: drop connections an outage may have killed; check idle ones.

    When the scheduler's own threads have met a database error since this
    worker's last run (a restart, a failover, a network cut), the connections
    it kept are closed: they most likely died with the same outage, and the
    run's first query would fail on them. The next query connects afresh.

    Otherwise, where ``CONN_HEALTH_CHECKS`` is on and the worker has been idle
    ``HEALTH_CHECK_IDLE_S`` or more, the run's first query on each kept
    connection pings it first (and reconnects if it died), as Django does at
    the start of a request; a worker that ran something less than
    ``HEALTH_CHECK_IDLE_S`` ago uses its connections as they are.
    """
    errors = errors_seen()
    seen = getattr(_opened, "errors_seen", errors)
    _opened.errors_seen = errors
    idle_since = getattr(_opened, "idle_since", None)
    if idle_since is None:
        return  # this thread's first run: it has kept nothing yet
    if errors != seen:
        for connection in _opened.wrappers:
            if connection.connection is not None:
                drop_connection(connection)
        return
    if time.monotonic() - idle_since < HEALTH_CHECK_IDLE_S:
        return
    for connection in _opened.wrappers:
        if connection.connection is not None:
            connection.health_check_done = False  # type: ignore[attr-defined]


class Workers:
    """Daemon threads that run tasks: idle ones wait for work, a new one starts when none is idle.

    Reusing threads keeps the start of a run to a queue hand-off; the runner
    caps how many tasks run at once (``MAX_WORKERS``). A handler that ignores
    its signal past a timeout keeps its thread; the pool simply starts another,
    and being daemons, such threads never hold up exit. Threads idle for a
    minute leave, and close their database connections.
    """

    IDLE_EXIT = 60.0

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[ActiveRun], None], ActiveRun] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # One token per idle thread not yet taken by a task. deque.append() and
        # pop() are atomic: a hundred runs released at once do not queue on a lock.
        self._idle: collections.deque[None] = collections.deque()
        self._count = itertools.count(1)
        self.started = 0  # how many threads were started

    @property
    def idle(self) -> int:
        """How many threads wait for a task."""
        return len(self._idle)

    def submit(self, active: ActiveRun, work: Callable[[ActiveRun], None]) -> None:
        """Have an idle thread, or a new one, call ``work(active)``.

        Raises (and queues nothing) if a new thread is needed and cannot be
        started: a task queued without a thread for it would be run later by
        whichever thread frees up, after the caller had given the run to another.
        """
        try:
            self._idle.pop()
        except IndexError:
            thread = threading.Thread(target=self._serve, name=f"anarchon-worker-{next(self._count)}", daemon=True)
            thread.start()
            self.started += 1
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        self._tasks.put((work, active))

    def close(self, timeout: float = 0.0) -> None:
        """Let every thread leave once it is done with its task, closing its connections (the scheduler stops).

        Waits up to ``timeout`` seconds in all for them to be gone: a thread still in a
        handler that ignored its signal is left behind (it is a daemon).
        """
        threads = [t for t in self._threads if t.is_alive()]
        for _ in threads:
            self._tasks.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _serve(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=self.IDLE_EXIT)
            except queue.Empty:
                try:
                    self._idle.pop()
                except IndexError:
                    continue  # taken by a task on its way
                connections.close_all()  # this thread's own, kept between runs
                return  # nobody needs this thread: leave
            if task is None:
                connections.close_all()
                return
            work, active = task
            try:
                work(active)
            finally:
                self._idle.append(None)


class Starter:
    """One thread that hands runs claimed ahead of their slot to the workers when the slot comes.

    Runs due at the same instant are released together, in one go, so the
    first free worker starts them back to back. A worker per run sleeping
    until the slot would have every one of those threads wake at the same
    instant and queue for the GIL, and a hundred simultaneous runs started
    many times slower (docs/performance.md). A run whose signal aborts first
    (stop, a lost lease) is released at once, to be ended by its worker. A run
    whose ``pause_check_pending`` is set is held past its slot until it is
    cleared and :meth:`wake` called (the loop reads its job's pause first).

    The same thread looks after released runs still waiting for a worker
    (``stalled``: called once :meth:`watch` asks, it returns the seconds until
    it wants to be called again, or None). The thread exists while runs wait,
    and ``LINGER_S`` longer.
    """

    # How long the thread stays once nothing waits, for the runs of the next instant.
    LINGER_S = 2.0

    def __init__(
        self,
        now_ms: Callable[[], float],
        release: Callable[[ActiveRun], None],
        stalled: Callable[[], float | None] | None = None,
    ) -> None:
        self._now_ms = now_ms
        self._release = release
        self._stalled = stalled
        self._watching = False
        self._waiting: list[tuple[int, int, ActiveRun]] = []  # a heap by slot
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, active: ActiveRun) -> None:
        self.add_many([active])

    def add_many(self, actives: list[ActiveRun]) -> None:
        """Release each of ``actives`` at its slot (or at once, should its signal abort first)."""
        entries = [(active.run.slot, next(self._order), active) for active in actives]
        with self._changed:
            # Only a run due sooner than every waiting one changes when the thread must wake:
            # waking it for each of a hundred runs of one instant took the GIL a hundred times.
            soonest = min(entry[0] for entry in entries)
            sooner = not self._waiting or soonest < self._waiting[0][0]
            self._waiting.extend(entries)
            heapq.heapify(self._waiting)
            self._ensure_thread()
            if sooner:
                self._changed.notify()
        for active in actives:
            active.signal.on_abort(self.wake)

    def watch(self) -> None:
        """Call ``stalled`` soon, and again when it says, until it returns None."""
        with self._changed:
            self._watching = True
            self._ensure_thread()
            self._changed.notify()

    def close(self, timeout: float) -> None:
        """Have the thread leave as soon as nothing waits (the scheduler stops), and wait for it at most ``timeout`` s.

        Without this, a stopped scheduler's thread lingered ``LINGER_S``. Runs still waiting were
        aborted by the stop, and are released (to be ended by their workers) first.
        """
        with self._changed:
            self._closed = True
            thread = self._thread
            self._changed.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="anarchon-starter", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the starter's thread exists (it does while runs wait)."""
        return self._thread is not None

    def wake(self) -> None:
        """Look at the clock and the waiting runs again now."""
        with self._changed:
            self._changed.notify()

    def _look_after(self) -> float | None:
        """Call ``stalled`` if asked to; the seconds until it wants to be called again (None: not watching)."""
        with self._changed:
            if not self._watching:
                return None
            self._watching = False  # a watch() asked for while stalled() runs sets it again
        again = None
        if self._stalled is not None:
            try:
                again = self._stalled()
            except Exception:  # the runs waiting are still taken by the workers that free up
                logger.exception("Internal error while looking after runs waiting for a worker")
        if again is not None:
            with self._changed:
                self._watching = True
        return again

    def _serve(self) -> None:
        idle_since: float | None = None  # monotonic time nothing was left to wait for
        while True:
            again = self._look_after()
            with self._changed:
                while True:
                    now = self._now_ms()
                    due: list[tuple[int, int, ActiveRun]] = []
                    later: list[tuple[int, int, ActiveRun]] = []
                    held: list[tuple[int, int, ActiveRun]] = []  # its slot has come, its pause not yet read
                    for entry in self._waiting:
                        active = entry[2]
                        if active.signal.aborted:
                            due.append(entry)
                        elif entry[0] > now:
                            later.append(entry)
                        else:
                            (held if active.pause_check_pending else due).append(entry)
                    if due:
                        self._waiting = later + held
                        heapq.heapify(self._waiting)
                        idle_since = None
                        break
                    if not self._waiting and not self._watching:
                        # Jobs due every second would otherwise start a thread every second.
                        idle_since = time.monotonic() if idle_since is None else idle_since
                        left = idle_since + self.LINGER_S - time.monotonic()
                        if left <= 0 or self._closed:
                            self._thread = None
                            return
                        self._changed.wait(left)
                        continue
                    idle_since = None
                    if self._watching and again is None:
                        break  # asked to watch since the last look: look now
                    timeout = CLOCK_RECHECK_S
                    if later:  # runs held for their pause's look wait for wake()
                        timeout = min(timeout, (min(later)[0] - now) / 1000)
                    if self._watching and again is not None:
                        timeout = min(timeout, again)
                    self._changed.wait(max(timeout, 0.0))
                    if self._watching:
                        break  # look after the waiting runs again, then at the slots
            for _, _, active in sorted(due, key=lambda entry: entry[:2]):
                try:
                    self._release(active)
                except Exception:  # a run that cannot be handed on must not stop the others
                    logger.exception("Internal error while starting %r", active.run.job, extra={"job": active.run.job})


__all__ = ["CLOCK_RECHECK_S", "HEALTH_CHECK_IDLE_S", "Starter", "Workers", "check_kept_connections", "tidy_connections"]
