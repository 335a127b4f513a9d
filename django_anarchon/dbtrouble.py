"""What every scheduler thread does when the database fails it: reset the connection, log once, back off.

The loop, the lease keeper, the recorder and the listener each have one
:class:`DbTrouble`. An outage is logged once per instance (:class:`_Outage`), when
the first of its threads meets it and when one gets through after its latest error
(see ``STALE_S``), never per retry or per thread; the
back-off doubles from 0.1 s, with jitter, up to two seconds (a slot a second is
the common case: the loop is claiming again within about two seconds of the
database's return, and one query every two seconds per thread and instance is
no load on a server that is starting).
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from django.db import DatabaseError, connections

T = TypeVar("T")
logger = logging.getLogger("django_anarchon")


class _Failed:
    def __repr__(self) -> str:
        return "<FAILED>"


# What DbTrouble.call() returns when the call raised a database error.
FAILED: Any = _Failed()
MAX_BACKOFF_S = 2.0
# A call that took this long is logged: a database that stops answering without refusing (a frozen
# server, a network that drops packets) raises nothing, and the log said nothing of it otherwise.
SLOW_CALL_S = 5.0


# How many database errors the scheduler's own threads have met in this process. A
# worker keeps its connections between runs; when this has changed since its last run,
# they may have died with the same outage, and it opens new ones (workers.py).
_errors_seen = 0


def errors_seen() -> int:
    """The number of database errors the scheduler's threads have met so far (it only grows)."""
    return _errors_seen


def reset_connection(alias: str) -> None:
    """Drop this thread's connection to ``alias`` so that the next query reconnects."""
    drop_connection(connections[alias])


def socket_of(connection: Any) -> int | None:
    """The descriptor of the socket under ``connection`` (this thread's Django wrapper); None on SQLite.

    The connection is opened if need be. Read before a statement that :func:`break_off` may have to
    break off: a MySQL connection refuses to be asked anything, its descriptor included, while
    another thread's statement runs on it.
    """
    if connection.vendor == "sqlite":
        return None
    connection.ensure_connection()
    fileno = getattr(connection.connection, "fileno", None)
    try:
        descriptor = fileno() if fileno is not None else -1
    except Exception:
        return None
    return descriptor if isinstance(descriptor, int) and descriptor >= 0 else None


def break_off(descriptor: int) -> None:
    """Make a statement waiting on the connection whose socket is ``descriptor`` fail at once.

    The socket is shut down, through a duplicate of the descriptor (the driver keeps its own): the
    waiting call finds the server gone and raises ``OperationalError``, and its thread drops the
    connection (:func:`reset_connection`). A statement sent to a server that stopped answering (a
    network that drops packets) would otherwise wait until it answers, however long. SQLite has no
    socket, and its waits (for another connection's lock) are bounded by :func:`sqlite_wait`.
    Best effort: a socket already closed is left as it is.
    """
    try:
        with socket.fromfd(descriptor, socket.AF_INET, socket.SOCK_STREAM) as duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed meanwhile: nothing waits on it then


@contextlib.contextmanager
def sqlite_wait(connection: Any, seconds: float) -> Iterator[None]:
    """On SQLite, let statements on ``connection`` (this thread's Django wrapper) wait for a lock at most ``seconds``.

    SQLite waits for another connection's write lock in its busy handler, up to the busy timeout
    (``OPTIONS["timeout"]``), and nothing interrupts that wait: the timeout is lowered for the
    statements inside, then put back. Elsewhere, nothing changes.
    """
    if connection.vendor != "sqlite":
        yield
        return
    connection.ensure_connection()
    raw = connection.connection
    (kept,) = raw.execute("PRAGMA busy_timeout").fetchone()
    raw.execute(f"PRAGMA busy_timeout = {max(1, int(seconds * 1000))}")
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a connection that broke meanwhile is dropped by the caller
            raw.execute(f"PRAGMA busy_timeout = {int(kept)}")


def drop_connection(connection: Any) -> None:
    """Close ``connection`` (a Django wrapper); one that cannot close cleanly is let go (the next query reconnects)."""
    try:
        connection.close()
    except Exception:
        connection.connection = None


# A thread's first error within this long after an outage ended is most likely a connection that
# died with it (used again only now): logged as part of no new outage unless it goes on this long.
AFTERSHOCK_S = 10.0
# An outage has ended once a thread gets through after meeting its latest error, or once a thread
# gets through and no thread has met an error for this long (the one that met the latest may have
# gone idle: a keeper with no run left to renew asks nothing more).
STALE_S = 5.0


class _Outage:
    """One instance's outage as its log tells it: one line when it starts, one when it ends."""

    def __init__(self) -> None:
        self.since: float | None = None  # monotonic time the first thread met it
        self.loud = False  # its start was logged (WARNING): its end will be too
        self.ended_at: float | None = None
        self.last_error_at = 0.0  # monotonic time any thread last met it


_outages: dict[str, _Outage] = {}
# Every DbTrouble, for say_waiting(): a query that hangs raises nothing, and its own thread cannot log.
_troubles: weakref.WeakSet[DbTrouble] = weakref.WeakSet()
_troubles_lock = threading.Lock()


