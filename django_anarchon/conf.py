"""The ``ANARCHON`` settings dict, read lazily and validated.

Nothing is written into ``django.conf.settings``; ``override_settings`` works
because the parsed value is dropped whenever Django reports a settings change.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .durations import parse_duration_ms
from .exceptions import DataNotSerializableError, SettingsError

DEFAULTS: dict[str, Any] = {
    "LEASE_TTL": 30.0,
    "POLL_INTERVAL": 1.0,
    "SHUTDOWN_GRACE": 30.0,
    "INSTANCE_ID": None,
    "DATA": None,
    "MAX_WORKERS": 16,
    "HISTORY_RETENTION": 7 * 86_400.0,
    "MAX_ATTEMPTS": 10,
}


@dataclass(frozen=True)
class AnarchonSettings:
    """The parsed settings. Durations are in seconds."""

    lease_ttl: float
    poll_interval: float
    shutdown_grace: float
    instance_id: str | None
    data: Any
    max_workers: int
    history_retention: float | None
    max_attempts: int | None = 10

    @functools.cached_property  # read for every run held: worked out once
    def renew_every(self) -> float:
        """How often a runner renews its leases: a third of the TTL, and at least every poll.

        Renewing often is what lets a run learn quickly that it was replaced,
        taken over or fenced; it costs one UPDATE per turn for all runs.
        """
        return min(self.lease_ttl / 3, max(self.poll_interval, 0.05))

    @functools.cached_property
    def heartbeat_every(self) -> float:
        """How often an instance says it lives (and measures the database clock): a third of the TTL,
        at least every poll, at most every 10 s. An instance silent for three of these counts as gone."""
        return min(10.0, max(self.lease_ttl / 3, self.poll_interval))

    @functools.cached_property
    def fence_after(self) -> float:
        """Seconds after a committed renewal at which a runner gives its runs up.

        Four fifths of the TTL: the lease itself lasts at least the TTL from the
        moment the renewal was sent, so the runner stops before anyone else may
        start.
        """
        return self.lease_ttl * 0.8


_cache: AnarchonSettings | None = None


def get_settings() -> AnarchonSettings:
    """The current settings, parsed once per settings change."""
    global _cache
    if _cache is None:
        _cache = parse(getattr(django_settings, "ANARCHON", None))
    return _cache


@receiver(setting_changed)
def _reset(setting: str, **kwargs: Any) -> None:
    global _cache
    if setting == "ANARCHON":
        _cache = None


def problems(settings: AnarchonSettings) -> list[str]:
    """Combinations of valid values that would break the guarantees (also system checks)."""
    found = []
    # Compared in whole milliseconds: in float seconds 3 * 0.2 > 0.6.
    if round(settings.lease_ttl * 1000) < 3 * round(settings.poll_interval * 1000):
        found.append(
            f"LEASE_TTL ({settings.lease_ttl:g}s) must be at least three POLL_INTERVALs "
            f"({3 * settings.poll_interval:g}s): a backup notices an expired lease only when it polls, "
            "and a runner must renew several times within one lease"
        )
    return found


def check_json(value: Any, where: str) -> Any:
    """Raise :class:`DataNotSerializableError` unless ``value`` survives a JSON round trip unchanged.

    Besides what ``json.dumps`` refuses, that rules out what it would silently
    change (a tuple comes back as a list, the key ``1`` as ``"1"``) and what a
    database refuses to store (the character NUL, which PostgreSQL's ``jsonb``
    rejects, and lone surrogates such as ``"\\ud800"``, which no database takes as
    text): the data of a run must be the same on every attempt and instance.
    """
    problem = _json_problem(value, "", 0)
    if problem is not None:
        raise DataNotSerializableError(where, value, problem)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise DataNotSerializableError(where, value, error) from None
    return value


# Floats from this size on are written by json.dumps with an exponent, and come back from
# PostgreSQL's jsonb as ints.
_FLOAT_AS_INT = 1e16


def _json_problem(value: Any, path: str, depth: int) -> str | None:
    """What in ``value`` would not come back from JSON as it went in (None: nothing)."""
    if depth > 200:
        return None  # json.dumps reports the recursion
    at = f" at {path}" if path else ""
    if isinstance(value, str):
        if "\x00" in value:
            return f"the string{at} contains the character NUL (\\x00), which databases refuse"
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as error:
                bad = f"\\u{ord(value[error.start]):04x}"
                return (
                    f"the string{at} contains a lone surrogate ({bad}), which is not Unicode text and which "
                    "databases refuse; decode bytes with errors='replace', or pass them as base64"
                )
        return None
    if isinstance(value, tuple):
        return f"the tuple{at} would come back as a list; pass a list"
    if isinstance(value, float) and math.isfinite(value) and abs(value) >= _FLOAT_AS_INT:
        # json.dumps writes it with an exponent ("1e+16"); jsonb keeps the number, and gives it
        # back written out, which json.loads reads as an int.
        return (
            f"the float {value!r}{at} would come back from PostgreSQL as an integer (its jsonb keeps the "
            "number, not that it was a float); pass an int, or a string"
        )
    if path and not isinstance(value, (dict, list, int, float, type(None))):
        # Named where it is (json.dumps would only name its type); the top level is left to json.dumps.
        kind = type(value).__name__
        return f"the {kind} {value!r:.60}{at} is not JSON: pass a string, number, boolean, None, list or dict"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"the key {key!r}{at} would come back as the string {json.dumps(str(key))}; use string keys"
            found = _json_problem(key, path, depth + 1) or _json_problem(item, f"{path}[{key!r}]", depth + 1)
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _json_problem(item, f"{path}[{index}]", depth + 1)
            if found:
                return found
    return None


def _seconds(key: str, value: Any, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    try:
        return parse_duration_ms(value) / 1000
    except ValueError as error:
        raise SettingsError(key, str(error)) from None


def parse(raw: Any) -> AnarchonSettings:
    """Validate a raw ``ANARCHON`` dict (or None) and fill in the defaults."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SettingsError(None, f"must be a dict, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(DEFAULTS), key=str)
    if unknown:
        key = unknown[0]
        # Matched in upper case: a key written in lower case ("lease_ttl") is one letter case away.
        by_upper = {name.upper(): name for name in DEFAULTS}
        close = difflib.get_close_matches(str(key).upper(), by_upper, n=1)
        hint = f" Did you mean {by_upper[close[0]]!r}?" if close else ""
        raise SettingsError(key, f"unknown setting.{hint} Valid keys are: {', '.join(DEFAULTS)}.")
    values = {**DEFAULTS, **raw}
    instance_id = values["INSTANCE_ID"]
    if instance_id is not None and (not isinstance(instance_id, str) or not instance_id.strip()):
        raise SettingsError("INSTANCE_ID", f"must be a non-empty string or None, got {instance_id!r}")
    if instance_id is not None and len(instance_id) > 200:
        raise SettingsError("INSTANCE_ID", "must be at most 200 characters long")
    workers = values["MAX_WORKERS"]
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SettingsError("MAX_WORKERS", f"must be a whole number of at least 1, got {workers!r}")
    attempts = values["MAX_ATTEMPTS"]
    if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1):
        raise SettingsError(
            "MAX_ATTEMPTS", f"must be a whole number of at least 1, or None for no limit, got {attempts!r}"
        )
    grace = values["SHUTDOWN_GRACE"]
    # 0 means "do not wait"; a bool is not a duration (False == 0 would slip through).
    zero = not isinstance(grace, bool) and (grace == 0 or grace == timedelta(0))
    try:
        shutdown_grace = 0.0 if zero else _seconds("SHUTDOWN_GRACE", grace)
    except SettingsError as error:
        if "is not positive" not in str(error):
            raise
        raise SettingsError(
            "SHUTDOWN_GRACE", f"{grace!r} is negative; use 0 (hand over at once) or a positive duration"
        ) from None
    try:
        check_json(values["DATA"], "the value")
    except DataNotSerializableError as error:
        raise SettingsError("DATA", str(error)) from None
    return AnarchonSettings(
        lease_ttl=_seconds("LEASE_TTL", values["LEASE_TTL"]),  # type: ignore[arg-type]
        poll_interval=_seconds("POLL_INTERVAL", values["POLL_INTERVAL"]),  # type: ignore[arg-type]
        shutdown_grace=shutdown_grace,  # type: ignore[arg-type]
        instance_id=instance_id,
        data=values["DATA"],
        max_workers=workers,
        history_retention=_seconds("HISTORY_RETENTION", values["HISTORY_RETENTION"], allow_none=True),
        max_attempts=attempts,
    )
