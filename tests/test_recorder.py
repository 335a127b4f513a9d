"""Recording how runs ended when the database refuses what a handler left behind.

A handler's error text is whatever it raised: NUL (refused by PostgreSQL), a lone
surrogate (no driver can encode it), a 4-byte character in a MySQL ``utf8mb3``
table. None of it may stall the instance: the text is made storable, or the end
is recorded degraded, or given up and logged, and every other run's end is still
recorded.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.db import DataError, connection

from django_anarchon import Context, Scheduler, store
from django_anarchon.models import Run
from tests.conftest import finished, start, vendor, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_storable_text_escapes_nul_and_lone_surrogates_and_keeps_the_rest() -> None:
    assert store.storable_text("remote answered: ok\x00\x00") == "remote answered: ok\\x00\\x00"
    assert store.storable_text("half \ud83d a pair") == "half \\ud83d a pair"
    assert store.storable_text("Zürich 😀 ✓") == "Zürich 😀 ✓"


def test_an_unstorable_error_message_is_recorded_escaped_and_stalls_nothing(sched: Scheduler) -> None:
    """NUL and a lone surrogate: on every database the end is recorded, and the other jobs' ends too."""

    def unstorable(ctx: Context) -> None:
        raise ValueError("remote answered: ok\x00\x00 \ud800")

    sched.every("unstorable", "300ms", unstorable, overlap="allow")
    sched.every("fine", "300ms", lambda ctx: None, overlap="allow")
    start(sched, "recorder-test")
    runs = finished("unstorable", 3)
    assert all(r.status == "failed" for r in runs)
    assert runs[0].error_message == "remote answered: ok\\x00\\x00 \\ud800"
    assert "\\x00" in runs[0].traceback
    assert all(r.status == "success" for r in finished("fine", 3))


def test_a_four_byte_character_in_a_utf8mb3_table_is_recorded_escaped(sched: Scheduler) -> None:
    if vendor() != "mariadb":
        pytest.skip("MySQL/MariaDB only: only their utf8mb3 tables refuse 4-byte characters")
    table = connection.ops.quote_name(Run._meta.db_table)
    columns = ["error_message", "traceback"]
    with connection.cursor() as cursor:
        for column in columns:
            cursor.execute(f"ALTER TABLE {table} MODIFY {column} longtext CHARACTER SET utf8mb3 NOT NULL")
    try:

        def emoji(ctx: Context) -> None:
            raise ValueError("deploy failed 😀")

        sched.every("emoji", "300ms", emoji, overlap="allow")
        sched.every("fine", "300ms", lambda ctx: None, overlap="allow")
        sched.start(instance_id="recorder-test")
        assert sched.wait_started(10)
        [run, *_] = finished("emoji", 2)
        assert run.status == "failed" and run.error_type == "ValueError"
        assert run.error_message == "deploy failed \\U0001f600"
        assert all(r.status == "success" for r in finished("fine", 2))
    finally:
        sched.stop(timeout=2)
        with connection.cursor() as cursor:
            for column in columns:
                cursor.execute(f"ALTER TABLE {table} MODIFY {column} longtext CHARACTER SET utf8mb4 NOT NULL")


