"""One attempt on a worker: started at its slot, never when it is already lost, ended once the burst has started.

No database: the run table's ``finish`` is replaced by a recorder of what it was
asked, and runs are unsaved rows.
"""

from __future__ import annotations

import logging
import threading
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
from django_anarchon.runner import STALL_S, STUCK_S, Runner, _calls_for
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
        self.table.exited(active)


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
        max_workers=parsed.max_workers,
        event_loop=lambda: pytest.fail("no async handler here"),  # type: ignore[arg-type, return-value]
        watch=lambda: None,
    )
    return runner, table, ends


def hold(table: RunTable, job: Job, run_id: int, slot: int) -> ActiveRun:
    run: Any = Run(id=run_id, job=job.name, slot=slot, attempt=1, reason="scheduled")
    active = ActiveRun(run, job, renewed_at=time.monotonic())
    table.add(active)
    return active


def test_runs_released_beyond_max_workers_wait_for_the_next_free_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most MAX_WORKERS handlers at once; the rest are taken, in order, by the workers that free up."""
    runner, table, ends = make_runner(monkeypatch, MAX_WORKERS=2)
    gate = threading.Event()
    started: list[str] = []

    def blocking(ctx: Any) -> None:
        started.append(ctx.name)
        gate.wait(5)

    for n in range(5):
        runner.start(
            hold(table, build_job("interval", f"j{n}", "1s", blocking, {}), n + 1, int(time.time() * 1000) - 5)
        )
    wait_for(lambda: len(started) == 2, 5, what="two handlers")
    time.sleep(0.2)
    assert started == ["j0", "j1"] and runner.waiting() == 3, "the others wait for a worker"
    gate.set()
    wait_for(lambda: len(ends.calls) == 5, 5, what="every run")
    assert sorted(started) == ["j0", "j1", "j2", "j3", "j4"] and started[:2] == ["j0", "j1"]
    # Two workers take j2 and j3 in order; which of them appends first is up to the threads. j4 is
    # taken only by a worker that has finished one of them, so it cannot come before both.
    assert started.index("j4") > min(started.index("j2"), started.index("j3")), started
    assert runner.workers.started == 2, "no thread beyond MAX_WORKERS"


def test_a_worker_goes_on_to_the_next_run_without_waiting_for_the_previous_end_to_be_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ends are recorded in batches on the recorder's thread; a worker only hands them over."""
    parsed = parse({"MAX_WORKERS": 1})
    submitted: list[Any] = []
    recorder = Recorder("token", "runner-test", parsed.lease_ttl)
    monkeypatch.setattr(recorder, "submit", submitted.append)  # never written: nobody waits for it
    table = RunTable(parsed, "runner-test", recorder, lambda *a, **k: None)
    runner = Runner(table, Clock(), token="token", instance_id="runner-test", lease_ttl=30.0, max_workers=1,
                    event_loop=lambda: pytest.fail("sync only"), watch=lambda: None)  # type: ignore[arg-type]  # fmt: skip
    started: list[str] = []
    for n in range(3):
        job = build_job("interval", f"quick{n}", "1s", lambda ctx: started.append(ctx.name), {})
        runner.start(hold(table, job, n + 1, int(time.time() * 1000) - 5))
    wait_for(lambda: len(started) == 3, 5, what="three runs on the one worker, one after another")
    assert [e.run.job for e in submitted] == ["quick0", "quick1", "quick2"], "each end handed over"
    assert all(table.get(n + 1) is not None for n in range(3)), "held (and renewed) until their ends are recorded"
    submitted[0].settle(True)
    assert table.get(1) is None and table.get(2) is not None


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


def test_a_handler_waking_from_a_sleep_that_outlasted_its_lease_is_fenced_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frozen in ``ctx.sleep()`` (SIGSTOP) past the lease: on waking, the sleep raises ``Interrupted``.

    The keeper may not have come round yet when the handler's sleep ends; had the
    sleep returned, the handler would go on with a run another instance may hold.
    """
    runner, table, ends = make_runner(monkeypatch)
    after: list[str] = []
    asleep = threading.Event()

    def sleeper(ctx: Any) -> None:
        asleep.set()
        ctx.sleep(0.4)
        after.append("went on")

    active = hold(table, build_job("interval", "sleeper", "10000d", sleeper, {}), 9, int(time.time() * 1000) - 5)
    runner.start(active)
    assert asleep.wait(5), "the handler did not start"
    active.renewed_at = time.monotonic() - 100  # the freeze: no renewal for far longer than the lease
    wait_for(lambda: len(ends.calls) == 1, 5, what="the run to end")
    [(ended, error, started)] = ends.calls
    assert after == [], "the handler went on after a sleep that outlasted its lease"
    assert (
        isinstance(error, Interrupted)
        and "could not renew the lease" in str(error)
        and "frozen" in str(error)
        and started
    )
    assert active.cause == "fenced"


def test_a_handler_is_not_called_when_its_run_was_stopped_while_run_started_receivers_ran(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A slow run_started receiver outlasting SHUTDOWN_GRACE: the run was handed over meanwhile.

    Calling the handler after that would run the slot twice (here and as the next attempt). The
    start line is logged before the receivers run, so it never comes after the run's end line.
    """
    caplog.set_level(logging.INFO, logger="django_anarchon")
    runner, table, ends = make_runner(monkeypatch)
    called: list[Any] = []
    logged_first: list[bool] = []
    active = hold(table, build_job("interval", "charge", "10000d", called.append, {}), 11, int(time.time() * 1000) - 5)

    def slow_receiver(sender: Any, run: Any, **kwargs: Any) -> None:
        logged_first.append(any(m.startswith("Run started: charge") for m in caplog.messages))
        active.abort("stop", Interrupted("the scheduler is stopping"))  # stop() while the receiver runs

    signals.run_started.connect(slow_receiver)
    try:
        runner.start(active)
        wait_for(lambda: len(ends.calls) == 1, 5, what="the run to end")
    finally:
        signals.run_started.disconnect(slow_receiver)
    [(ended, error, started)] = ends.calls
    assert called == [], "the handler was called after its run had been stopped"
    assert ended is active and isinstance(error, Interrupted) and started
    assert logged_first == [True], "the start line came after run_started's receivers"


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


