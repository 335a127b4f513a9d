"""Parsing of durations: ``"500ms"``, ``"1h30m"``, numbers of seconds, ``timedelta``."""

from __future__ import annotations

import math
import re
from datetime import timedelta

_UNITS_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000, "ms": 1}
_ORDER = ["d", "h", "m", "s", "ms"]
# ASCII digits only: \d and float() would also take "١٠", "inf", "nan" and "1e999".
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_PART = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|d|h|m|s)\s*")
VALID_FORMS = (
    "a duration string such as '500ms', '10s', '5m', '1h', '1d' or '1h30m', "
    "a positive number of seconds, or a datetime.timedelta"
)
# The longest duration: a hundred years. Longer ones put slots and retention cut-offs out of
# the range of a datetime (year 9999) and fail only later, where they are used.
MAX_MS = 36_500 * _UNITS_MS["d"]


def parse_duration_ms(value: object) -> int:
    """Return ``value`` as a whole number of milliseconds, or raise ``ValueError``.

    The message of the ``ValueError`` says what was wrong, not who gave it; the
    callers wrap it with the job or setting name.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration; use {VALID_FORMS}")
    if isinstance(value, timedelta):
        ms = value / timedelta(milliseconds=1)
    elif isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a duration; use {VALID_FORMS}")
        ms = value * 1000
    elif isinstance(value, str):
        ms = _parse_string(value)
    else:
        raise ValueError(f"{value!r} (a {type(value).__name__}) is not a duration; use {VALID_FORMS}")
    if isinstance(ms, float) and not math.isfinite(ms):
        raise ValueError(f"{value!r} is too long to be a duration; use {VALID_FORMS}")
    if ms <= 0:
        raise ValueError(f"{value!r} is not positive; use {VALID_FORMS}")
    if ms > MAX_MS:
        raise ValueError(f"{value!r} is longer than the longest duration, {format_ms(MAX_MS)} (a hundred years)")
    if abs(ms - round(ms)) > 1e-6:
        raise ValueError(f"{value!r} is not a whole number of milliseconds (the smallest unit is 1ms)")
    return int(round(ms))


def _parse_string(text: str) -> float:
    pos = 0
    total = 0.0
    seen: list[str] = []
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"{text!r} is empty; use {VALID_FORMS}")
    if _NUMBER.fullmatch(stripped):
        return float(stripped) * 1000  # "30" or "1.5": seconds
    while pos < len(stripped):
        match = _PART.match(stripped, pos)
        if not match:
            raise ValueError(f"{text!r} is not a duration; use {VALID_FORMS}")
        number, unit = match.groups()
        if seen and _ORDER.index(unit) <= _ORDER.index(seen[-1]):
            raise ValueError(f"{text!r} is not a duration: units must appear once each, largest first (like '1h30m')")
        seen.append(unit)
        total += float(number) * _UNITS_MS[unit]
        pos = match.end()
    return total


def format_ms(ms: int) -> str:
    """Render milliseconds the way they are written in declarations, e.g. ``1h30m``."""
    if ms <= 0:
        return f"{ms}ms"
    out = []
    rest = ms
    for unit in _ORDER:
        size = _UNITS_MS[unit]
        if rest >= size:
            count, rest = divmod(rest, size)
            out.append(f"{count}{unit}")
    return "".join(out)
