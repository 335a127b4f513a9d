"""Durations: the strings, numbers and timedeltas that intervals, timeouts and settings accept."""

from __future__ import annotations

from datetime import timedelta

import pytest

from django_anarchon.durations import VALID_FORMS, format_ms, parse_duration_ms


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("500ms", 500),
        ("10s", 10_000),
        ("5m", 300_000),
        ("1h", 3_600_000),
        ("1d", 86_400_000),
        ("1h30m", 5_400_000),
        ("1d2h3m4s5ms", 93_784_005),
        ("1.5s", 1_500),
        ("0.5m", 30_000),
        ("1h 30m", 5_400_000),
        ("  10s  ", 10_000),
        ("10 s", 10_000),
        ("0h30m", 1_800_000),
        ("30", 30_000),  # a string of digits is a number of seconds
        ("1.5", 1_500),
        ("0.001", 1),
        (1, 1_000),
        (30, 30_000),
        (0.5, 500),
        (0.001, 1),
        (0.1 + 0.2, 300),  # float noise below a millisecond is not "sub-millisecond"
        (86_400 * 365, 31_536_000_000),
        (timedelta(minutes=2), 120_000),
        (timedelta(milliseconds=1), 1),
        (timedelta(days=1, seconds=1), 86_401_000),
    ],
)
def test_accepted_forms(value: object, expected: int) -> None:
    result = parse_duration_ms(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (0, "not positive"),
        (0.0, "not positive"),
        ("0", "not positive"),
        ("0s", "not positive"),
        ("0ms", "not positive"),
        (-1, "not positive"),
        (-0.5, "not positive"),
        (timedelta(0), "not positive"),
        (timedelta(seconds=-5), "not positive"),
        ("", "empty"),
        ("   ", "empty"),
        ("abc", "not a duration"),
        ("10x", "not a duration"),
        ("10S", "not a duration"),
        ("1H", "not a duration"),
        ("s", "not a duration"),
        ("1h30", "not a duration"),
        ("-5s", "not a duration"),
        ("-5", "not a duration"),
        ("+5", "not a duration"),
        (".5s", "not a duration"),
        ("5.s", "not a duration"),
        ("1.5.5s", "not a duration"),
        ("1e3", "not a duration"),
        ("1_000", "not a duration"),
        ("١٠s", "not a duration"),  # Arabic-Indic digits: \d would take them
        ("١٠", "not a duration"),
        ("inf", "not a duration"),
        ("nan", "not a duration"),
        ("infinity", "not a duration"),
        ("1m1h", "largest first"),
        ("1h1h", "largest first"),
        ("1s500ms1s", "largest first"),
        ("30s1m", "largest first"),
        (True, "not a duration"),
        (False, "not a duration"),
        (None, "NoneType"),
        ([10], "list"),
        ({"s": 10}, "dict"),
        (b"10s", "bytes"),
        (float("nan"), "not a duration"),
        (float("inf"), "not a duration"),
        (float("-inf"), "not a duration"),
        ("9" * 400 + "s", "too long"),  # float("9" * 400) is inf
        ("9" * 400, "too long"),
        ("0.5ms", "whole number of milliseconds"),
        ("1.0005s", "whole number of milliseconds"),
        ("0.0001", "whole number of milliseconds"),
        (0.0005, "whole number of milliseconds"),
        (1.0000001, "whole number of milliseconds"),
        (timedelta(microseconds=500), "whole number of milliseconds"),
        (timedelta(seconds=1, microseconds=1), "whole number of milliseconds"),
        ("5000000d", "longer than the longest duration, 36500d (a hundred years)"),
        ("36500d1ms", "longer than the longest duration"),
        (1e30, "longer than the longest duration"),
        (timedelta(days=40_000), "longer than the longest duration"),
    ],
)
def test_rejected_values_raise_value_error_saying_why(value: object, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_duration_ms(value)
    message = str(caught.value)
    assert says in message
    assert repr(value) in message


@pytest.mark.parametrize("value", ["abc", "10x", "", None, 0, -1, True, "inf"])
def test_rejections_say_what_is_valid(value: object) -> None:
    with pytest.raises(ValueError, match="use a duration string") as caught:
        parse_duration_ms(value)
    assert VALID_FORMS in str(caught.value)


def test_the_longest_duration_is_a_hundred_years_and_exact() -> None:
    assert parse_duration_ms("36500d") == 36_500 * 86_400_000
    assert parse_duration_ms(timedelta(days=36_500)) == 36_500 * 86_400_000
    assert parse_duration_ms(36_500 * 86_400) == 36_500 * 86_400_000
    assert parse_duration_ms(timedelta(days=36_499, seconds=86_399, milliseconds=999)) == 36_500 * 86_400_000 - 1


def test_only_value_error_escapes_for_strings() -> None:
    """A bad string is a ValueError (never OverflowError): callers wrap only ValueError."""
    for text in ["inf", "-inf", "nan", "1e999", "9" * 400, "9" * 400 + "d", "1" + "0" * 320 + "ms"]:
        with pytest.raises(ValueError):
            parse_duration_ms(text)


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (1, "1ms"),
        (999, "999ms"),
        (1_000, "1s"),
        (1_500, "1s500ms"),
        (60_000, "1m"),
        (90_000, "1m30s"),
        (3_600_000, "1h"),
        (5_400_000, "1h30m"),
        (86_400_000, "1d"),
        (86_400_001, "1d1ms"),
        (90_061_001, "1d1h1m1s1ms"),
        (7 * 86_400_000, "7d"),
    ],
)
def test_format_ms(ms: int, text: str) -> None:
    assert format_ms(ms) == text
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("ms", [1, 7, 999, 1_001, 59_999, 61_000, 3_599_999, 86_399_999, 123_456_789, 10**12 + 3])
def test_format_ms_round_trips(ms: int) -> None:
    assert parse_duration_ms(format_ms(ms)) == ms


@pytest.mark.parametrize("value", ["500ms", "10s", "5m", "1h", "1d", "1h30m", 2.5, timedelta(hours=2, seconds=3)])
def test_parse_format_parse_is_stable(value: object) -> None:
    ms = parse_duration_ms(value)
    assert parse_duration_ms(format_ms(ms)) == ms


def test_format_ms_of_non_positive_values() -> None:
    assert format_ms(0) == "0ms"
    assert format_ms(-5) == "-5ms"