def say_waiting() -> None:
    """Log (once per call) each query of the scheduler's threads that has waited ``SLOW_CALL_S`` for an answer.

    Called by the watchdog's thread, which needs no query: a database that stops answering
    without refusing (a frozen server, a network that drops packets) is said while it lasts,
    not only once it answers.
    """
    now = time.monotonic()
    with _troubles_lock:
        troubles = list(_troubles)
    for trouble in troubles:
        trouble._say_waiting(now)


_outages_lock = threading.Lock()


def forget_outage(instance_id: str) -> None:
    """Start ``instance_id``'s outage log afresh (an engine of that name is starting)."""
    with _outages_lock:
        _outages.pop(instance_id, None)


class DbTrouble:
    """One thread's database-error policy: ``call`` store functions, ``end_turn`` after each turn."""

    def __init__(self, what: str, instance_id: str, alias: Callable[[], str]) -> None:
        self.what = what  # e.g. "the loop", "lease renewals": said in the log lines
        self.instance_id = instance_id
        self._alias = alias
        self.backoff = 0.0
        self.down_since: float | None = None
        self.last_error_at = 0.0  # monotonic time of its last database error
        self._failed_this_turn = False
        self._waiting_since: float | None = None  # monotonic time the call under way was sent
        self._said_waiting = False  # that call's wait was logged (see say_waiting)
        with _troubles_lock:
            _troubles.add(self)

    def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``function``; on a database error note it (see :meth:`failed`) and return ``FAILED``.

        A call that took ``SLOW_CALL_S`` or longer is logged (WARNING) once it returns.
        """
        with self.waiting():
            try:
                return function(*args, **kwargs)
            except DatabaseError as error:
                self.failed(error)
                return FAILED  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a query of this thread's: said while it waits ``SLOW_CALL_S`` (:func:`say_waiting`), and after."""
        sent = self._waiting_since = time.monotonic()
        try:
            yield
        finally:
            self._waiting_since, self._said_waiting = None, False
            took = time.monotonic() - sent
            if took >= SLOW_CALL_S:
                logger.warning(
                    "The database took %.1fs to answer %s on %s (a server that was frozen or overloaded, "
                    "or a network that dropped packets)",
                    took,
                    self.what,
                    self.instance_id,
                    extra={"instance": self.instance_id},
                )

    def _say_waiting(self, now: float) -> None:
        since = self._waiting_since
        if since is None or self._said_waiting or now - since < SLOW_CALL_S:
            return
        self._said_waiting = True
        logger.warning(
            "The database has not answered %s on %s for %.0fs (a server frozen or overloaded, or a network "
            "dropping packets); still waiting",
            self.what,
            self.instance_id,
            now - since,
            extra={"instance": self.instance_id},
        )

    def failed(self, error: BaseException) -> None:
        """A database error: drop the connection, and log it if it starts an outage."""
        global _errors_seen
        _errors_seen += 1
        reset_connection(self._alias())
        self._failed_this_turn = True
        now = time.monotonic()
        self.last_error_at = now
        if self.down_since is None:
            self.down_since = now
        with _outages_lock:
            outage = _outages.setdefault(self.instance_id, _Outage())
            outage.last_error_at = now
            if outage.since is None:
                outage.since = now
                outage.loud = outage.ended_at is None or now - outage.ended_at >= AFTERSHOCK_S
                say = outage.loud
            elif not outage.loud and now - outage.since >= AFTERSHOCK_S:
                outage.loud = say = True  # not an aftershock after all
            else:
                say = False
        logger.log(
            logging.WARNING if say else logging.DEBUG,
            "Database error on %s in %s (%s: %s); retrying with backoff",
            self.instance_id,
            self.what,
            type(error).__name__,
            error,
            extra={"instance": self.instance_id},
        )

    def end_turn(self) -> None:
        """A turn is over: back off further if it failed, else say the database is back (once)."""
        if self._failed_this_turn:
            self.backoff = min(max(0.1, self.backoff * 2), MAX_BACKOFF_S) * random.uniform(0.8, 1.2)  # noqa: S311
        else:
            self.down_since = None
            outage = _outages.get(self.instance_id)
            if outage is not None and outage.since is not None:
                self._recovered()
            self.backoff = 0.0
        self._failed_this_turn = False

    def _recovered(self) -> None:
        """This thread went a whole turn without an error: log the outage's end if it is over (see ``STALE_S``)."""
        now = time.monotonic()
        with _outages_lock:
            outage = _outages.get(self.instance_id)
            if outage is None or outage.since is None:
                return
            if outage.last_error_at > self.last_error_at and now - outage.last_error_at < STALE_S:
                return  # another thread met it after this one did, a moment ago: it may still be meeting it
            since, loud = outage.since, outage.loud
            outage.since, outage.loud, outage.ended_at = None, False, now
        logger.log(
            logging.WARNING if loud else logging.DEBUG,
            "Database is back on %s (seen by %s) after %.1fs",
            self.instance_id,
            self.what,
            now - since,
            extra={"instance": self.instance_id},
        )
