"""A thread's database-error policy: back-off bounds, one line per outage, back after a clean turn."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from django.db import OperationalError

from django_anarchon.dbtrouble import FAILED, DbTrouble


def refused() -> None:
    raise OperationalError("Can't connect to server")


def test_the_back_off_doubles_from_a_tenth_of_a_second_to_at_most_about_two(caplog: pytest.LogCaptureFixture) -> None:
    trouble = DbTrouble("the scheduler loop", "i1-backoff", lambda: "default")
    waits = []
    for _ in range(12):
        assert trouble.call(refused) is FAILED
        trouble.end_turn()
        waits.append(trouble.backoff)
    assert 0.08 <= waits[0] <= 0.12  # 0.1 s, +-20 %
    for before, after in zip(waits, waits[1:], strict=False):
        doubled = min(2 * before, 2.0)  # doubled up to 2 s, then +-20 %
        assert doubled * 0.8 <= after <= doubled * 1.2, waits
    # A second-by-second scheduler is claiming again within ~2.5 s of the database's return.
    assert all(wait <= 2.0 * 1.2 for wait in waits), waits
    assert max(waits) >= 2.0 * 0.8, waits
    assert caplog.text.count("Database error on i1-backoff in the scheduler loop") == 1


def test_a_clean_turn_ends_the_outage_once_and_clears_the_back_off(caplog: pytest.LogCaptureFixture) -> None:
    trouble = DbTrouble("lease renewals", "i1", lambda: "default")
    for _ in range(3):
        trouble.call(refused)
        trouble.end_turn()
    assert trouble.backoff > 0
    assert trouble.call(lambda: 42) == 42
    trouble.end_turn()
    trouble.end_turn()
    assert trouble.backoff == 0.0 and trouble.down_since is None
    assert caplog.text.count("Database is back on i1 (seen by lease renewals)") == 1


def test_a_call_the_database_was_slow_to_answer_is_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen server raises nothing: the call just waits. Once it returns, the log says how long it took."""
    from django_anarchon import dbtrouble

    monkeypatch.setattr(dbtrouble, "SLOW_CALL_S", 0.05)
    caplog.set_level(logging.WARNING, logger="django_anarchon")
    trouble = DbTrouble("the loop", "slow-test", lambda: "default")
    assert trouble.call(lambda: "quick") == "quick"
    assert not caplog.records
    assert trouble.call(lambda: time.sleep(0.1) or "late") == "late"
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("The database took 0.1s to answer the loop on slow-test"), line


def test_a_call_still_waiting_for_the_database_is_logged_while_it_waits(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blackholed database: the loop's query hangs and its thread cannot log (helper 32: 30 s of
    silence, then "took 29.9s"). The watchdog's thread, which needs no query, says it once per call."""
    from django_anarchon import dbtrouble

    monkeypatch.setattr(dbtrouble, "SLOW_CALL_S", 0.5)
    caplog.set_level(logging.WARNING, logger="django_anarchon")
    trouble = DbTrouble("the loop", "hang-test", lambda: "default")
    release = threading.Event()
    caller = threading.Thread(target=trouble.call, args=(release.wait,))
    caller.start()
    try:
        dbtrouble.say_waiting()  # not yet: under SLOW_CALL_S
        assert not caplog.records
        time.sleep(0.6)
        dbtrouble.say_waiting()
        dbtrouble.say_waiting()  # said once per call
        [line] = [r.getMessage() for r in caplog.records]
        assert line.startswith("The database has not answered the loop on hang-test for "), line
        assert line.endswith("still waiting"), line
    finally:
        release.set()
        caller.join(5)
    assert "s to answer the loop on hang-test" in caplog.text, "and how long it took, once it answered"
    caplog.clear()
    time.sleep(0.6)
    dbtrouble.say_waiting()  # nothing under way any more
    assert not caplog.records


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_outage_is_logged_once_per_instance_however_many_of_its_threads_meet_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each thread logged its own start and end: 3-4 lines at the start of one outage and 4 at its end
    (helper 29). The first thread to meet it logs its start; its end is logged once a thread gets
    through after meeting its latest error."""
    loop, keeper, recorder = (DbTrouble(what, "i-once", lambda: "default") for what in ("loop", "keeper", "recorder"))
    for trouble in (loop, recorder, loop, keeper):
        trouble.call(refused)
        trouble.end_turn()
    assert warnings(caplog) == ["Database error on i-once in loop (OperationalError: Can't connect to server); "
                                "retrying with backoff"]  # fmt: skip
    loop.call(lambda: None)
    loop.end_turn()
    assert len(warnings(caplog)) == 1, "the keeper met it after the loop's last error: it may still meet it"
    keeper.call(lambda: None)
    keeper.end_turn()
    [_, back] = warnings(caplog)
    assert back.startswith("Database is back on i-once (seen by keeper) after ")
    recorder.call(lambda: None)
    recorder.end_turn()
    assert len(warnings(caplog)) == 2, "ended once"
    # Another instance's outage is its own.
    other = DbTrouble("loop", "i-other", lambda: "default")
    other.call(refused)
    assert warnings(caplog)[-1].startswith("Database error on i-other in loop")


def test_a_thread_gone_idle_during_the_outage_holds_back_neither_its_end_nor_the_next_one(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper met the outage last and then had no run left to renew: it asks nothing more. Its
    end was never logged, and the next outage was logged at DEBUG only (helper 31)."""
    from django_anarchon import dbtrouble

    monkeypatch.setattr(dbtrouble, "STALE_S", 0.05)
    monkeypatch.setattr(dbtrouble, "AFTERSHOCK_S", 0.0)
    loop, keeper = DbTrouble("loop", "i-idle", lambda: "default"), DbTrouble("keeper", "i-idle", lambda: "default")
    loop.call(refused)
    loop.end_turn()
    keeper.call(refused)  # and then nothing more to renew
    loop.end_turn()
    assert len(warnings(caplog)) == 1, "the keeper met it a moment ago"
    time.sleep(0.1)
    loop.end_turn()
    assert warnings(caplog)[-1].startswith("Database is back on i-idle (seen by loop)")
    loop.call(refused)  # the next outage
    assert warnings(caplog)[-1].startswith("Database error on i-idle in loop")