# -- how many workers a burst of runs gets -------------------------------------------------------


def burst(runner: Runner, table: RunTable, handler: Any, count: int, first_id: int) -> None:
    """``count`` runs released at once, as the starter releases the runs of one instant."""
    slot = int(time.time() * 1000) - 5
    actives = [
        hold(table, build_job("interval", f"b{first_id + n}", "1s", handler, {}), first_id + n, slot)
        for n in range(count)
    ]
    for active in actives:
        runner.start(active)


def test_a_burst_of_quick_runs_is_taken_by_one_or_two_workers_not_a_worker_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sixteen threads woken for a hundred quick handlers only pass the GIL around (docs/performance.md).

    What is shown is the learnt fan-out: the doubling for runs no worker has
    taken for STUCK_S is kept out of it, as a machine busy with other work can
    hold a worker off the CPU that long (and would rightly double them).
    """
    monkeypatch.setattr(runner_module, "STUCK_S", 1.0)
    runner, table, ends = make_runner(monkeypatch, MAX_WORKERS=16)
    threads: list[str] = []

    def quick(ctx: Any) -> None:
        threads.append(threading.current_thread().name)

    for round_ in range(3):  # the first bursts teach the runner what these handlers call for
        threads.clear()
        burst(runner, table, quick, 100, 1 + 100 * round_)
        wait_for(lambda: len(threads) == 100, 5, what="every quick run")
        time.sleep(0.05)
    assert len(set(threads)) <= 3, f"a hundred quick runs went to {len(set(threads))} workers"
    assert runner._fanout is not None and runner._fanout < 3


def test_runs_behind_a_handler_that_blocks_get_another_worker_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    runner, table, ends = make_runner(monkeypatch, MAX_WORKERS=4)
    done: list[str] = []
    burst(runner, table, lambda ctx: done.append(ctx.name), 20, 1)  # learnt: quick handlers, one worker
    wait_for(lambda: len(done) == 20, 5, what="the quick runs")
    gate = threading.Event()
    blocked_at = time.monotonic()
    burst(runner, table, lambda ctx: gate.wait(10), 1, 100)
    burst(runner, table, lambda ctx: done.append(ctx.name), 3, 200)
    try:
        wait_for(lambda: len(done) == 23, 2, what="the runs released behind the blocked one")
        assert time.monotonic() - blocked_at < 1.0
    finally:
        gate.set()
        wait_for(lambda: len(ends.calls) == 24, 5, what="the blocked run to end")


def test_handlers_that_wait_on_io_get_every_worker_they_call_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler that mostly waits (a query to a slow database, a request) gains from a thread each."""
    runner, table, ends = make_runner(monkeypatch, MAX_WORKERS=8)
    lock = threading.Lock()
    running = [0, 0]  # now, most at once

    def waits(ctx: Any) -> None:
        with lock:
            running[0] += 1
            running[1] = max(running)
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    burst(runner, table, waits, 2, 1)  # learnt: 50 ms of waiting for almost no CPU
    wait_for(lambda: len(ends.calls) == 2, 5, what="the first runs")
    # learnt from that call, if a busy machine did not also hold it off the CPU (see _calls_for)
    assert runner._fanout in (None, 8), "as many as MAX_WORKERS, and no more"
    running[1] = 0
    released = time.monotonic()
    burst(runner, table, waits, 16, 10)
    wait_for(lambda: len(ends.calls) == 18, 5, what="the burst")
    assert running[1] == 8, f"at most {running[1]} of 8 workers at once"
    assert time.monotonic() - released < 0.5, "16 runs of 50 ms on 8 workers: two rounds, not sixteen"


