"""The worker threads and the starter: runs released at their slot, threads reused, starts counted.

No database: runs are stand-ins with the attributes these pieces read, and time
is a number the test moves.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from django.db import transaction

from django_anarchon import workers as workers_module
from django_anarchon.runs import ActiveRun
from django_anarchon.workers import Starter, Workers, check_kept_connections, tidy_connections
from tests.conftest import start, wait_for


def active(slot: int, job: str = "job") -> ActiveRun:
    run: Any = SimpleNamespace(job=job, slot=slot, attempt=1, id=slot)
    return ActiveRun(run, SimpleNamespace(name=job), renewed_at=0.0)  # type: ignore[arg-type]


class FakeTime:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_starter_releases_runs_at_their_slot_together_and_in_slot_order() -> None:
    clock = FakeTime(1_000)
    released: list[int] = []
    starter = Starter(clock, lambda a: released.append(a.run.slot))
    runs = [active(2_000, "b"), active(1_500, "a"), active(2_000, "c"), active(3_000, "d")]
    for run in runs:
        starter.add(run)
    threading.Event().wait(0.05)
    assert released == [], "nothing is due yet"
    clock.now = 2_000
    starter.wake()
    wait_for(lambda: len(released) == 3, 5, what="the runs due by 2000")
    assert released == [1_500, 2_000, 2_000]
    clock.now = 3_000
    starter.wake()
    wait_for(lambda: len(released) == 4, 5, what="the last run")
    wait_for(lambda: not starter.running, 5, what="the starter thread to leave once nothing waits")


def test_the_starter_thread_stays_a_while_for_the_next_instant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs due every second would otherwise cost a thread started (and ended) every second."""
    monkeypatch.setattr(Starter, "LINGER_S", 0.5)
    clock = FakeTime(1_000)
    released: list[int] = []
    starter = Starter(clock, lambda a: released.append(a.run.slot))
    starter.add(active(1_000))
    wait_for(lambda: released == [1_000], 5, what="the first run")
    thread = starter._thread
    threading.Event().wait(0.2)
    starter.add(active(1_000, "next"))
    wait_for(lambda: len(released) == 2, 5, what="the next instant's run")
    assert starter._thread is thread, "the same thread released the next instant's run"
    left_at = time.monotonic()
    wait_for(lambda: not starter.running, 5, what="the thread to leave once nothing came for LINGER_S")
    assert time.monotonic() - left_at >= 0.3


def test_a_closed_starter_leaves_at_once_rather_than_linger() -> None:
    clock = FakeTime(1_000)
    released: list[int] = []
    starter = Starter(clock, lambda a: released.append(a.run.slot))
    starter.add(active(1_000))
    wait_for(lambda: released == [1_000], 5, what="the run")
    began = time.monotonic()
    starter.close(5)
    assert not starter.running and time.monotonic() - began < 1.0, "left without lingering LINGER_S (2 s)"


def test_the_starter_releases_a_run_whose_signal_aborts_before_its_slot_at_once() -> None:
    clock = FakeTime(1_000)
    released: list[ActiveRun] = []
    starter = Starter(clock, released.append)
    early, later = active(60_000, "early"), active(60_000, "later")
    starter.add(early)
    starter.add(later)
    early.abort("stop", RuntimeError("stopping"))
    wait_for(lambda: released == [early], 5, what="the aborted run to be handed to its worker")
    assert later not in released


