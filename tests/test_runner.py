"""The pieces that start runs inside one instance: the starter, the worker pool, the capacity count.

No database: runs are stand-ins with the attributes these pieces read, and time
is a number the test moves.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from django_anarchon.conf import parse
from django_anarchon.engine import Engine
from django_anarchon.runner import ActiveRun, Starter, Workers
from tests.conftest import wait_for


def active(slot: int, job: str = "job") -> ActiveRun:
    run: Any = SimpleNamespace(job=job, slot=slot, attempt=1, id=slot)
    return ActiveRun(run, SimpleNamespace(name=job), renewed_at=0.0)  # type: ignore[arg-type]


class FakeTime:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_starter_releases_runs_at_their_slot_together_and_in_slot_order() -> None:
    clock = FakeTime(1_000)
    released: list[int] = []
    starter = Starter(clock, lambda a: released.append(a.run.slot))
    runs = [active(2_000, "b"), active(1_500, "a"), active(2_000, "c"), active(3_000, "d")]
    for run in runs:
        starter.add(run)
    threading.Event().wait(0.05)
    assert released == [], "nothing is due yet"
    clock.now = 2_000
    starter._wake()
    wait_for(lambda: len(released) == 3, 5, what="the runs due by 2000")
    assert released == [1_500, 2_000, 2_000]
    clock.now = 3_000
    starter._wake()
    wait_for(lambda: len(released) == 4, 5, what="the last run")
    wait_for(lambda: starter._thread is None, 5, what="the starter thread to leave once nothing waits")


def test_the_starter_releases_a_run_whose_signal_aborts_before_its_slot_at_once() -> None:
    clock = FakeTime(1_000)
    released: list[ActiveRun] = []
    starter = Starter(clock, released.append)
    early, later = active(60_000, "early"), active(60_000, "later")
    starter.add(early)
    starter.add(later)
    early.abort("stop", RuntimeError("stopping"))
    wait_for(lambda: released == [early], 5, what="the aborted run to be handed to its worker")
    assert later not in released


def test_the_starter_keeps_releasing_when_one_release_fails() -> None:
    clock = FakeTime(5_000)
    released: list[str] = []

    def release(run: ActiveRun) -> None:
        if run.run.job == "bad":
            raise RuntimeError("no thread")
        released.append(run.run.job)

    starter = Starter(clock, release)
    starter.add(active(4_000, "bad"))
    starter.add(active(4_001, "good"))
    wait_for(lambda: released == ["good"], 5, what="the good run")


def test_workers_reuse_idle_threads_and_start_one_per_run_when_none_is_idle() -> None:
    workers = Workers()
    gate = threading.Event()
    seen: list[str] = []

    def blocking(run: ActiveRun) -> None:
        seen.append(threading.current_thread().name)
        gate.wait(5)

    for n in range(3):
        workers.submit(active(n), blocking)
    wait_for(lambda: len(seen) == 3, 5, what="three runs at once, none waiting behind another")
    assert len(set(seen)) == 3
    gate.set()
    wait_for(lambda: len(workers._idle) == 3, 5, what="the threads to be idle again")
    seen.clear()
    workers.submit(active(9), lambda run: seen.append(threading.current_thread().name))
    wait_for(lambda: len(seen) == 1, 5, what="a run on an idle thread")
    assert next(workers._count) == 4, "no new thread while one was idle"


def test_capacity_counts_runs_whose_handler_has_not_returned() -> None:
    engine = Engine([], parse({"MAX_WORKERS": 3}), instance_id="cap")
    runs = [active(n) for n in range(3)]
    for run in runs:
        engine._active[run.run.id] = run
    assert engine.capacity() == 0
    runs[0].returned = True  # its end is still being recorded, its worker is free
    assert engine.capacity() == 1


def test_every_instance_draws_its_claim_ahead_lead_from_the_same_range(monkeypatch: Any) -> None:
    """The instance that claims first wins: a lead that grew with the claim time kept the winner winning."""
    import django_anarchon.engine as engine_module

    fast = Engine([], parse({}), instance_id="fast")
    slow = Engine([], parse({}), instance_id="slow")
    fast._claim_ms, slow._claim_ms = 4.0, 30.0  # slow: its claims write the rows it won
    for draw in (20.0, 61.0, 100.0):
        monkeypatch.setattr(engine_module.random, "uniform", lambda low, high, draw=draw: draw)
        fast._draw_claim_ahead()
        slow._draw_claim_ahead()
        assert fast.claim_ahead_ms == int(draw)
        assert slow.claim_ahead_ms == max(60, int(draw)), "at least twice its claim time, else the same draw"
    slow._claim_ms = 500.0
    slow._draw_claim_ahead()
    assert slow.claim_ahead_ms == 200, "never more than 200 ms ahead"
