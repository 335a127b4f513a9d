"""Small statistics helpers (no numpy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.recorder import Start


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p99, max and mean of durations given in seconds, in milliseconds."""
    ms = [s * 1000 for s in seconds]
    return {
        "p50_ms": round(percentile(ms, 50), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2) if ms else math.nan,
        "mean_ms": round(sum(ms) / len(ms), 2) if ms else math.nan,
    }


def first_latenesses(starts: list[Start], first_ms: int, end_ms: int) -> list[float]:
    """The lateness (s) of the first start of every (job, slot) with ``first_ms <= slot < end_ms``."""
    first: dict[tuple[str, int], float] = {}
    for start in starts:
        if first_ms <= start.slot_ms < end_ms and start.reason != "manual":
            first.setdefault((start.job, start.slot_ms), start.lateness)
    return list(first.values())


def lateness(starts: list[Start], jobs: int, every_ms: int, first_ms: int, end_ms: int) -> dict[str, Any]:
    """Lateness of the first start of every (job, slot) with ``first_ms <= slot < end_ms``.

    Also counts what a user would notice: slots that never started (``missing``),
    and slots started more than once by scheduled/catch-up attempts (``duplicates``,
    which must be 0: one winner per slot).
    """
    window = [s for s in starts if first_ms <= s.slot_ms < end_ms and s.reason != "manual"]
    first: dict[tuple[str, int], Start] = {}
    duplicates = 0
    for start in window:
        key = (start.job, start.slot_ms)
        if key in first:
            duplicates += 1
            continue
        first[key] = start
    expected = jobs * len(range(first_ms, end_ms, every_ms))
    late = [s.lateness for s in first.values()]
    by_reason: dict[str, int] = {}
    for start in first.values():
        by_reason[start.reason] = by_reason.get(start.reason, 0) + 1
    return {
        **summary_ms(late),
        "runs": len(first),
        "expected": expected,
        "missing": expected - len(first),
        "completeness": round(len(first) / expected, 4) if expected else math.nan,
        "duplicates": duplicates,
        "by_reason": by_reason,
        "processes": len({s.pid for s in first.values()}),
    }