def test_the_starter_holds_a_run_whose_pause_is_still_to_be_read_past_its_slot_until_told() -> None:
    """A run claimed ahead starts only once the loop has read its job's pause again (a loop that
    came late let a paused job's run start at its slot, CI on dbb4fd7)."""
    clock = FakeTime(1_000)
    readings = [0]

    def now_ms() -> float:
        readings[0] += 1
        return clock()

    released: list[str] = []
    starter = Starter(now_ms, lambda a: released.append(a.run.job))
    held, free, aborted = active(1_500, "held"), active(1_500, "free"), active(1_500, "aborted")
    held.pause_check_pending = aborted.pause_check_pending = True
    starter.add_many([held, free, aborted])
    clock.now = 2_000
    starter.wake()
    wait_for(lambda: released == ["free"], 5, what="the run with no look pending, at its slot")
    before = readings[0]
    threading.Event().wait(0.2)
    assert released == ["free"], "held past its slot while its look is pending"
    assert readings[0] - before < 10, "a held run is waited for, not polled in a loop"
    aborted.abort("paused", RuntimeError("withdrawn"))
    wait_for(lambda: released == ["free", "aborted"], 5, what="the withdrawn run, to be ended by its worker")
    held.pause_check_pending = False
    starter.wake()
    wait_for(lambda: released == ["free", "aborted", "held"], 5, what="the run once its look was made")
    starter.close(1)


def test_the_starter_reads_the_clock_again_while_a_run_waits_so_a_clock_step_cannot_hold_it() -> None:
    """A reading taken just after the wall clock was stepped back (before the engine measured
    the database clock again) is an hour behind; the next reading is right again."""
    readings = iter([1_000 - 3_600_000])
    clock = FakeTime(1_000)
    released: list[int] = []
    starter = Starter(lambda: next(readings, clock.now), lambda a: released.append(a.run.slot))
    started = time.monotonic()
    starter.add(active(1_050))
    clock.now = 1_050  # the slot comes; nothing wakes the starter
    wait_for(lambda: released == [1_050], 2, what="the run, released at its slot however far back the step")
    assert time.monotonic() - started < 1.0


def test_the_starter_keeps_releasing_when_one_release_fails() -> None:
    clock = FakeTime(5_000)
    released: list[str] = []

    def release(run: ActiveRun) -> None:
        if run.run.job == "bad":
            raise RuntimeError("no thread")
        released.append(run.run.job)

    starter = Starter(clock, release)
    starter.add(active(4_000, "bad"))
    starter.add(active(4_001, "good"))
    wait_for(lambda: released == ["good"], 5, what="the good run")


def test_workers_reuse_idle_threads_and_start_one_per_run_when_none_is_idle() -> None:
    workers = Workers()
    gate = threading.Event()
    seen: list[str] = []

    def blocking(run: ActiveRun) -> None:
        seen.append(threading.current_thread().name)
        gate.wait(5)

    for n in range(3):
        workers.submit(active(n), blocking)
    wait_for(lambda: len(seen) == 3, 5, what="three runs at once, none waiting behind another")
    assert len(set(seen)) == 3
    gate.set()
    wait_for(lambda: workers.idle == 3, 5, what="the threads to be idle again")
    seen.clear()
    workers.submit(active(9), lambda run: seen.append(threading.current_thread().name))
    wait_for(lambda: len(seen) == 1, 5, what="a run on an idle thread")
    assert workers.started == 3, "no new thread while one was idle"


def test_closed_workers_are_gone_when_close_returns_and_one_held_in_its_task_is_waited_for() -> None:
    """stop() said the scheduler's threads were gone while a worker was still on its way out."""
    workers = Workers()
    release = threading.Event()
    busy = threading.Event()

    def slow(_: ActiveRun) -> None:
        busy.set()
        release.wait(5)

    workers.submit(active(1), slow)
    workers.submit(active(2), lambda _: None)
    assert busy.wait(5)
    threads = list(workers._threads)
    threading.Timer(0.3, release.set).start()
    workers.close(timeout=5)
    assert [t.name for t in threads if t.is_alive()] == []


def test_close_gives_up_on_a_worker_whose_handler_does_not_return() -> None:
    workers = Workers()
    release = threading.Event()
    workers.submit(active(1), lambda _: release.wait(10))
    threads = list(workers._threads)
    began = time.monotonic()
    try:
        workers.close(timeout=0.2)
        assert time.monotonic() - began < 2.0, "a handler that ignores its signal cannot hold stop() up"
        assert len(threads) == 1 and threads[0].is_alive(), "close() returned while its worker was still busy"
    finally:
        release.set()
    threads[0].join(5)
    assert not threads[0].is_alive(), "the worker leaves once its handler returns"