def test_a_worker_that_cannot_be_started_leaves_no_run_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of workers where the second cannot start: that run and the rest go back in order, and all run once."""
    monkeypatch.setattr(runner_module, "RETRY_S", 0.05)
    runner, table, ends = make_runner(monkeypatch, MAX_WORKERS=8)
    runner._fanout = 8.0  # learnt: these handlers wait, a burst calls for eight workers
    gate = threading.Event()
    ran: list[str] = []

    def waits(ctx: Any) -> None:
        ran.append(ctx.name)
        gate.wait(5)

    real_submit = runner.workers.submit
    submits = [0]

    def second_fails(active: ActiveRun, work: Any) -> None:
        submits[0] += 1
        if submits[0] == 2:
            raise RuntimeError("can't start new thread")
        real_submit(active, work)

    monkeypatch.setattr(runner.workers, "submit", second_fails)
    burst(runner, table, waits, 6, 1)
    try:
        wait_for(lambda: len(ran) == 6, 5, what="every run of the burst on a worker of its own")
    finally:
        gate.set()
    wait_for(lambda: len(ends.calls) == 6, 5, what="every run to end")
    assert sorted(ran) == [f"b{n}" for n in range(1, 7)], "each run once, none lost, none twice"
    wait_for(lambda: runner._executing == 0, 5, what="the workers to be counted free again")
    assert submits[0] >= 7, "the failed submit was tried again"


def test_the_first_worker_that_cannot_be_started_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module, "RETRY_S", 0.05)
    runner, table, ends = make_runner(monkeypatch, MAX_WORKERS=4)
    real_submit = runner.workers.submit
    fails = [1]

    def first_fails(active: ActiveRun, work: Any) -> None:
        if fails[0]:
            fails[0] -= 1
            raise RuntimeError("can't start new thread")
        real_submit(active, work)

    monkeypatch.setattr(runner.workers, "submit", first_fails)
    done: list[str] = []
    burst(runner, table, lambda ctx: done.append(ctx.name), 1, 1)
    wait_for(lambda: done == ["b1"], 5, what="the run, once a worker could be started")
    wait_for(lambda: len(ends.calls) == 1 and runner._executing == 0, 5, what="the run to end, its worker free")


def test_workers_at_the_fan_out_the_handlers_call_for_are_looked_at_again_only_when_they_may_be_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through a burst that drains as it should, the starter is not woken every STALL_S for nothing."""
    runner, table, ends = make_runner(monkeypatch, MAX_WORKERS=8)
    runner._fanout = 2.0
    job = build_job("interval", "w", "1s", lambda ctx: None, {})
    now = time.monotonic()
    for n in range(5):
        active = hold(table, job, n + 1, 0)
        active.released_at = now - 2 * STALL_S
        runner._ready.append(active)
    runner._executing = 2  # as many as the handlers call for
    runner._taken_at = now
    with monkeypatch.context() as frozen:
        frozen.setattr(time, "monotonic", lambda: now)  # no time passes: a busy machine made it flaky
        again = runner._unstall()
    assert again == pytest.approx(STUCK_S), "looked at again when the workers may be stuck, not before"
    assert runner._executing == 2 and len(runner._ready) == 5, "no worker added"


def test_what_a_handler_calls_for_is_told_by_how_it_spent_its_time() -> None:
    """Waiting calls for threads; computing, or being held off the CPU by a busy machine, does not."""
    assert _calls_for(0.050, 0.001, (10, 3), (11, 3)) == pytest.approx(50), "waited 49 of 50 ms"
    assert _calls_for(0.050, 0.001, (10, 3), (10, 5)) == 1.0, "never waited: held off the CPU, not waiting"
    assert _calls_for(0.050, 0.001, (10, 3), (12, 4)) is None, "waited and held off: cannot be told apart"
    assert _calls_for(0.050, 0.001, None, None) == pytest.approx(50), "no counts: time over CPU time"


def test_a_learnt_fan_out_never_passes_max_workers_and_ignores_calls_that_say_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner, table, ends = make_runner(monkeypatch, MAX_WORKERS=4)
    runner._learn(None)
    assert runner._fanout is None
    runner._learn(1000.0)
    assert runner._fanout == 4
    runner._learn(None)
    runner._learn(1.0)
    assert runner._fanout == pytest.approx(0.8 * 4 + 0.2 * 1)


def test_a_handler_gets_a_context_of_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner builds contexts without the dataclass's __init__: none of its fields may be left out."""
    from django_anarchon import Context

    runner, table, ends = make_runner(monkeypatch)
    seen: list[Context] = []
    job = build_job("interval", "ctx", "1s", seen.append, {"data": {"k": 1}})
    slot = int(time.time() * 1000) - 5
    runner.start(hold(table, job, 7, slot))
    wait_for(lambda: len(ends.calls) == 1, 5, what="the run")
    ctx = seen[0]
    assert set(vars(ctx)) == set(Context.__dataclass_fields__)
    fields = {name: getattr(ctx, name) for name in Context.__dataclass_fields__}
    assert ctx == Context(**fields) and repr(ctx) == repr(Context(**fields))
    assert (ctx.name, ctx.slot, ctx.attempt, ctx.reason, ctx.manual) == ("ctx", slot, 1, "scheduled", False)
    assert ctx.scheduled_at.timestamp() * 1000 == pytest.approx(slot)
    with pytest.raises(AttributeError):
        ctx.name = "other"  # type: ignore[misc]  # still frozen
