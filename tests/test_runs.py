"""The run table: capacity, and the endings decided by what happened first.

No database: the recorder is replaced by one that answers as the database would.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest

from django_anarchon.conf import parse
from django_anarchon.models import Run
from django_anarchon.recorder import Ending, Recorder
from django_anarchon.registry import build_job
from django_anarchon.runs import ActiveRun, Phase, RunTable


class FakeRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__("token", "runs-test", 30.0)
        self.endings: list[Ending] = []

    def submit(self, ending: Ending) -> None:
        self.endings.append(ending)
        ending.settle(True)


def table_with(recorder: Recorder | None = None, **settings: Any) -> RunTable:
    sent: list[Any] = []
    table = RunTable(parse(settings), "runs-test", recorder or FakeRecorder(), lambda *a, **k: sent.append((a, k)))
    table.sent = sent  # type: ignore[attr-defined]
    return table


def held(table: RunTable, run_id: int, timeout: str | None = None) -> ActiveRun:
    job = build_job("interval", f"job-{run_id}", "1s", lambda ctx: None, {"timeout": timeout} if timeout else {})
    run: Any = Run(id=run_id, job=job.name, slot=1_000, attempt=1, reason="scheduled")
    active = ActiveRun(run, job, renewed_at=time.monotonic())
    table.add(active)
    return active


def test_capacity_counts_runs_whose_handler_has_not_returned() -> None:
    table = table_with(MAX_WORKERS=3)
    runs = [held(table, n) for n in range(1, 4)]
    assert table.capacity() == 0
    table.returned(runs[0])  # its end is still being recorded, its worker is free
    assert table.capacity() == 1


def test_a_handler_that_returned_before_its_deadline_succeeds_and_one_that_overran_fails() -> None:
    recorder = FakeRecorder()
    table = table_with(recorder)
    on_time, late = held(table, 1, timeout="1s"), held(table, 2, timeout="1s")
    now = time.monotonic()
    for active in (on_time, late):
        active.ran, active.started = True, now - 1.0
        active.deadline = now - 0.01  # the deadline has passed by the time the end is recorded
    on_time.returned_at = now - 0.02
    late.returned_at = now
    table.time_out_overdue(now)  # the watchdog: only the one still running at its deadline
    assert on_time.state is Phase.RUNNING
    table.finish(on_time, None)
    assert [(e.run.id, e.status, e.error_type) for e in recorder.endings][-1] == (1, "success", "")
    table.finish(late, None)
    statuses = {e.run.id: (e.status, e.error_type) for e in recorder.endings}
    assert statuses[2] == ("failed", "TimeoutError")


def test_a_timed_out_run_has_one_end_line_unless_its_handler_goes_on_long_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SPEC 7 asks for one line per end: a timed-out run's is "Run failed ... TimeoutError". The line
    for its handler's own end is a debug line when the handler honoured its signal, an INFO line when
    it went on long after (its work may matter to whoever reads the log)."""
    caplog.set_level(logging.DEBUG, logger="django_anarchon")
    table = table_with()
    prompt, stubborn = held(table, 1, timeout="1s"), held(table, 2, timeout="1s")
    now = time.monotonic()
    for active in (prompt, stubborn):
        active.ran, active.started, active.deadline = True, now - 1.0, now - 0.01
    table.time_out_overdue(now)
    assert prompt.cause == stubborn.cause == "timeout" and prompt.aborted_at is not None
    prompt.returned_at = prompt.aborted_at + 0.05  # raised as soon as its signal aborted
    stubborn.returned_at = prompt.aborted_at + 30.0  # ignored it for half a minute
    table.finish(prompt, TimeoutError("ran past its timeout"))
    table.finish(stubborn, None)
    late_ends = {
        record.getMessage().split()[7]: record.levelno
        for record in caplog.records
        if record.getMessage().startswith("Run ended after it was timed out")
    }
    assert late_ends == {"job-1": logging.DEBUG, "job-2": logging.INFO}
    assert [r.levelno for r in caplog.records if r.getMessage().startswith("Run failed")] == [logging.ERROR] * 2


def test_a_hand_over_says_whether_the_handler_was_called() -> None:
    """Stopped before its slot but recorded after it: the row got the slot as its start time."""
    from django_anarchon.exceptions import Interrupted

    recorder = FakeRecorder()
    table = table_with(recorder)
    waiting, running = held(table, 1), held(table, 2)
    assert running.begin_start()
    for active in (waiting, running):
        active.abort("stop", Interrupted("stopping"))
    table.finish(waiting, waiting.signal.reason, started=False)
    table.finish(running, running.signal.reason)
    assert [(e.run.id, e.hand_over, e.started) for e in recorder.endings] == [(1, True, False), (2, True, True)]