# -- connections kept between runs ------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_sound_connection_is_kept_for_the_next_run_and_a_spoiled_one_is_closed() -> None:
    from django.db import connection

    connection.ensure_connection()
    sound = connection.connection
    tidy_connections()
    assert connection.connection is sound, "kept: the next run on this thread reuses it"

    transaction.set_autocommit(False)  # a handler that switched autocommit off and never back
    tidy_connections()
    assert connection.connection is None, "closed: it would have carried an open transaction into the next run"
    assert connection.get_autocommit() is True

    connection.ensure_connection()
    connection.errors_occurred = True
    tidy_connections()
    assert connection.connection is not None and not connection.errors_occurred, "an error, but still usable"

    connection.settings_dict["CONN_MAX_AGE"] = 1
    try:
        connection.close_at = time.monotonic() - 1
        tidy_connections()
        assert connection.connection is None, "older than a positive CONN_MAX_AGE: closed"
    finally:
        connection.settings_dict["CONN_MAX_AGE"] = 0


@pytest.mark.django_db(transaction=True)
def test_a_connection_a_thread_opens_after_its_first_tidying_is_tidied_too() -> None:
    """The wrappers a thread uses are listed once, and again whenever it connects somewhere."""
    from django.db import connection, connections

    seen: dict[str, Any] = {}

    def worker_thread() -> None:
        try:
            tidy_connections()  # a first run that touched no database
            connection.ensure_connection()  # the next run's handler connects ...
            transaction.set_autocommit(False)  # ... and leaves a transaction open
            seen["raw"] = connection.connection
            tidy_connections()
            seen["after"] = connection.connection
            connection.ensure_connection()
            seen["again"] = connection.connection
            tidy_connections()  # a sound connection (reopened): kept
            seen["kept"] = connection.connection is seen["again"]
        finally:
            connections.close_all()

    thread = threading.Thread(target=worker_thread)
    thread.start()
    thread.join(10)
    assert seen["raw"] is not None and seen["after"] is None, "closed: it would carry an open transaction on"
    assert seen["kept"]


def _kill_server_side(raw_pid: int) -> None:
    """End a connection from the server's side, as a restart or an idle timeout would."""
    from django.db import connections

    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            if other.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [raw_pid])
            else:
                cursor.execute(f"KILL {int(raw_pid)}")
    finally:
        other.close()


@pytest.mark.django_db(transaction=True)
def test_after_a_database_error_in_the_scheduler_a_worker_drops_the_connections_it_kept() -> None:
    """Without health checks: an outage the scheduler met may have killed them, and the next run would fail on one."""
    from django.db import OperationalError, connection, connections

    from django_anarchon.dbtrouble import DbTrouble

    seen: dict[str, Any] = {}

    def refused() -> None:
        raise OperationalError("server closed the connection unexpectedly")

    def worker_thread() -> None:
        try:
            connection.ensure_connection()
            kept = connection.connection
            tidy_connections()  # the end of a run
            check_kept_connections()  # the next run, at once, nothing happened meanwhile
            seen["kept"] = connection.connection is kept
            pid = None
            if connection.vendor != "sqlite":
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT pg_backend_pid()" if connection.vendor == "postgresql" else "SELECT CONNECTION_ID()"
                    )
                    pid = cursor.fetchone()[0]
            tidy_connections()  # the end of that run; then the server restarts ...
            if pid is not None:
                _kill_server_side(pid)
                time.sleep(0.2)
            # ... and a scheduler thread (on its own connection) meets the outage
            loop = DbTrouble("the scheduler loop", "i1", lambda: "default")
            outside = threading.Thread(target=lambda: loop.call(refused))
            outside.start()
            outside.join(10)
            check_kept_connections()  # the next run on this worker
            seen["dropped"] = connection.connection is None
            with connection.cursor() as cursor:  # its first query connects afresh
                cursor.execute("SELECT 1")
                seen["answer"] = cursor.fetchone()[0]
            tidy_connections()
            reopened = connection.connection
            check_kept_connections()  # no error since: kept again
            seen["kept_again"] = connection.connection is reopened
        except Exception as error:
            seen["error"] = error
        finally:
            connections.close_all()

    thread = threading.Thread(target=worker_thread)
    thread.start()
    thread.join(20)
    assert "error" not in seen, seen.get("error")
    assert seen["kept"] and seen["kept_again"], "no database error meanwhile: the connection is reused"
    assert seen["dropped"] and seen["answer"] == 1, "after the scheduler's database error: dropped, then reconnected"


