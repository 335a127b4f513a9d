"""The pieces that start runs inside one instance: the starter, the worker pool, the capacity count.

No database: runs are stand-ins with the attributes these pieces read, and time
is a number the test moves.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

from django_anarchon import Interrupted, store
from django_anarchon import runner as runner_module
from django_anarchon.conf import parse
from django_anarchon.engine import Engine
from django_anarchon.models import Run
from django_anarchon.registry import Registry, build_job
from django_anarchon.runner import ActiveRun, Starter, Starting, Workers
from django_anarchon.timing import Clock
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


def test_the_starter_reads_the_clock_again_while_a_run_waits_so_a_clock_step_cannot_hold_it() -> None:
    """A reading taken just after the wall clock was stepped back (before the engine measured
    the database clock again) is an hour behind; the next reading is right again."""
    readings = iter([1_000 - 3_600_000])
    clock = FakeTime(1_000)
    released: list[int] = []
    starter = Starter(lambda: next(readings, clock.now), lambda a: released.append(a.run.slot))
    started = time.monotonic()
    starter.add(active(1_050))
    clock.now = 1_050  # the slot comes; nothing wakes the starter
    wait_for(lambda: released == [1_050], 2, what="the run, released at its slot however far back the step")
    assert time.monotonic() - started < 1.0


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


def test_a_worker_that_queues_a_follow_up_stays_reserved_for_it_and_takes_it_itself() -> None:
    """A task that returns True has queued a follow-up: its thread is not idle until that is done."""
    workers = Workers()
    ran: list[tuple[str, str]] = []

    def follow_up(run: ActiveRun) -> bool:
        ran.append(("follow-up", threading.current_thread().name))
        return False

    def first(run: ActiveRun) -> bool:
        ran.append(("first", threading.current_thread().name))
        workers.follow(run, follow_up)
        return True

    workers.submit(active(1), first)
    wait_for(lambda: len(ran) == 2, 5, what="the task and its follow-up")
    assert ran[0][1] == ran[1][1], "the one thread took its own follow-up"
    wait_for(lambda: len(workers._idle) == 1, 5, what="the thread to be idle once the follow-up is done")
    threading.Event().wait(0.05)
    assert len(workers._idle) == 1, "counted idle once, not once per task"
    assert next(workers._count) == 2, "no second thread was started"


def test_a_handler_that_returns_while_runs_still_wait_to_start_queues_its_ending_behind_them() -> None:
    """Its thread takes the next start at once; the ending follows as a task of its own.

    Every run of a burst woke a thread of its own: a hundred trivial runs due at
    once started one every ~50 µs, over 5 ms.
    """
    job = build_job("interval", "quick", "1s", lambda ctx: None, {})
    engine = Engine([job], parse({}), instance_id="follow")
    followed: list[Any] = []
    engine.runner.workers.follow = lambda run, work: followed.append((run, work))  # type: ignore[method-assign]
    ended: list[ActiveRun] = []

    def complete(run: ActiveRun, error: BaseException | None) -> None:
        ended.append(run)
        run.done()

    engine.runner._complete = complete  # type: ignore[method-assign]
    run: Any = Run(id=1, job="quick", slot=int(time.time() * 1000) - 5, attempt=1, reason="scheduled")
    first = ActiveRun(run, job, renewed_at=time.monotonic())
    engine._active[1] = first
    engine.runner.starting.add(2)  # this run, and one more of the same instant not started yet
    assert engine.runner._execute(first) is True, "the thread is reserved for the queued ending"
    assert first.returned and [run for run, _ in followed] == [first]
    assert ended == [] and not first.finished.is_set(), "ended only once the other run has started"
    engine.runner.starting.begun()  # the other run's handler is called
    (_, ending) = followed[0]
    assert ending(first) is False
    assert ended == [first] and first.finished.is_set() and 1 not in engine._active

    second: Any = Run(id=2, job="quick", slot=run.slot, attempt=1, reason="scheduled")
    alone = ActiveRun(second, job, renewed_at=time.monotonic())
    engine._active[2] = alone
    engine.runner.starting.add()
    assert engine.runner._execute(alone) is False, "nothing waits to start: ended on the spot"
    assert ended == [first, alone] and alone.finished.is_set() and len(followed) == 1


def test_starting_counts_runs_until_their_handler_begins() -> None:
    starting = Starting()
    assert starting.wait_done(0), "nothing is starting"
    starting.add()
    starting.add()
    starting.begun()
    assert not starting.wait_done(0.01), "one run has not begun"
    threading.Timer(0.05, starting.begun).start()
    assert starting.wait_done(5)


def test_endings_wait_until_the_runs_due_with_them_have_started(monkeypatch: Any) -> None:
    """A hundred runs due at once: none is recorded as ended before the last one has started.

    Endings mixed in with the starts took the GIL from them: the last of a hundred
    trivial runs started about twice as late.
    """
    monkeypatch.setattr(runner_module, "ENDING_DEFER_S", 5.0)  # a slow CI must not end the wait early
    events: list[tuple[str, str]] = []

    def handler(ctx: Any) -> None:
        events.append(("start", ctx.name))

    jobs = [build_job("interval", f"j{n}", "1s", handler, {}) for n in range(100)]
    engine = Engine(jobs, parse({"MAX_WORKERS": 200}), instance_id="endings")

    def complete(run: ActiveRun, error: BaseException | None) -> None:
        events.append(("end", run.run.job))
        run.done()

    monkeypatch.setattr(engine.runner, "_complete", complete)
    slot = int(time.time() * 1000) + 1000  # all claimed ahead, released together
    for n, job in enumerate(jobs):
        run: Any = Run(id=n + 1, job=job.name, slot=slot, attempt=1, reason="scheduled")
        run_active = ActiveRun(run, job, renewed_at=time.monotonic())
        engine._active[n + 1] = run_active
        engine.runner.start(run_active)
    wait_for(lambda: len(events) == 200, 10, what="a hundred runs to start and end")
    kinds = [kind for kind, _ in events]
    assert kinds == ["start"] * 100 + ["end"] * 100, f"an end came before start {kinds.index('end')} of 100"
    assert engine.runner.starting.wait_done(0)


def test_capacity_counts_runs_whose_handler_has_not_returned() -> None:
    engine = Engine([], parse({"MAX_WORKERS": 3}), instance_id="cap")
    runs = [active(n) for n in range(3)]
    for run in runs:
        engine._active[run.run.id] = run
    assert engine.capacity() == 0
    runs[0].returned = True  # its end is still being recorded, its worker is free
    assert engine.capacity() == 1


def test_every_instance_claims_other_shares_after_every_first_pass(monkeypatch: Any) -> None:
    """The backup lead is the same everywhere and below every first lead, whatever the claim times.

    A backup lead that grew with the claim time let the instance writing the most
    rows take the shares of the fastest one, which then won nothing at all.
    """
    import django_anarchon.engine as engine_module

    engine = Engine([], parse({}), instance_id="leads")
    for claim_ms, first in ((2.0, 90), (30.0, 90), (60.0, 120), (500.0, 250)):
        engine._claim_ms = claim_ms
        for jitter in (0.0, 20.0):
            monkeypatch.setattr(engine_module.random, "uniform", lambda low, high, jitter=jitter: jitter)
            engine._draw_claim_ahead()
            assert engine.backup_ahead_ms == engine_module.BACKUP_AHEAD_MS == 30
            assert engine_module.BACKUP_WINDOW_MS == 20
            assert engine.claim_ahead_ms == first + int(jitter)
            earliest_look = engine.backup_ahead_ms + engine_module.BACKUP_WINDOW_MS
            assert engine.claim_ahead_ms >= earliest_look + 40, "a peer's first pass comes well before"
            assert engine.claim_ahead_ms >= min(2 * claim_ms, 250), "its own claims commit before the slot"


class FixedClock(Clock):
    def __init__(self, now_ms: int) -> None:
        super().__init__()
        self.at = now_ms

    def now_ms(self) -> int:
        return self.at


SLOT = 1_800_000_000_000


def sharing_engines(count: int, jobs: int, clock: Clock | None = None) -> list[Engine]:
    declared = Registry()
    for n in range(jobs):
        declared.add(build_job("interval", f"job-{n}", "1s", lambda ctx: None, {}))
    engines = [Engine(list(declared), parse({}), instance_id=f"i{n}", clock=clock) for n in range(count)]
    peers = tuple(sorted(engine.token for engine in engines))
    for engine in engines:
        engine._peers = peers
    return engines


def test_each_slot_has_one_preferred_instance_and_the_instances_share_them_evenly() -> None:
    """Of the jobs due at an instant, each instance gets as many as the others, to one.

    A hash per (job, slot) shared them out only on average: one of three instances
    often got over 40 of 100, and its handlers started last.
    """
    engines = sharing_engines(3, 100)
    firsts = Counter()
    for slot in range(SLOT, SLOT + 10_000, 1000):
        shares = Counter()
        for name in engines[0].jobs:
            preferred = [engine.instance_id for engine in engines if engine._preferred(name, slot)]
            assert len(preferred) == 1, f"{name}@{slot} is preferred by {preferred}"
            shares[preferred[0]] += 1
        assert sorted(shares.values()) == [33, 33, 34], f"uneven share of slot {slot}: {shares}"
        firsts[next(e.instance_id for e in engines if e._preferred("job-0", slot))] += 1
    assert len(firsts) > 1, "a job's slots go to different instances over time"
    # Jobs due together are often a subset (other jobs have other intervals): still about even.
    subset = [name for n, name in enumerate(engines[0].jobs) if n % 4 == 0]
    for slot in range(SLOT, SLOT + 10_000, 1000):
        counts = Counter(next(e.instance_id for e in engines if e._preferred(name, slot)) for name in subset)
        assert max(counts.values()) <= 13, f"uneven share of 25 jobs at {slot}: {counts}"
    alone = sharing_engines(1, 5)[0]
    assert all(alone._preferred(name, SLOT) for name in alone.jobs), "an instance alone claims everything at once"


def test_an_instance_claims_its_share_first_and_the_rest_just_before_the_slot(monkeypatch: Any) -> None:
    clock = FixedClock(0)
    engine = sharing_engines(3, 60, clock)[0]
    decided: list[list[str]] = []

    def decide(claims: list[Any], catch_ups: list[Any], **kwargs: Any) -> Any:
        assert all(claim.slot == SLOT for claim in claims) and not catch_ups
        decided.append(sorted(claim.job.name for claim in claims))
        return store.Outcome()

    monkeypatch.setattr(engine, "_decide", decide)
    reads: list[float] = []
    peers = list(engine._peers)
    monkeypatch.setattr(store, "live_instances", lambda within: reads.append(within) or peers)
    engine.claim_ahead_ms, engine.backup_ahead_ms = 80, 30
    engine._heap = []
    for name in engine.jobs:
        engine._next_slot[name] = SLOT
        engine._push(SLOT, name)
    mine = sorted(name for name in engine.jobs if engine._preferred(name, SLOT))
    assert 0 < len(mine) < 60
    clock.at = SLOT - 80
    assert engine._due(clock.at)
    engine._dispatch_due()
    assert decided == [mine], "the first pass claims this instance's share only"
    assert not engine._due(clock.at + 49), "the others' share waits for the backup lead"
    clock.at = SLOT - 30
    assert engine._due(clock.at)
    engine._dispatch_due()
    assert decided[1] == sorted(set(engine.jobs) - set(mine)), "then the rest, in case their instance is gone"
    assert not engine._due(clock.at) and all(slot == SLOT + 1000 for slot in engine._next_slot.values())
    assert len(reads) == 1, "the live instances are read when claiming, at most every PEERS_REFRESH_S"


def test_backup_looks_due_close_together_share_one_statement(monkeypatch: Any) -> None:
    """Other instances' slots due within BACKUP_WINDOW_MS of each other are looked at in one claim.

    Each backup look took its own round trip; with several instances they are most of the
    statements a cluster sends (each instance looks at every slot not in its share), and
    nearly all of them find the slot decided. Jobs due at distinct instants 2 ms apart,
    walked one millisecond at a time: the instance's own slots are claimed at the first
    lead, the others' no earlier than the backup lead plus the window (still well after
    their own instance's first pass) and no later than the backup lead, a few per statement.
    """
    import django_anarchon.engine as engine_module

    clock = FixedClock(0)
    engine = sharing_engines(3, 60, clock)[0]
    calls: list[tuple[int, list[tuple[str, int]]]] = []

    def decide(claims: list[Any], catch_ups: list[Any], **kwargs: Any) -> Any:
        assert not catch_ups
        calls.append((clock.at, [(claim.job.name, claim.slot) for claim in claims]))
        return store.Outcome()

    monkeypatch.setattr(engine, "_decide", decide)
    peers = list(engine._peers)
    monkeypatch.setattr(store, "live_instances", lambda within: peers)
    engine.claim_ahead_ms, engine.backup_ahead_ms = 90, 30
    window = engine_module.BACKUP_WINDOW_MS
    engine._heap = []
    slots = {name: SLOT + 2 * n for n, name in enumerate(engine.jobs)}
    for name, slot in slots.items():
        engine._next_slot[name] = slot
        engine._push(slot, name)
    for clock.at in range(SLOT - 200, SLOT + 200):
        if engine._due(clock.at):
            engine._dispatch_due()
    looked = [(at, name, slot) for at, claims in calls for name, slot in claims]
    assert sorted((name, slot) for _, name, slot in looked) == sorted(slots.items()), "each slot exactly once"
    own = [(at, slot) for at, name, slot in looked if engine._preferred(name, slot)]
    backups = [(at, slot) for at, name, slot in looked if not engine._preferred(name, slot)]
    assert 10 < len(own) < 30 and len(backups) > 30
    assert all(at == slot - 90 for at, slot in own), "own share at the first lead"
    assert all(slot - 30 - window <= at <= slot - 30 for at, slot in backups), backups
    assert all(at >= slot - 90 + 40 for at, slot in backups), "a peer's first pass comes well before"
    statements = {at for at, name, slot in looked if not engine._preferred(name, slot)}
    assert len(statements) <= len(backups) / 4, f"{len(backups)} backup looks in {len(statements)} statements"


def test_an_instance_learns_of_a_new_peer_when_it_next_claims(monkeypatch: Any) -> None:
    clock = FixedClock(SLOT)
    engine = sharing_engines(1, 30, clock)[0]
    monkeypatch.setattr(engine, "_decide", lambda claims, catch_ups, **kwargs: store.Outcome())
    monkeypatch.setattr(store, "live_instances", lambda within: [engine.token])
    engine._dispatch_due()
    assert engine._peers == (engine.token,), "alone, it prefers every slot"
    monkeypatch.setattr(store, "live_instances", lambda within: [engine.token, "newcomer"])
    engine._dispatch_due()
    assert engine._peers == (engine.token,), "read again only PEERS_REFRESH_S later"
    monkeypatch.setattr(clock, "monotonic", lambda: time.monotonic() + 2.0)
    engine._dispatch_due()
    assert engine._peers == tuple(sorted([engine.token, "newcomer"]))


def test_a_run_whose_lease_may_have_run_out_while_it_waited_for_its_slot_is_never_started() -> None:
    """Frozen after its claim (SIGSTOP, a long pause) and taken over meanwhile: on waking it must not start.

    The watchdog may not have come round yet when the worker reaches the slot, so
    the worker judges the lease itself, at the last moment before the handler.
    """
    from django_anarchon import signals

    called: list[Any] = []
    started: list[Any] = []
    job = build_job("interval", "frozen", "10000d", called.append, {})
    engine = Engine([job], parse({}), instance_id="frozen")  # threads not started: no watchdog
    run: Any = Run(id=7, job="frozen", slot=int(time.time() * 1000) + 200, attempt=1, reason="scheduled")

    def on_started(sender: Any, run: Any, **kwargs: Any) -> None:
        started.append(run)

    signals.run_started.connect(on_started)
    try:
        active = engine.adopt(run, time.monotonic())
        assert active is not None
        active.renewed_at = time.monotonic() - 100  # its last renewal: long before the freeze ended
        wait_for(lambda: active.finished.is_set(), 5, what="the run to be given up")
        time.sleep(0.3)
    finally:
        signals.run_started.disconnect(on_started)
    assert called == [] and started == [], "the handler of a run this instance may have lost was started"
    assert active.cause == "fenced" and isinstance(active.signal.reason, BaseException)
    assert active.state == "done" and 7 not in {a.run.id for a in engine.active_runs()}


def test_a_run_stopped_before_its_slot_is_handed_over_without_starting(monkeypatch: Any) -> None:
    recorded: list[tuple[Any, Any]] = []
    called: list[Any] = []
    job = build_job("interval", "early", "10000d", called.append, {})
    engine = Engine([job], parse({}), instance_id="early")
    monkeypatch.setattr(engine.runner, "hand_over", lambda active, error: recorded.append((active, error)))
    run: Any = Run(id=8, job="early", slot=int(time.time() * 1000) + 60_000, attempt=1, reason="scheduled")
    active = engine.adopt(run, time.monotonic())
    assert active is not None
    active.abort("stop", Interrupted("stopping"))
    wait_for(lambda: active.finished.is_set(), 5, what="the run to end")
    assert called == [] and [a for a, _ in recorded] == [active], "handed over, never started"
