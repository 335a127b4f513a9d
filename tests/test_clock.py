"""How an instance estimates the database clock's offset from its samples (clock_offset)."""

from __future__ import annotations

import pytest

from django_anarchon.engine import clock_offset


@pytest.mark.parametrize("skew", [6000.2, -6000.2, 2.5, -2.5])
def test_a_real_offset_is_used_as_measured_whichever_side_the_clock_is_on(skew: float) -> None:
    # Shrinking it toward zero would make a clock that is behind systematically late
    # (it then loses every race for a slot) and a clock that is ahead early.
    assert clock_offset([(0.4, skew)]) == skew


@pytest.mark.parametrize("noise", [0.0, 0.9, -0.9, 1.2, -1.2])
def test_an_offset_within_the_round_trip_uncertainty_is_noise(noise: float) -> None:
    assert clock_offset([(0.4, noise)]) == 0.0


def test_the_sample_with_the_shortest_round_trip_decides() -> None:
    samples = [(40.0, 6030.0), (0.6, 6000.3), (12.0, 5990.0)]
    assert clock_offset(samples) == 6000.3
    # a slow round trip also widens the noise band
    assert clock_offset([(30.0, 14.0)]) == 0.0
