"""The context every handler receives as its one argument."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .signal import AbortSignal


@dataclass(frozen=True)
class Context:
    """What a handler knows about the run it is executing.

    ``slot`` is the idempotency key: it is the same on every instance and every
    attempt of the run.
    """

    name: str
    slot: int
    scheduled_at: datetime
    instance_id: str
    attempt: int
    reason: str
    manual: bool
    signal: AbortSignal
    data: Any
    progress: Any = None
    _save: Callable[[Any], None] | None = field(default=None, repr=False, compare=False)
    _recheck: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def sleep(self, seconds: float) -> None:
        """Sleep, but raise the signal's reason as soon as it aborts.

        Also raises on waking from a sleep that outlasted the run's lease (the
        process was frozen, the host suspended): the run may be another
        instance's by then, so the handler hears ``Interrupted`` before it does
        anything more, not at its next check.
        """
        if not self.signal.wait(seconds) and self._recheck is not None:
            self._recheck()
        self.signal.throw_if_aborted()

    async def asleep(self, seconds: float) -> None:
        """The asyncio twin of :meth:`sleep`."""
        if not await self.signal.wait_async(seconds) and self._recheck is not None:
            self._recheck()
        self.signal.throw_if_aborted()

    def save_progress(self, value: Any) -> None:
        """Store ``value`` (JSON) with the run for the next attempt; renews the lease.

        Raises the signal's reason if the run is no longer this instance's to
        write: ``Interrupted`` (its lease was lost), ``TimeoutError`` (it timed
        out); nothing is stored. After ``stop()`` it still saves,
        so a handler can leave its note on the way out. In an ``async def``
        handler it works too, but blocks the event loop for the write:
        :meth:`asave_progress` does not.
        """
        if self._save is None:
            raise RuntimeError("save_progress() is only available inside a run")
        if _event_loop_running():
            # Django refuses synchronous queries on a thread that runs an event
            # loop: write from a helper thread and wait for it.
            with ThreadPoolExecutor(1, thread_name_prefix="anarchon-progress") as pool:
                pool.submit(self._save, value).result()
        else:
            self._save(value)
        object.__setattr__(self, "progress", value)

    async def asave_progress(self, value: Any) -> None:
        """The asyncio twin of :meth:`save_progress` (runs the write in a thread)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.save_progress, value)


def make_context(**fields: Any) -> Context:
    """A :class:`Context` of every field, built without the frozen dataclass's ``__init__``.

    That ``__init__`` sets each field through ``object.__setattr__``, on every
    run. For the scheduler's own use: every field must be given (a test holds
    the runner to it).
    """
    ctx = object.__new__(Context)
    ctx.__dict__.update(fields)
    return ctx


def _event_loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