@pytest.mark.django_db(transaction=True)
def test_with_health_checks_a_worker_idle_a_while_checks_its_connection_and_a_busy_one_does_not() -> None:
    """CONN_HEALTH_CHECKS: checked before a run after HEALTH_CHECK_IDLE_S idle, so a dropped connection is replaced."""
    from django.db import connection, connections

    seen: dict[str, Any] = {}

    def worker_thread() -> None:
        try:
            connection.ensure_connection()
            tidy_connections()  # the end of a run
            check_kept_connections()  # the next run, at once
            seen["busy_checks"] = connection.health_check_done is False
            if connection.vendor != "sqlite":
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT pg_backend_pid()" if connection.vendor == "postgresql" else "SELECT CONNECTION_ID()"
                    )
                    pid = cursor.fetchone()[0]
                tidy_connections()
                _kill_server_side(pid)
                time.sleep(0.2)
            workers_module._opened.idle_since -= workers_module.HEALTH_CHECK_IDLE_S  # as if idle that long
            check_kept_connections()
            seen["idle_checks"] = connection.health_check_done is False
            with connection.cursor() as cursor:  # the run's first query: pinged first, reconnected if dead
                cursor.execute("SELECT 1")
                seen["answer"] = cursor.fetchone()[0]
        except Exception as error:
            seen["error"] = error
        finally:
            connections.close_all()

    connection.settings_dict["CONN_HEALTH_CHECKS"] = True
    try:
        thread = threading.Thread(target=worker_thread)
        thread.start()
        thread.join(20)
    finally:
        connection.settings_dict["CONN_HEALTH_CHECKS"] = False
    assert "error" not in seen, seen.get("error")
    assert seen["busy_checks"] is False, "used a moment ago: no round trip to check it"
    assert seen["idle_checks"] is True and seen["answer"] == 1, "idle: checked, and a dropped connection replaced"


@pytest.mark.django_db(transaction=True)
def test_consecutive_runs_on_one_worker_share_its_database_connection(sched: Any) -> None:
    from django.db import connection

    seen: list[Any] = []

    def which_connection(ctx: Any) -> None:
        connection.ensure_connection()
        seen.append((threading.current_thread().name, connection.connection))

    sched.every("again", "10000d", which_connection)
    start(sched)
    for _ in range(3):
        sched.run_now("again")
        finished_before = len(seen)
        wait_for(lambda n=finished_before: len(seen) > n, 10, what="the run")  # type: ignore[misc]
        time.sleep(0.3)  # its end recorded: the worker is idle again
    threads = {name for name, _ in seen}
    assert len(threads) == 1, "one idle worker took every run"
    assert seen[0][1] is seen[1][1] is seen[2][1], "and kept its connection between them"


def test_a_thread_that_cannot_be_started_queues_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller keeps the run when submit raises: a task left queued would run it a second time later."""
    workers = Workers()
    ran: list[int] = []
    real_start = threading.Thread.start
    failing = [True]

    def refusing_start(self: threading.Thread) -> None:
        if failing[0]:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", refusing_start)
    with pytest.raises(RuntimeError):
        workers.submit(active(1), lambda run: ran.append(1))
    failing[0] = False
    workers.submit(active(2), lambda run: ran.append(2))
    wait_for(lambda: workers.idle == 1, 5, what="the thread to be idle again")
    time.sleep(0.05)
    assert ran == [2] and workers.started == 1