def test_a_dead_connection_met_just_after_the_outage_is_no_new_outage_unless_it_goes_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart each thread's kept connection fails once, at its first use: the recorder's
    could be the first time it met the outage, seconds after the loop had seen it end."""
    from django_anarchon import dbtrouble

    loop, recorder = (
        DbTrouble("loop", "i-after", lambda: "default"),
        DbTrouble("recorder", "i-after", lambda: "default"),
    )
    loop.call(refused)
    loop.end_turn()
    loop.end_turn()
    assert len(warnings(caplog)) == 2  # the outage: its start, its end
    recorder.call(refused)  # its connection died with the outage
    recorder.end_turn()
    recorder.end_turn()
    assert len(warnings(caplog)) == 2, warnings(caplog)
    monkeypatch.setattr(dbtrouble, "AFTERSHOCK_S", 0.05)
    recorder.call(refused)
    time.sleep(0.1)
    recorder.call(refused)  # still failing past the aftershock window: an outage after all
    recorder.end_turn()
    recorder.end_turn()
    assert [w.split(" (")[0] for w in warnings(caplog)[2:]] == ["Database error on i-after in recorder",
                                                                  "Database is back on i-after"]  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_break_off_makes_a_statement_waiting_on_another_thread_fail_at_once() -> None:
    """What a fenced handler's save_progress() relies on when the server stops answering: the statement
    waiting on the connection is broken off from another thread (PostgreSQL, MariaDB); SQLite's wait for
    a lock is bounded instead (sqlite_wait)."""
    import sqlite3

    from django.db import connection, connections

    from django_anarchon.dbtrouble import break_off, socket_of, sqlite_wait
    from tests.conftest import end_server_sessions, server_session, vendor

    waited: list[float] = []
    errors: list[BaseException] = []
    ready = threading.Event()
    sockets: list[int | None] = []
    backends: list[int | None] = []

    def wait_on_the_database() -> None:
        mine = connections["default"]
        sockets.append(socket_of(mine))
        backends.append(server_session(mine))
        began = time.monotonic()
        try:
            if vendor() == "sqlite":
                with sqlite_wait(mine, 0.5), mine.cursor() as cursor:
                    ready.set()
                    cursor.execute("UPDATE django_anarchon_jobstate SET schedule = schedule")
            else:
                with mine.cursor() as cursor:
                    ready.set()
                    cursor.execute("SELECT pg_sleep(20)" if vendor() == "postgresql" else "SELECT SLEEP(20)")
        except Exception as error:  # noqa: BLE001 - what it raises is the point
            errors.append(error)
        finally:
            waited.append(time.monotonic() - began)
            mine.close()

    locker = None
    if vendor() == "sqlite":
        locker = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # another process's write lock: the UPDATE waits for it
    thread = threading.Thread(target=wait_on_the_database)
    thread.start()
    try:
        assert ready.wait(10)
        time.sleep(0.3)
        if sockets[0] is not None:
            break_off(sockets[0])
        thread.join(10)
    finally:
        if locker is not None:
            locker.rollback()
            locker.close()
        end_server_sessions(backends)
    assert errors and isinstance(errors[0], OperationalError), errors
    assert waited[0] < 5, f"waited {waited[0]:.1f}s for a statement that should have been broken off"
    assert (sockets[0] is None) == (vendor() == "sqlite")
    if vendor() == "sqlite":
        assert "locked" in str(errors[0])
        with sqlite_wait(connection, 0.5), connection.cursor() as cursor:
            pass
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout")
            assert cursor.fetchone()[0] == 30_000, "the configured busy timeout is put back"
