"""The signal thread: receivers run in order off the loop, on connections kept between signals."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.dispatch import Signal

from django_anarchon.dbtrouble import DbTrouble
from django_anarchon.outbox import Outbox
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_signal_thread_drops_its_kept_connection_once_the_scheduler_met_a_database_error() -> None:
    """A receiver (a failure alert writing a row) after a database restart must not fail on a dead connection."""
    signal = Signal()
    seen: list[Any] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        connection.ensure_connection()
        seen.append(connection.connection)

    def refused() -> None:
        raise OperationalError("server closed the connection unexpectedly")

    signal.connect(receiver, weak=False)
    outbox = Outbox()
    try:
        outbox(signal, n=1)
        outbox(signal, n=2)
        wait_for(lambda: len(seen) == 2, 10, what="two signals")
        loop = DbTrouble("the scheduler loop", "i1", lambda: "default")
        outside = threading.Thread(target=lambda: loop.call(refused))  # the loop meets an outage
        outside.start()
        outside.join(10)
        outbox(signal, n=3)
        outbox(signal, n=4)
        wait_for(lambda: len(seen) == 4, 10, what="two more signals")
    finally:
        outbox.close()
        signal.disconnect(receiver)
    assert seen[0] is seen[1], "kept between signals"
    assert seen[2] is not seen[1], "dropped after the scheduler's database error: the receiver connected afresh"
    assert seen[3] is seen[2]


def test_signals_left_unsent_when_the_outbox_closes_are_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A receiver slower than the time left on stopping: the alerts queued behind it are not lost unsaid."""
    from types import SimpleNamespace

    from django_anarchon import signals

    gate = threading.Event()
    seen: list[str] = []

    def slow(sender: Any, run: Any, **kwargs: Any) -> None:
        seen.append(run.job)
        gate.wait(10)  # a mail server that does not answer

    signals.run_failed.connect(slow, weak=False)
    outbox = Outbox()
    try:
        for job in ("first", "second", "third"):
            outbox(signals.run_failed, run=SimpleNamespace(job=job, slot=1000, attempt=1), exception=None)
        wait_for(lambda: seen == ["first"], 5, what="the first receiver call")
        outbox.close(0.2)
    finally:
        gate.set()
        signals.run_failed.disconnect(slow)
    [warning] = [r for r in caplog.records if "not sent" in r.getMessage()]
    message = warning.getMessage()
    assert "2 signal(s) not sent" in message
    assert "run_failed second slot=1000 attempt=1; run_failed third slot=1000 attempt=1" in message
