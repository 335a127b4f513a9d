"""One attempt on a worker: started at its slot, never when it is already lost, ended once the burst has started.

No database: the run table's ``finish`` is replaced by a recorder of what it was
asked, and runs are unsaved rows.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from django_anarchon import Interrupted, signals
from django_anarchon import runner as runner_module
from django_anarchon.clock import Clock
from django_anarchon.conf import parse
from django_anarchon.models import Run
from django_anarchon.recorder import Recorder
from django_anarchon.registry import Job, build_job
from django_anarchon.runner import Runner
from django_anarchon.runs import ActiveRun, Phase, RunTable
from tests.conftest import wait_for


class Ends:
    """Stands in for RunTable.finish: what each run ended with."""

    def __init__(self, table: RunTable) -> None:
        self.calls: list[tuple[ActiveRun, BaseException | None, bool]] = []
        self.table = table

    def __call__(self, active: ActiveRun, error: BaseException | None, *, started: bool = True) -> None:
        if active.begin_finish():
            active.done()
        self.calls.append((active, error, started))


def make_runner(
    monkeypatch: pytest.MonkeyPatch, fake_finish: bool = True, **settings: Any
) -> tuple[Runner, RunTable, Ends]:
    parsed = parse(settings)
    table = RunTable(parsed, "runner-test", Recorder("token", "runner-test", parsed.lease_ttl), lambda *a, **k: None)
    ends = Ends(table)
    if fake_finish:
        monkeypatch.setattr(table, "finish", ends)
    runner = Runner(
        table,
        Clock(),
        token="token",
        instance_id="runner-test",
        lease_ttl=parsed.lease_ttl,
        event_loop=lambda: pytest.fail("no async handler here"),  # type: ignore[arg-type, return-value]
        watch=lambda: None,
    )
    return runner, table, ends


def hold(table: RunTable, job: Job, run_id: int, slot: int) -> ActiveRun:
    run: Any = Run(id=run_id, job=job.name, slot=slot, attempt=1, reason="scheduled")
    active = ActiveRun(run, job, renewed_at=time.monotonic())
    table.add(active)
    return active


def test_a_handler_that_returns_while_runs_still_wait_to_start_queues_its_ending_behind_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its thread takes the queued ending (or the next start) at once; the ending waits for the burst's starts.

    Every run of a burst woke a thread of its own: a hundred trivial runs due at
    once started one every ~50 µs, over 5 ms.
    """
    monkeypatch.setattr(runner_module, "ENDING_DEFER_S", 5.0)
    runner, table, ends = make_runner(monkeypatch)
    job = build_job("interval", "quick", "1s", lambda ctx: None, {})
    first = hold(table, job, 1, int(time.time() * 1000) - 5)
    runner.starting.add()  # one more run of the same instant, not started yet
    runner.start(first)
    wait_for(lambda: first.returned, 5, what="the handler to return")
    time.sleep(0.2)
    assert ends.calls == [] and not first.finished.is_set(), "ended only once the other run has started"
    runner.starting.begun()  # the other run's handler is called
    wait_for(lambda: first.finished.is_set(), 5, what="the ending")
    assert [a for a, _, _ in ends.calls] == [first] and table.get(1) is None
    assert runner.workers.started == 1, "the handler's own thread took its ending"

    alone = hold(table, job, 2, int(time.time() * 1000) - 5)
    runner.start(alone)
    wait_for(lambda: alone.finished.is_set(), 1, what="an ending on the spot: nothing waits to start")
    assert [a for a, _, _ in ends.calls] == [first, alone]


def test_endings_wait_until_the_runs_due_with_them_have_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hundred runs due at once: none is recorded as ended before the last one has started.

    Endings mixed in with the starts took the GIL from them: the last of a hundred
    trivial runs started about twice as late.
    """
    monkeypatch.setattr(runner_module, "ENDING_DEFER_S", 5.0)  # a slow CI must not end the wait early
    events: list[tuple[str, str]] = []
    runner, table, ends = make_runner(monkeypatch, MAX_WORKERS=200)

    def finish(active: ActiveRun, error: BaseException | None, *, started: bool = True) -> None:
        events.append(("end", active.run.job))
        active.done()

    monkeypatch.setattr(table, "finish", finish)
    slot = int(time.time() * 1000) + 1000  # all claimed ahead, released together
    for n in range(100):
        job = build_job("interval", f"j{n}", "1s", lambda ctx: events.append(("start", ctx.name)), {})
        runner.start(hold(table, job, n + 1, slot))
    wait_for(lambda: len(events) == 200, 10, what="a hundred runs to start and end")
    kinds = [kind for kind, _ in events]
    assert kinds == ["start"] * 100 + ["end"] * 100, f"an end came before start {kinds.index('end')} of 100"
    assert runner.starting.wait_done(0)


def test_a_run_whose_lease_may_have_run_out_while_it_waited_for_its_slot_is_never_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frozen after its claim (SIGSTOP, a long pause) and taken over meanwhile: on waking it must not start.

    The watchdog may not have come round yet when the worker reaches the slot, so
    the worker judges the lease itself, at the last moment before the handler.
    """
    runner, table, _ = make_runner(monkeypatch, fake_finish=False)  # the real finish: it logs "not started"
    called: list[Any] = []
    started: list[Any] = []
    job = build_job("interval", "frozen", "10000d", called.append, {})
    active = hold(table, job, 7, int(time.time() * 1000) + 200)

    def on_started(sender: Any, run: Any, **kwargs: Any) -> None:
        started.append(run)

    signals.run_started.connect(on_started)
    try:
        runner.start(active)
        active.renewed_at = time.monotonic() - 100  # its last renewal: long before the freeze ended
        wait_for(lambda: active.finished.is_set(), 5, what="the run to be given up")
        time.sleep(0.3)
    finally:
        signals.run_started.disconnect(on_started)
    assert called == [] and started == [], "the handler of a run this instance may have lost was started"
    assert active.cause == "fenced" and isinstance(active.signal.reason, Interrupted)
    assert active.state is Phase.DONE and table.get(7) is None


def test_a_run_stopped_before_its_slot_is_ended_without_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    runner, table, ends = make_runner(monkeypatch)
    called: list[Any] = []
    job = build_job("interval", "early", "10000d", called.append, {})
    active = hold(table, job, 8, int(time.time() * 1000) + 60_000)
    runner.start(active)
    active.abort("stop", Interrupted("stopping"))
    wait_for(lambda: active.finished.is_set(), 5, what="the run to end")
    assert called == []
    [(ended, error, started)] = ends.calls
    assert ended is active and isinstance(error, Interrupted) and started is False