def test_an_end_refused_even_as_ascii_is_recorded_without_its_message_then_given_up(
    sched: Scheduler, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The degraded forms, in order: the texts escaped to ASCII, then the status and error type alone."""
    real_finish = store.finish
    refusals: list[dict[str, Any]] = []

    def picky_finish(run_id: int, **kwargs: Any) -> bool:
        if kwargs.get("error_message", "").startswith("["):
            return real_finish(run_id, **kwargs)  # the bare form: written
        refusals.append(kwargs)
        raise DataError("value refused")

    monkeypatch.setattr(store, "finish", picky_finish)

    def broken(ctx: Context) -> None:
        raise RuntimeError("anything at all")

    sched.every("picky", "10000d", broken)
    sched.every("later", "10000d", lambda ctx: None)
    start(sched, "recorder-test")
    with caplog.at_level(logging.WARNING, logger="django_anarchon"):
        sched.run_now("picky")
        [run] = finished("picky", 1)
    assert (run.status, run.error_type, run.traceback) == ("failed", "RuntimeError", "")
    assert run.error_message == "[the error message could not be stored: DataError]"
    assert [r["error_message"] for r in refusals] == ["anything at all", "anything at all"], "as given, then ASCII"
    assert "recorded it without its error message" in caplog.text

    # Refused in every form: given up at ERROR, the run left for a takeover, the instance carries on.
    monkeypatch.setattr(store, "finish", lambda run_id, **kwargs: (_ for _ in ()).throw(DataError("never")))
    with caplog.at_level(logging.ERROR, logger="django_anarchon"):
        again = sched.run_now("picky")
        wait_for(lambda: "Could not record the end of picky" in caplog.text, 10, what="the ERROR line")
    assert Run.objects.get(pk=again.pk).status == "running", "nothing written: a takeover will run it again"
    monkeypatch.setattr(store, "finish", real_finish)
    sched.run_now("later")
    assert finished("later", 1)[0].status == "success", "the instance records later ends as before"


def test_an_end_whose_write_hangs_is_said_while_it_waits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A blackholed database holds the end's UPDATE, which raises nothing: the recorder's wait is said
    by the watchdog's thread (dbtrouble.say_waiting) as the loop's is (helper 34)."""
    import threading
    import time

    from django_anarchon import dbtrouble
    from django_anarchon.recorder import Ending, Recorder

    monkeypatch.setattr(dbtrouble, "SLOW_CALL_S", 0.1)
    release = threading.Event()

    def hanging(ids: Any, **kwargs: Any) -> set[int]:
        release.wait(10)
        return set(ids)

    monkeypatch.setattr(store, "finish_many", hanging)
    recorder = Recorder("token", "hang-rec", 30.0)
    ending = Ending(run=Run(id=1, job="j", slot=1), lease_until=lambda: time.monotonic() + 30, status="success")
    caplog.set_level(logging.WARNING, logger="django_anarchon")
    recorder.submit(ending)
    try:
        time.sleep(0.3)
        dbtrouble.say_waiting()
        assert "The database has not answered recording run endings on hang-rec" in caplog.text
    finally:
        release.set()
        assert ending.done.wait(5) and ending.result is True
        recorder.stop()


def test_hurry_cuts_short_the_wait_before_an_end_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """An end past its lease that the database refused is tried again after a back-off; hurry() (the loop's
    poll has gone through and found the run's lease running out) tries it again at once, so that it races a
    backup's takeover as early as the database answers."""
    import threading
    import time

    from django.db import OperationalError

    from django_anarchon import dbtrouble
    from django_anarchon import recorder as recorder_module
    from django_anarchon.recorder import Ending, Recorder

    monkeypatch.setattr(dbtrouble.random, "uniform", lambda low, high: 1.0)  # back-offs 0.1, 0.2, 0.4, 0.8, 1.6 s
    monkeypatch.setattr(recorder_module, "OUTLIVED_RETRY_S", 5.0)
    tries: list[float] = []
    up = threading.Event()

    def finish_many(ids: Any, **kwargs: Any) -> set[int]:
        tries.append(time.monotonic())
        if not up.is_set():
            raise OperationalError("server closed the connection unexpectedly")
        return set(ids)

    monkeypatch.setattr(store, "finish_many", finish_many)
    recorder = Recorder("token", "hurry-rec", 1.0)
    ending = Ending(run=Run(id=1, job="j", slot=1), lease_until=lambda: time.monotonic() - 1, status="success")
    recorder.submit(ending)
    try:
        wait_for(lambda: len(tries) >= 5, 10, what="five refused tries")
        up.set()
        hurried = time.monotonic()
        recorder.hurry()
        assert ending.done.wait(0.5), "written at once, not after the 1.6 s back-off"
        assert ending.result is True and tries[-1] - hurried < 0.5
    finally:
        up.set()
        recorder.stop()
