"""The abort signal handed to every handler as ``ctx.signal``.

Nothing can kill a Python thread from outside, so aborting is a request: the
signal records *why* (the first reason wins, later aborts are no-ops), wakes
whoever waits on it, and runs the callbacks handlers registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable

from .exceptions import Interrupted
from .latch import Latch

logger = logging.getLogger("django_anarchon")


class AbortSignal:
    """Tells a handler that its run should stop, and why."""

    def __init__(self) -> None:
        self._event = Latch()
        self._lock = threading.Lock()
        self._reason: BaseException | None = None
        self._callbacks: list[Callable[[], object]] = []

    def __repr__(self) -> str:
        return f"<AbortSignal aborted={self.aborted} reason={self._reason!r}>"

    @property
    def aborted(self) -> bool:
        """True once the run has been asked to stop."""
        return self._event.is_set()

    @property
    def reason(self) -> BaseException | None:
        """The exception that says why (``Interrupted`` or ``TimeoutError``), or None."""
        return self._reason

    def abort(self, reason: BaseException) -> bool:
        """Abort with ``reason``; return False if it had already aborted (idempotent)."""
        with self._lock:
            if self._event.is_set():
                return False
            self._reason = reason
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._call(callback)
        return True

    def throw_if_aborted(self) -> None:
        """Raise the reason if the signal has aborted; otherwise do nothing."""
        if self._event.is_set():
            raise self._why()

    def _why(self) -> BaseException:
        return self._reason if self._reason is not None else Interrupted("the run was aborted")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the signal aborts or ``timeout`` seconds pass; True if it aborted."""
        return self._event.wait(timeout)

    def on_abort(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback()`` when the signal aborts (at once if it already has).

        Use it to close a socket or cancel a request that would otherwise block.
        The callback runs in the thread that aborts the signal and must be quick.
        Returns a function that unregisters the callback.
        """
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)

                def remove() -> None:
                    with self._lock, contextlib.suppress(ValueError):
                        self._callbacks.remove(callback)

                return remove
        self._call(callback)
        return lambda: None

    @staticmethod
    def _call(callback: Callable[[], object]) -> None:
        try:
            callback()
        except Exception:
            logger.exception("An on_abort callback raised; the abort goes on", extra={"callback": repr(callback)})

    async def wait_async(self, timeout: float | None = None) -> bool:
        """The awaitable twin of :meth:`wait`."""
        if self.aborted:
            return True
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def settle() -> None:
            if not woken.done():
                woken.set_result(None)

        def wake() -> None:
            loop.call_soon_threadsafe(settle)

        remove = self.on_abort(wake)
        try:
            await asyncio.wait([woken], timeout=timeout)
        finally:
            remove()
            if not woken.done():
                woken.cancel()
        return self.aborted

    @contextlib.asynccontextmanager
    async def scope(self) -> AsyncIterator[AbortSignal]:
        """Cancel what the block awaits as soon as the signal aborts, then raise the reason.

        ``async with ctx.signal.scope(): await client.get(url)`` is the asyncio
        counterpart of passing a signal to an API that accepts one.
        """
        self.throw_if_aborted()
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - only outside a task
            raise RuntimeError("AbortSignal.scope() must be used inside an asyncio task")
        loop = asyncio.get_running_loop()
        state = {"active": True, "cancelled": False}

        def cancel_in_loop() -> None:
            if state["active"]:
                state["cancelled"] = True
                task.cancel()

        remove = self.on_abort(lambda: loop.call_soon_threadsafe(cancel_in_loop))
        try:
            yield self
        except asyncio.CancelledError:
            if state["cancelled"]:
                _uncancel(task)
                raise self._why() from None
            raise
        finally:
            state["active"] = False
            remove()
        if state["cancelled"]:
            # The abort came after the block's last await: undo our cancel
            # request and still report the abort.
            _uncancel(task)
            raise self._why()


def _uncancel(task: asyncio.Task[object]) -> None:
    """Withdraw our cancel request (Task.uncancel() is new in Python 3.11; 3.10 keeps no count)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()
