"""PostgreSQL LISTEN/NOTIFY: wake the loop at once when a manual run or a hand-over waits.

Elsewhere, and with psycopg older than 3.2, instances find pending runs by polling
every ``POLL_INTERVAL``.
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Callable

from django.db import connections

from . import store
from .dbtrouble import DbTrouble

logger = logging.getLogger("django_anarchon")


def listening_available(instance_id: str) -> bool:
    """Whether this database and driver can wake instances with NOTIFY."""
    connection = connections[store.alias()]
    if connection.vendor != "postgresql":
        return False
    try:
        import psycopg

        version = tuple(int(p) for p in psycopg.__version__.split(".")[:2])
    except Exception:
        version = (0, 0)
    if version < (3, 2):
        logger.info(
            "LISTEN/NOTIFY needs psycopg 3.2 or newer; manual runs are picked up by polling",
            extra={"instance": instance_id},
        )
        return False
    return True


class Listener:
    """A thread that waits on NOTIFY on a connection of its own and calls ``notified``."""

    def __init__(self, notified: Callable[[], None], stopping: threading.Event, instance_id: str) -> None:
        self.notified = notified
        self.stopping = stopping
        self.trouble = DbTrouble("the LISTEN connection", instance_id, store.alias)

    def run(self) -> None:
        while not self.stopping.is_set():
            wrapper = connections.create_connection(store.alias())
            try:
                wrapper.ensure_connection()
                raw = wrapper.connection
                raw.autocommit = True
                raw.execute(f"LISTEN {store.NOTIFY_CHANNEL}")
                self.trouble.end_turn()
                self.notified()  # whatever was notified while we were not listening
                while not self.stopping.is_set():
                    # Wait on the socket here, then let psycopg read what came: its own
                    # notifies(timeout=...) wakes ten times a second to look for Ctrl-C,
                    # which was most of what an idle instance cost.
                    readable, _, _ = select.select([raw.fileno()], [], [], 0.5)
                    if readable and list(raw.notifies(timeout=0)):
                        self.notified()
            except Exception as error:
                self.trouble.failed(error)
                self.trouble.end_turn()
                self.stopping.wait(max(self.trouble.backoff, 0.5))
            finally:
                try:
                    wrapper.close()
                except Exception:
                    logger.debug("Closing the listener connection failed", exc_info=True)
