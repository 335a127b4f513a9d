"""A thread's database-error policy: back-off bounds, one line per outage, back after a clean turn."""

from __future__ import annotations

import logging
import time

import pytest
from django.db import OperationalError

from django_anarchon.dbtrouble import FAILED, DbTrouble


def refused() -> None:
    raise OperationalError("Can't connect to server")


def test_the_back_off_doubles_from_a_tenth_of_a_second_to_at_most_about_two(caplog: pytest.LogCaptureFixture) -> None:
    trouble = DbTrouble("the scheduler loop", "i1", lambda: "default")
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
    assert caplog.text.count("Database error on i1 in the scheduler loop") == 1


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
    assert caplog.text.count("Database is back on i1 for lease renewals") == 1


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
