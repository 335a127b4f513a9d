"""The NOTIFY listener: wakes the loop when notified, only then, and survives a lost connection."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from django_anarchon import store
from django_anarchon.listener import Listener, listening_available

pytestmark = pytest.mark.django_db(transaction=True)


def wait_for(event: threading.Event, timeout: float = 3.0) -> bool:
    return event.wait(timeout)


def test_the_listener_wakes_on_notify_stays_quiet_and_reconnects() -> None:
    if connection.vendor != "postgresql":
        # Elsewhere instances poll: nothing listens, and the engine starts no listener thread.
        assert not listening_available("test")
        return
    assert listening_available("test")
    woken = threading.Event()
    calls: list[float] = []

    def notified() -> None:
        calls.append(time.monotonic())
        woken.set()

    stopping = threading.Event()
    listener = Listener(notified, stopping, "test")
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    try:
        assert wait_for(woken), "the listener calls back once it listens (for what came before)"
        woken.clear()
        # Quiet while nothing is notified: waking up to look for one calls nobody.
        time.sleep(1.2)
        assert not woken.is_set(), calls
        store.notify("hello")
        assert wait_for(woken), "a NOTIFY reaches the listener"
        woken.clear()
        # The server drops the listening connection: the listener connects again and listens on.
        # Only this test database's: CI runs the PostgreSQL environments side by side on one
        # server, and ending another run's listener would wake it in its own quiet second.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query LIKE %s AND pid <> pg_backend_pid() AND datname = current_database()",
                [f"LISTEN {store.NOTIFY_CHANNEL}%"],
            )
            assert cursor.fetchone() is not None
        assert wait_for(woken, 5.0), "after reconnecting, the listener calls back (it may have missed a NOTIFY)"
        woken.clear()
        time.sleep(0.2)
        store.notify("again")
        assert wait_for(woken), "a NOTIFY after the reconnect reaches the listener"
    finally:
        stopping.set()
        thread.join(2.0)
    assert not thread.is_alive(), "the listener leaves within its wait once stopping is set"
