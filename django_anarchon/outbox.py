"""Signals sent on a thread of their own, so the project's receivers never hold up the loop.

The loop decides slots and takeovers; what it learns (a slot skipped, a run
replaced or taken over, a run given up) is announced through :class:`Outbox`,
whose thread calls the receivers in order. A receiver that writes a row or
sends a mail then delays other receivers, never a claim. Signals about a run
this instance executes (``run_started``, ``run_succeeded``, ``run_failed``) are
sent from the run's own worker thread, as before.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from django.db import connections
from django.dispatch import Signal

from . import signals
from .workers import check_kept_connections, tidy_connections

logger = logging.getLogger("django_anarchon")


class Outbox:
    """A queue of signals to send, and the thread that sends them (started on first use)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Signal, dict[str, Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __call__(self, signal: Signal, **kwargs: Any) -> None:
        """Send ``signal`` with ``kwargs`` from the outbox's thread."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="anarchon-signals", daemon=True)
                self._thread.start()
        self._queue.put((signal, kwargs))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then end the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                signal, kwargs = item
                try:
                    check_kept_connections()  # the receivers' connections, kept between signals
                    signals.send(signal, **kwargs)  # robust: a failing receiver is logged
                    tidy_connections()
                except Exception:  # pragma: no cover - signals.send() catches what receivers raise
                    logger.exception("Internal error while sending a signal")
        finally:
            connections.close_all()
