"""The ``ANARCHON`` settings dict: defaults, accepted forms, errors, and ``override_settings``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_anarchon import AnarchonError, SettingsError
from django_anarchon.conf import DEFAULTS, AnarchonSettings, get_settings, parse, problems


def settings_error(raw: Any, *fragments: str) -> SettingsError:
    with pytest.raises(SettingsError) as caught:
        parse(raw)
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, AnarchonError)
    for fragment in fragments:
        assert fragment in str(error), f"{fragment!r} not in {str(error)!r}"
    return error


def test_defaults() -> None:
    for raw in (None, {}):
        parsed = parse(raw)
        assert parsed == AnarchonSettings(
            lease_ttl=30.0,
            poll_interval=1.0,
            shutdown_grace=30.0,
            instance_id=None,
            data=None,
            max_workers=16,
            history_retention=7 * 86_400.0,
            max_attempts=10,
        )
        assert problems(parsed) == []
    assert set(DEFAULTS) == {
        "LEASE_TTL",
        "POLL_INTERVAL",
        "SHUTDOWN_GRACE",
        "INSTANCE_ID",
        "DATA",
        "MAX_WORKERS",
        "HISTORY_RETENTION",
        "MAX_ATTEMPTS",
    }


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(45, 45.0), (2.5, 2.5), ("45s", 45.0), ("1m30s", 90.0), ("500ms", 0.5), (timedelta(minutes=2), 120.0)],
)
def test_durations_as_numbers_strings_and_timedeltas(value: object, seconds: float) -> None:
    parsed = parse({"LEASE_TTL": value, "POLL_INTERVAL": value, "SHUTDOWN_GRACE": value, "HISTORY_RETENTION": value})
    assert parsed.lease_ttl == parsed.poll_interval == parsed.shutdown_grace == parsed.history_retention == seconds


def test_other_values() -> None:
    parsed = parse({"INSTANCE_ID": "web-1", "DATA": {"ville": "Zürich"}, "MAX_WORKERS": 4, "HISTORY_RETENTION": None})
    assert parsed.instance_id == "web-1"
    assert parsed.data == {"ville": "Zürich"}
    assert parsed.max_workers == 4
    assert parsed.history_retention is None


@pytest.mark.parametrize("grace", [0, 0.0, timedelta(0)])
def test_shutdown_grace_zero_means_do_not_wait(grace: object) -> None:
    assert parse({"SHUTDOWN_GRACE": grace}).shutdown_grace == 0.0


@pytest.mark.parametrize("grace", [False, True, -1, None, "soon"])
def test_bad_shutdown_grace(grace: object) -> None:
    settings_error({"SHUTDOWN_GRACE": grace}, "ANARCHON['SHUTDOWN_GRACE']", repr(grace))


def test_derived_values() -> None:
    parsed = parse({"LEASE_TTL": 30, "POLL_INTERVAL": 1})
    assert parsed.renew_every == 1.0
    assert parsed.fence_after == 24.0
    assert parse({"LEASE_TTL": 3, "POLL_INTERVAL": 1}).renew_every == 1.0
    assert parse({"LEASE_TTL": 30, "POLL_INTERVAL": "10ms"}).renew_every == 0.05


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("LEASE_TIL", "LEASE_TTL"),
        ("POLL_INTERVALS", "POLL_INTERVAL"),
        ("MAX_WORKER", "MAX_WORKERS"),
        ("lease_ttl", "LEASE_TTL"),  # settings are upper case
        ("Max_Workers", "MAX_WORKERS"),
    ],
)
def test_unknown_key_suggests_the_close_match(key: str, suggestion: str) -> None:
    error = settings_error({key: 3}, f"ANARCHON[{key!r}]", "unknown setting", f"Did you mean {suggestion!r}?")
    assert error.key == key
    assert "Valid keys are: LEASE_TTL, POLL_INTERVAL" in str(error)


def test_unknown_key_without_a_close_match() -> None:
    error = settings_error({"FLUX_CAPACITOR": 1}, "ANARCHON['FLUX_CAPACITOR']", "unknown setting", "Valid keys")
    assert "Did you mean" not in str(error)
    settings_error({1: 2}, "ANARCHON[1]", "unknown setting")


def test_settings_must_be_a_dict() -> None:
    settings_error(["LEASE_TTL", 30], "ANARCHON: must be a dict, got list")
    settings_error("LEASE_TTL=30", "must be a dict, got str")


@pytest.mark.parametrize("ttl", [0, -1, "0s", "-5s", timedelta(0), "inf", float("inf"), True, None, "soon"])
def test_bad_lease_ttl(ttl: object) -> None:
    settings_error({"LEASE_TTL": ttl}, "ANARCHON['LEASE_TTL']", repr(ttl))


@pytest.mark.parametrize("poll", [0, -0.5, "abc", "10x", None, False, float("nan"), "0.1ms"])
def test_bad_poll_interval(poll: object) -> None:
    settings_error({"POLL_INTERVAL": poll}, "ANARCHON['POLL_INTERVAL']", repr(poll))


@pytest.mark.parametrize("workers", [0, -1, True, False, "4", 4.0, None])
def test_bad_max_workers(workers: object) -> None:
    settings_error({"MAX_WORKERS": workers}, "ANARCHON['MAX_WORKERS']", "at least 1", repr(workers))


@pytest.mark.parametrize("instance_id", ["", "   ", 5, ["web-1"], "x" * 201])
def test_bad_instance_id(instance_id: object) -> None:
    settings_error({"INSTANCE_ID": instance_id}, "ANARCHON['INSTANCE_ID']")


@pytest.mark.parametrize("data", [{1, 2}, {"at": object()}, float("nan"), {"x": float("inf")}, b"raw"])
def test_data_must_be_json(data: object) -> None:
    settings_error({"DATA": data}, "ANARCHON['DATA']", "JSON-serialisable")


@pytest.mark.parametrize("data", [1e16, {"x": [-2.5e300]}])
def test_data_with_a_float_that_postgresql_gives_back_as_an_int_is_refused(data: object) -> None:
    settings_error({"DATA": data}, "ANARCHON['DATA']", "would come back from PostgreSQL as an integer")


@pytest.mark.parametrize("retention", [0, -1, "never", False])
def test_bad_history_retention(retention: object) -> None:
    settings_error({"HISTORY_RETENTION": retention}, "ANARCHON['HISTORY_RETENTION']", repr(retention))


@pytest.mark.parametrize(
    ("lease", "poll", "flagged"),
    [
        (30, 1, False),
        (3, 1, False),  # exactly three polls is enough
        (0.6, 0.2, False),  # ... also when 3 * 0.2 is 0.6000000000000001 in floats
        ("900ms", "300ms", False),
        (2.9, 1, True),
        (2, 1, True),
        (1, 1, True),
        (1, 5, True),  # a poll longer than the lease
        ("10s", "1m", True),
    ],
)
def test_problems_flag_a_lease_shorter_than_three_polls(lease: object, poll: object, flagged: bool) -> None:
    found = problems(parse({"LEASE_TTL": lease, "POLL_INTERVAL": poll}))
    if flagged:
        [message] = found
        assert "LEASE_TTL" in message and "three POLL_INTERVALs" in message
    else:
        assert found == []


def test_problem_message_shows_the_values() -> None:
    [message] = problems(parse({"LEASE_TTL": 1, "POLL_INTERVAL": 5}))
    assert "LEASE_TTL (1s)" in message
    assert "(15s)" in message


def test_get_settings_follows_override_settings() -> None:
    base = get_settings()
    assert base is get_settings()  # parsed once
    assert base.lease_ttl == parse(settings.ANARCHON).lease_ttl
    with override_settings(ANARCHON={"LEASE_TTL": "1m", "POLL_INTERVAL": "5s", "MAX_WORKERS": 2}):
        inside = get_settings()
        assert (inside.lease_ttl, inside.poll_interval, inside.max_workers) == (60.0, 5.0, 2)
        with override_settings(ANARCHON=None):
            assert get_settings() == parse(None)
        assert get_settings() == inside
    assert get_settings() == base


def test_get_settings_raises_on_a_bad_override() -> None:
    with override_settings(ANARCHON={"LEASE_TIL": 3}), pytest.raises(SettingsError, match="LEASE_TTL"):
        get_settings()
    assert get_settings().lease_ttl == parse(settings.ANARCHON).lease_ttl


def test_other_setting_changes_keep_the_cache() -> None:
    base = get_settings()
    with override_settings(TIME_ZONE="Europe/Paris"):
        assert get_settings() is base


def test_nothing_is_written_into_django_settings() -> None:
    raw = {"LEASE_TTL": "1m"}
    with override_settings(ANARCHON=raw):
        before = dict(vars(settings._wrapped))
        parsed = get_settings()
        assert parsed.poll_interval == DEFAULTS["POLL_INTERVAL"]  # a default, read but not stored
        assert raw == {"LEASE_TTL": "1m"}
        assert settings.ANARCHON is raw
        assert dict(vars(settings._wrapped)) == before


def test_a_negative_shutdown_grace_is_called_negative_and_zero_is_offered() -> None:
    with pytest.raises(SettingsError) as caught:
        parse({"SHUTDOWN_GRACE": -1})
    assert (
        str(caught.value)
        == "ANARCHON['SHUTDOWN_GRACE']: -1 is negative; use 0 (hand over at once) or a positive duration"
    )


def test_bad_data_names_the_setting_once() -> None:
    with pytest.raises(SettingsError) as caught:
        parse({"DATA": {"when": (1, 2)}})
    message = str(caught.value)
    assert message.startswith("ANARCHON['DATA']: the value must be JSON-serialisable") and message.count("DATA") == 1
    assert "the tuple at ['when'] would come back as a list" in message


@pytest.mark.parametrize("attempts", [0, -1, 1.5, True, "3"])
def test_bad_max_attempts(attempts: object) -> None:
    settings_error({"MAX_ATTEMPTS": attempts}, "ANARCHON['MAX_ATTEMPTS']", repr(attempts))


def test_max_attempts_none_means_no_limit() -> None:
    assert parse({"MAX_ATTEMPTS": None}).max_attempts is None
