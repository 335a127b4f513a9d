"""How an instance estimates the database clock's offset from its samples (clock_offset)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from django_anarchon.clock import Clock, add_clock_sample, clock_offset
from tests.conftest import FAKETIME_LIB


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


def test_samples_are_kept_up_to_the_eight_most_recent() -> None:
    samples: list[tuple[float, float]] = []
    for n in range(12):
        samples = add_clock_sample(samples, (0.5 + n / 10, 6000.0 + n / 100))
    assert len(samples) == 8 and samples[-1] == (0.5 + 11 / 10, 6000.0 + 11 / 100)
    assert clock_offset(samples) == 6000.04  # the shortest round trip left


def test_a_clock_that_was_stepped_is_followed_at_the_next_measurement() -> None:
    # Eight consistent samples 6 s behind, then NTP steps this host's clock right:
    # the old samples (with shorter round trips) must not outvote the new one.
    samples = [(0.3, 6000.0)] * 8
    samples = add_clock_sample(samples, (0.9, 0.2))
    assert samples == [(0.9, 0.2)]
    assert clock_offset(samples) == 0.0
    # a sample that agrees within the round trips is noise, not a step
    samples = add_clock_sample([(0.3, 6000.0)], (4.0, 6001.5))
    assert len(samples) == 2 and clock_offset(samples) == 6000.0


def test_sleeping_works_on_a_host_whose_clock_is_skewed_with_libfaketime() -> None:
    # libfaketime with the monotonic clock left real (how the fault suite, and likely an
    # operator, skews a host) makes time.sleep() fail with EINVAL. The scheduler's retry
    # paths (recording outcomes through an outage) must keep working there.
    assert FAKETIME_LIB.exists(), "apt-get install faketime (libfaketime) to run this test"
    code = (
        "import time\n"
        "from django_anarchon.clock import sleep\n"
        "try:\n"
        "    time.sleep(0.01)\n"
        "    print('time.sleep works')\n"
        "except OSError as error:\n"
        "    print('time.sleep fails:', error)\n"
        "started = time.monotonic()\n"
        "sleep(0.05)\n"
        "print('slept', time.monotonic() - started)\n"
    )
    env = {**os.environ, "LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": "+6s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "time.sleep fails" in done.stdout, f"libfaketime no longer breaks time.sleep: {done.stdout}"
    slept = float(done.stdout.split("slept ")[1])
    assert slept >= 0.049, f"sleep(0.05) returned after {slept}s"


class _Time:
    """A wall clock and a monotonic clock moved by hand (``django_anarchon.clock.time``)."""

    def __init__(self, wall: float, monotonic: float) -> None:
        self.wall, self.mono = wall, monotonic

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono


def test_once_the_database_clock_is_measured_a_wall_clock_step_or_drift_moves_no_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Helper 37: a host clock stepped between two loop turns moved the corrected time until the loop
    noticed (a slot up to a poll late, or a run released early), and one running 5 % fast started
    handlers up to 29 ms before their slots. Measured against another host's database clock, the
    corrected time runs on the monotonic clock from the measurement."""
    from django_anarchon import clock as clock_module

    fake = _Time(wall=1_000.0, monotonic=50.0)
    monkeypatch.setattr(clock_module, "time", fake)
    clock = Clock()
    assert clock.exact_ms() == 1_000_000.0, "not measured yet (SQLite: the host's own clock): the wall clock"
    fake.wall += 60.0
    assert clock.exact_ms() == 1_060_000.0
    fake.wall -= 60.0

    clock.measured(2_000.0)  # the database's clock reads 2 s ahead of this host's wall clock
    assert clock.exact_ms() == 1_002_000.0
    fake.wall += 60.0  # stepped forward between two loop turns
    assert clock.exact_ms() == 1_002_000.0, "a step moves nothing"
    fake.mono += 1.0
    fake.wall += 1.05  # and running 5 % fast
    assert clock.exact_ms() == pytest.approx(1_003_000.0), "the monotonic second is the database's"
    step = clock.stepped()  # the loop's next turn notices the step
    assert step == pytest.approx(60.05)
    clock.follow_step(step)
    assert clock.exact_ms() == pytest.approx(1_003_000.0), "following the step keeps the corrected time"
    assert clock.offset_ms == pytest.approx(2_000.0 - 60_050.0), "and the offset against the wall clock"
    clock.measured(1_003_000.0 - fake.wall * 1000)  # measured again: what the database reads now
    assert clock.exact_ms() == pytest.approx(1_003_000.0)
    fake.mono += 2.0
    fake.wall += 2.0
    assert clock.exact_ms() == pytest.approx(1_005_000.0)