def test_a_run_is_either_started_or_withdrawn_never_both(caplog: pytest.LogCaptureFixture) -> None:
    recorder = FakeRecorder()
    table = table_with(recorder)
    started, withdrawn = held(table, 1), held(table, 2)
    assert started.begin_start() and started.ran
    assert not table.withdraw(started, "the job was paused before its slot"), "its handler started first"
    assert recorder.endings == [] and not started.signal.aborted
    assert table.withdraw(withdrawn, "the job was paused before its slot")
    assert not withdrawn.begin_start(), "withdrawn first: never started"
    assert withdrawn.signal.aborted and withdrawn.cause == "paused"
    [ending] = recorder.endings
    assert (ending.run.id, ending.status, ending.detail) == (2, "skipped", "the job was paused before its slot")
    assert withdrawn.run.status == "skipped" and withdrawn.state is Phase.DONE
    # Its worker, released at once, ends nothing more and adds no second end line.
    caplog.set_level(logging.DEBUG, logger="django_anarchon")
    table.finish(withdrawn, withdrawn.signal.reason, started=False)
    ends = [r for r in caplog.records if "job-2" in r.getMessage() and r.getMessage().startswith("Run ")]
    assert [(r.getMessage().split(":")[0], r.levelno) for r in ends] == [
        ("Run skipped", logging.WARNING),
        ("Run not started", logging.DEBUG),
    ]
    assert len(recorder.endings) == 1


def test_a_stop_that_came_first_is_not_overtaken_by_the_timeout() -> None:
    table = table_with()
    active = held(table, 1, timeout="1s")
    active.deadline = time.monotonic() - 1
    active.abort("stop", RuntimeError("stopping"))
    table.time_out_overdue(time.monotonic())
    assert active.state is Phase.RUNNING, "left to the stop's grace period: handed over, not failed"


def test_a_lost_run_is_aborted_once_and_recorded_by_nobody_here(caplog: pytest.LogCaptureFixture) -> None:
    recorder = FakeRecorder()
    table = table_with(recorder)
    active = held(table, 1)
    table.lose(active, "taken over")
    table.lose(active, "again")
    assert active.state is Phase.DONE and active.cause == "lost" and recorder.endings == []
    assert caplog.text.count("Lost job-1") == 1
    table.finish(active, None)
    assert recorder.endings == [], "its late end changes nothing"
    assert "Run ended after it was lost" in caplog.text


def test_skipped_and_replaced_runs_are_announced_through_the_outbox() -> None:
    from django_anarchon import signals

    def listener(**kwargs: Any) -> None:
        pass

    for signal in (signals.run_interrupted, signals.run_skipped):
        signal.connect(listener, weak=False)
    table = table_with()
    active = held(table, 5)
    row: Any = SimpleNamespace(id=5, job="job-5", slot=1_000, attempt=1, reason="scheduled", status="interrupted",
                               detail="replaced by a newer slot (overlap='replace')")  # fmt: skip
    table.interrupted_elsewhere([row])
    table.skipped([SimpleNamespace(id=6, job="job-6", slot=2_000, attempt=1, reason="scheduled", status="skipped",
                                   detail="busy")])  # fmt: skip
    names = [args[0] for args, _ in table.sent]  # type: ignore[attr-defined]
    for signal in (signals.run_interrupted, signals.run_skipped):
        signal.disconnect(listener)
    assert names == [signals.run_interrupted, signals.run_skipped]
    assert active.state is Phase.DONE and active.cause == "lost"


def test_a_run_ended_before_its_handler_was_called_is_logged_without_a_duration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Lost before its slot, it ran for no time at all: "handler not started", not the time since its claim."""
    caplog.set_level(logging.DEBUG, logger="django_anarchon")
    table = table_with()
    never, ran = held(table, 1), held(table, 2)
    never.started -= 5  # claimed ahead, a while ago
    assert ran.begin_start()
    for active in (never, ran):
        table.lose(active, "its lease was lost")
    table.finish(never, never.signal.reason, started=False)
    table.returned(ran)
    table.finish(ran, ran.signal.reason)
    ends = {
        record.job: record  # type: ignore[attr-defined]
        for record in caplog.records
        if record.getMessage().startswith(("Run not started", "Run ended after"))
    }
    assert ends.keys() == {"job-1", "job-2"}, [r.getMessage() for r in caplog.records]
    assert ends["job-1"].getMessage().endswith("instance=runs-test handler not started"), ends["job-1"].getMessage()
    assert ends["job-1"].duration is None  # type: ignore[attr-defined]
    assert " duration=" in ends["job-2"].getMessage() and ends["job-2"].duration >= 0  # type: ignore[attr-defined]


def test_a_run_added_after_stop_is_aborted_at_once() -> None:
    """The loop can win a run after stop() aborted the others (its claim was held up by a database that
    did not answer): that run must never start, and be handed over like the rest."""
    table = table_with()
    before = held(table, 1)
    table.stop("runs-test")
    after = held(table, 2)
    for active in (before, after):
        assert active.signal.aborted and active.cause == "stop", active.run.id
    assert not after.begin_start(), "aborted before its start: its handler is never called"


def test_attempts_lost_or_fenced_here_count_as_interrupted_runs_ended_on_this_instance() -> None:
    """``anarchon_runs_total`` counts the attempts ended here by recorded status; one replaced, taken
    over or fenced is recorded interrupted by another, and was not counted at all (helper 29)."""
    from django_anarchon import metrics

    table = table_with()
    lost, fenced = held(table, 71), held(table, 72)

    def interrupted(active: ActiveRun) -> float:
        return metrics.RUNS.labels(active.run.job, "interrupted").get()

    before = interrupted(lost), interrupted(fenced)
    table.lose(lost, "replaced by a newer slot")
    table.lose(lost, "again")  # ended once, counted once
    fenced.renewed_at = time.monotonic() - 60
    table.fence_if_overdue(fenced)
    assert (interrupted(lost), interrupted(fenced)) == (before[0] + 1, before[1] + 1)
