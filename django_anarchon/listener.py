"""PostgreSQL LISTEN/NOTIFY: wake the loop at once when a manual run or a hand-over waits.

Elsewhere, and with psycopg older than 3.2, instances find pending runs by polling
every ``POLL_INTERVAL``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from django.db import connections

from . import store

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger("django_anarchon")


class Listener:
    """A thread of an :class:`Engine` that waits on NOTIFY on its own connection."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def available(self) -> bool:
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
                extra={"instance": self.engine.instance_id},
            )
            return False
        return True

    def run(self) -> None:
        delay = 0.5
        while not self.engine.stopping:
            wrapper = connections.create_connection(store.alias())
            try:
                wrapper.ensure_connection()
                raw = wrapper.connection
                raw.autocommit = True
                raw.execute(f"LISTEN {store.NOTIFY_CHANNEL}")
                self.engine.request_poll()  # whatever was notified while we were not listening
                delay = 0.5
                while not self.engine.stopping:
                    for _ in raw.notifies(timeout=0.5, stop_after=1):
                        self.engine.request_poll()
            except Exception as error:
                logger.debug("Listener connection failed (%s); retrying", error)
                self.engine.wait_stopping(delay)
                delay = min(delay * 2, 5.0)
            finally:
                try:
                    wrapper.close()
                except Exception:
                    logger.debug("Closing the listener connection failed", exc_info=True)
