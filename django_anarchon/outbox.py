"""Signals sent on a thread of their own, so the project's receivers never hold up the loop.

The loop decides slots and takeovers; what it learns (a slot skipped, a run
replaced or taken over, a run given up) is announced through :class:`Outbox`,
whose thread calls the receivers in order. A receiver that writes a row or
sends a mail then delays other receivers, never a claim. So do the ends of the
runs this instance executes (``run_succeeded``, ``run_failed``, a hand-over's
``run_interrupted``), once recorded; only ``run_started`` and ``run_taken_over``
are sent from the run's own worker thread, just before its handler.
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
        """Send what is queued (for at most ``timeout`` seconds), then end the thread.

        What is still queued then (receivers slower than the time left) is not
        sent, and a warning names it: a failure alert must not vanish unsaid.
        """
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout)
        if not thread.is_alive():
            return
        left: list[str] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                left.append(_describe(*item))
        self._queue.put(None)  # the thread leaves after the receiver it is in, if the process lives on
        logger.warning(
            "Stopped with %d signal(s) not sent (their receivers had %.1fs, and one was still running): %s",
            len(left),
            timeout,
            "; ".join(left) or "none queued",
        )

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


def _describe(signal: Signal, kwargs: dict[str, Any]) -> str:
    """``run_failed nightly slot=… attempt=…``: which signal, about what."""
    name = next((n for n, value in vars(signals).items() if value is signal), "signal")
    run = kwargs.get("run")
    if run is not None:
        return f"{name} {run.job} slot={run.slot} attempt={run.attempt}"
    return f"{name} {kwargs.get('job', '')}".rstrip()
