"""The abort signal (``ctx.signal``) and the sleeping helpers of ``ctx``.

Aborts from "another thread" use ``threading.Timer`` with delays of a few hundredths of a second;
no test sleeps for more than a few tenths.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import FrozenInstanceError
from datetime import datetime, timezone
from typing import Any

import pytest

from django_anarchon import AbortSignal, Context, Interrupted

# How late an abort may be noticed, on a busy shared machine (it is a wake-up, not a poll).
PROMPT = 0.25


def abort_later(signal: AbortSignal, reason: BaseException, delay: float = 0.05) -> threading.Timer:
    """Abort ``signal`` from another thread after ``delay`` seconds; the timer records when it fired."""

    def fire() -> None:
        timer.fired_at = time.monotonic()  # type: ignore[attr-defined]
        signal.abort(reason)

    timer = threading.Timer(delay, fire)
    timer.daemon = True
    timer.start()
    return timer


def make_context(signal: AbortSignal | None = None, save: Callable[[Any], None] | None = None) -> Context:
    return Context(
        name="job",
        slot=1_700_000_000_000,
        scheduled_at=datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc),
        instance_id="test-instance",
        attempt=1,
        reason="scheduled",
        manual=False,
        signal=signal or AbortSignal(),
        data={"ville": "Zürich"},
        _save=save,
    )


# -- Interrupted --------------------------------------------------------------------------------


def test_interrupted_is_a_base_exception_but_not_an_exception() -> None:
    assert issubclass(Interrupted, BaseException)
    assert not issubclass(Interrupted, Exception)
    caught_by_handler = False
    with pytest.raises(Interrupted, match="stopping"):
        try:
            raise Interrupted("the scheduler is stopping")
        except Exception:  # what a careless handler writes
            caught_by_handler = True
    assert caught_by_handler is False


# -- abort, reason, throw_if_aborted ---------------------------------------------------------


def test_a_fresh_signal_is_not_aborted() -> None:
    signal = AbortSignal()
    assert signal.aborted is False
    assert signal.reason is None
    signal.throw_if_aborted()  # does nothing
    assert "aborted=False" in repr(signal)


def test_abort_is_idempotent_and_the_first_reason_wins() -> None:
    signal = AbortSignal()
    first, second = Interrupted("lease lost"), TimeoutError("timeout")
    assert signal.abort(first) is True
    assert signal.abort(second) is False
    assert signal.abort(first) is False
    assert signal.aborted is True
    assert signal.reason is first
    with pytest.raises(Interrupted) as caught:
        signal.throw_if_aborted()
    assert caught.value is first
    assert "aborted=True" in repr(signal) and "lease lost" in repr(signal)


def test_throw_if_aborted_raises_a_timeout_reason() -> None:
    signal = AbortSignal()
    signal.abort(TimeoutError("took longer than 15m"))
    with pytest.raises(TimeoutError, match="15m"):
        signal.throw_if_aborted()


def test_concurrent_aborts_agree_on_one_reason() -> None:
    signal = AbortSignal()
    reasons = [Interrupted(f"reason {i}") for i in range(8)]
    results: list[bool] = []
    barrier = threading.Barrier(len(reasons))

    def race(reason: BaseException) -> None:
        barrier.wait()
        results.append(signal.abort(reason))

    threads = [threading.Thread(target=race, args=(reason,)) for reason in reasons]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert sorted(results) == [False] * 7 + [True]
    assert signal.reason in reasons


# -- wait -----------------------------------------------------------------------------------------


def test_wait_times_out_with_false() -> None:
    signal = AbortSignal()
    started = time.monotonic()
    assert signal.wait(0.05) is False
    assert time.monotonic() - started >= 0.04
    assert signal.wait(0) is False


def test_wait_after_abort_returns_true_at_once() -> None:
    signal = AbortSignal()
    signal.abort(Interrupted("stop"))
    started = time.monotonic()
    assert signal.wait(10) is True
    assert signal.wait() is True
    assert time.monotonic() - started < PROMPT


def test_wait_wakes_up_when_another_thread_aborts() -> None:
    signal = AbortSignal()
    timer = abort_later(signal, Interrupted("stop"))
    assert signal.wait(10) is True
    assert time.monotonic() - timer.fired_at < PROMPT  # type: ignore[attr-defined]
    assert isinstance(signal.reason, Interrupted)


# -- on_abort ---------------------------------------------------------------------------------


def test_on_abort_callbacks_run_once_in_the_aborting_thread() -> None:
    signal = AbortSignal()
    calls: list[tuple[str, str]] = []
    signal.on_abort(lambda: calls.append(("first", threading.current_thread().name)))
    signal.on_abort(lambda: calls.append(("second", threading.current_thread().name)))
    assert calls == []
    aborter = threading.Thread(target=signal.abort, args=(Interrupted("stop"),), name="aborter")
    aborter.start()
    aborter.join(5)
    signal.abort(Interrupted("again"))
    assert calls == [("first", "aborter"), ("second", "aborter")]


def test_on_abort_runs_at_once_when_already_aborted() -> None:
    signal = AbortSignal()
    signal.abort(TimeoutError("timeout"))
    calls: list[int] = []
    remove = signal.on_abort(lambda: calls.append(1))
    assert calls == [1]
    remove()  # harmless
    assert calls == [1]


def test_on_abort_callbacks_can_be_removed() -> None:
    signal = AbortSignal()
    calls: list[str] = []
    remove_a = signal.on_abort(lambda: calls.append("a"))
    signal.on_abort(lambda: calls.append("b"))
    remove_a()
    remove_a()  # twice is fine
    signal.abort(Interrupted("stop"))
    assert calls == ["b"]


def test_a_raising_callback_is_logged_and_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    signal = AbortSignal()
    calls: list[str] = []

    def broken() -> None:
        raise OSError("socket already closed")

    signal.on_abort(lambda: calls.append("before"))
    signal.on_abort(broken)
    signal.on_abort(lambda: calls.append("after"))
    with caplog.at_level(logging.ERROR, logger="django_anarchon"):
        assert signal.abort(Interrupted("stop")) is True
    assert calls == ["before", "after"]
    [record] = [r for r in caplog.records if r.name == "django_anarchon"]
    assert record.levelno == logging.ERROR
    assert "on_abort callback raised" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], OSError)
    assert signal.aborted and isinstance(signal.reason, Interrupted)


def test_a_raising_callback_registered_after_the_abort_is_logged_too(caplog: pytest.LogCaptureFixture) -> None:
    signal = AbortSignal()
    signal.abort(Interrupted("stop"))
    with caplog.at_level(logging.ERROR, logger="django_anarchon"):
        signal.on_abort(lambda: 1 / 0)
    assert any(r.exc_info and isinstance(r.exc_info[1], ZeroDivisionError) for r in caplog.records)


# -- wait_async --------------------------------------------------------------------------------


def test_wait_async_times_out_with_false() -> None:
    signal = AbortSignal()

    async def main() -> bool:
        return await signal.wait_async(0.05)

    started = time.monotonic()
    assert asyncio.run(main()) is False
    assert time.monotonic() - started >= 0.04
    assert signal._callbacks == []  # nothing left registered


def test_wait_async_wakes_up_when_another_thread_aborts() -> None:
    signal = AbortSignal()

    async def main() -> tuple[bool, float]:
        timer = abort_later(signal, Interrupted("stop"))
        result = await signal.wait_async(10)
        return result, time.monotonic() - timer.fired_at  # type: ignore[attr-defined]

    aborted, lateness = asyncio.run(main())
    assert aborted is True
    assert lateness < PROMPT


def test_wait_async_after_abort_and_from_the_loop_itself() -> None:
    signal = AbortSignal()

    async def main() -> tuple[bool, bool]:
        asyncio.get_running_loop().call_later(0.02, signal.abort, Interrupted("stop"))
        first = await signal.wait_async(10)
        second = await signal.wait_async(10)
        return first, second

    assert asyncio.run(main()) == (True, True)


# -- scope() ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reason", [Interrupted("the scheduler is stopping"), TimeoutError("took longer than 1s")])
def test_scope_cancels_the_awaited_work_and_raises_the_reason(reason: BaseException) -> None:
    signal = AbortSignal()

    async def main() -> tuple[BaseException, float, int]:
        timer = abort_later(signal, reason)
        try:
            async with signal.scope():
                await asyncio.sleep(10)
        except BaseException as error:  # noqa: B036 - we want to see exactly what comes out
            raised = error
        else:  # pragma: no cover - the failure case
            raise AssertionError("the scope did not raise")
        lateness = time.monotonic() - timer.fired_at  # type: ignore[attr-defined]
        task = asyncio.current_task()
        assert task is not None
        # The task is not left cancelled: it can keep awaiting.
        await asyncio.sleep(0.01)
        return raised, lateness, task.cancelling()

    raised, lateness, cancelling = asyncio.run(main())
    assert raised is reason
    assert not isinstance(raised, asyncio.CancelledError)
    assert lateness < PROMPT
    assert cancelling == 0


def test_scope_that_completes_leaves_no_pending_cancellation() -> None:
    signal = AbortSignal()

    async def main() -> str:
        async with signal.scope() as scoped:
            assert scoped is signal
            await asyncio.sleep(0.01)
        assert signal._callbacks == []
        signal.abort(Interrupted("stop after the scope"))
        await asyncio.sleep(0.05)  # would raise CancelledError if the scope had left a cancel behind
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        return "finished"

    assert asyncio.run(main()) == "finished"


def test_scope_entered_after_the_abort_raises_at_once() -> None:
    signal = AbortSignal()
    signal.abort(TimeoutError("timeout"))
    entered = []

    async def main() -> None:
        async with signal.scope():
            entered.append(True)

    with pytest.raises(TimeoutError, match="timeout"):
        asyncio.run(main())
    assert entered == []


def test_scope_abort_from_inside_the_loop() -> None:
    signal = AbortSignal()

    async def main() -> None:
        asyncio.get_running_loop().call_later(0.02, signal.abort, Interrupted("lease lost"))
        async with signal.scope():
            await asyncio.sleep(10)

    started = time.monotonic()
    with pytest.raises(Interrupted, match="lease lost"):
        asyncio.run(main())
    assert time.monotonic() - started < 0.02 + PROMPT


def test_scope_does_not_hide_someone_elses_cancellation() -> None:
    signal = AbortSignal()

    async def worker() -> None:
        async with signal.scope():
            await asyncio.sleep(10)

    async def main() -> None:
        task = asyncio.create_task(worker())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not signal.aborted

    asyncio.run(main())


def test_scope_reports_an_abort_that_the_block_swallowed() -> None:
    """If the awaited code eats the CancelledError, the scope still raises the reason on the way out."""
    signal = AbortSignal()

    async def main() -> int:
        abort_later(signal, Interrupted("stop"), delay=0.02)
        try:
            async with signal.scope():
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    pass  # a library that swallows cancellation
        except Interrupted:
            task = asyncio.current_task()
            assert task is not None
            await asyncio.sleep(0.01)
            return task.cancelling()
        raise AssertionError("the scope did not raise")  # pragma: no cover

    assert asyncio.run(main()) == 0


# -- ctx.sleep / ctx.asleep ---------------------------------------------------------------------


def test_ctx_sleep_returns_normally_without_an_abort() -> None:
    ctx = make_context()
    started = time.monotonic()
    assert ctx.sleep(0.03) is None
    assert time.monotonic() - started >= 0.025


def test_ctx_sleep_raises_the_reason_as_soon_as_the_signal_aborts() -> None:
    ctx = make_context()
    reason = Interrupted("lease lost")
    timer = abort_later(ctx.signal, reason)
    with pytest.raises(Interrupted) as caught:
        ctx.sleep(10)
    assert caught.value is reason
    assert time.monotonic() - timer.fired_at < PROMPT  # type: ignore[attr-defined]
    with pytest.raises(Interrupted):
        ctx.sleep(10)  # already aborted: at once


def test_ctx_asleep() -> None:
    ctx = make_context()

    async def main() -> float:
        await ctx.asleep(0.02)  # returns normally
        timer = abort_later(ctx.signal, TimeoutError("timeout"))
        try:
            await ctx.asleep(10)
        except TimeoutError:
            return time.monotonic() - timer.fired_at  # type: ignore[attr-defined]
        raise AssertionError("asleep did not raise")  # pragma: no cover

    assert asyncio.run(main()) < PROMPT
    with pytest.raises(TimeoutError):
        asyncio.run(ctx.asleep(10))


# -- Context ------------------------------------------------------------------------------------


def test_context_is_frozen() -> None:
    ctx = make_context()
    with pytest.raises(FrozenInstanceError):
        ctx.slot = 0  # type: ignore[misc]
    assert ctx.progress is None
    assert ctx.data == {"ville": "Zürich"}


def test_save_progress() -> None:
    saved: list[Any] = []
    ctx = make_context(save=saved.append)
    ctx.save_progress({"page": 3})
    assert saved == [{"page": 3}]
    assert ctx.progress == {"page": 3}
    asyncio.run(ctx.asave_progress({"page": 4}))
    assert saved == [{"page": 3}, {"page": 4}]
    assert ctx.progress == {"page": 4}
    with pytest.raises(RuntimeError, match="only available inside a run"):
        make_context().save_progress(1)
