"""One table of claim decisions, run against both deciders so that they cannot drift apart.

On PostgreSQL the plain scheduled claim is decided by the PL/pgSQL function
``django_anarchon_claim()`` (store/sql/claim_v*.sql), everything else by the Python
path of ``store.decide``; each case runs once through each, from the same state,
and must give the expected decision both times. On the other databases both runs
take the Python path, so the table still checks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from django_anarchon import Scheduler, store
from django_anarchon.models import JobState, Run
from django_anarchon.registry import Job
from django_anarchon.store import statements

pytestmark = pytest.mark.django_db(transaction=True)

SLOT = 1_800_000_000_000


def make_job(overlap: str = "skip") -> Job:
    scheduler = Scheduler()
    scheduler.every("job", "1s", lambda ctx: None, overlap=overlap)
    return scheduler.job("job")


def running(job: Job, slot: int, attempt: int = 1, status: str = "running") -> None:
    Run.objects.create(job=job.name, slot=slot, attempt=attempt, status=status, reason="scheduled",
                       scheduled_at=store.slot_datetime(slot), owner="other")  # fmt: skip


def nothing(job: Job) -> None:
    store.ensure_jobs([job])


CASES: list[tuple[str, str, Callable[[Job], Any], list[int], int, dict[str, list[int]]]] = [
    # (case, overlap, state before, slots claimed, capacity, expected decision)
    ("idle job", "skip", nothing, [SLOT], 5, {"won": [SLOT]}),
    ("slot already decided", "skip", lambda j: (nothing(j), running(j, SLOT, status="success")), [SLOT], 5, {}),
    ("busy job, skip", "skip", lambda j: (nothing(j), running(j, SLOT - 1000)), [SLOT], 5, {"skipped": [SLOT]}),
    ("busy job, allow", "allow", lambda j: (nothing(j), running(j, SLOT - 1000)), [SLOT], 5, {"won": [SLOT]}),
    ("handed-over attempt waiting, skip", "skip",
     lambda j: (nothing(j), running(j, SLOT - 1000, attempt=2, status="pending")), [SLOT], 5, {"skipped": [SLOT]}),
    ("paused job", "skip", lambda j: JobState.objects.create(name=j.name, paused=True), [SLOT], 5, {}),
    ("no free worker", "skip", nothing, [SLOT], 0, {"deferred": [SLOT]}),
    ("a manual run in the same millisecond", "skip",
     lambda j: (nothing(j), store.create_manual(j.name, None, slot=SLOT)), [SLOT], 5, {"won": [SLOT]}),
    ("two slots of one job in a batch, skip", "skip", nothing, [SLOT, SLOT + 1000], 5,
     {"won": [SLOT], "skipped": [SLOT + 1000]}),
    ("two slots of one job in a batch, allow", "allow", nothing, [SLOT, SLOT + 1000], 5,
     {"won": [SLOT, SLOT + 1000]}),
    ("one worker for two slots, allow", "allow", nothing, [SLOT, SLOT + 1000], 1,
     {"won": [SLOT], "deferred": [SLOT + 1000]}),
    ("no job row yet", "skip", lambda j: None, [SLOT], 5, {"won": [SLOT]}),
]  # fmt: skip


def decision(outcome: store.Outcome) -> dict[str, list[int]]:
    found = {
        "won": sorted(r.slot for r in outcome.won),
        "skipped": sorted(r.slot for r in outcome.skipped),
        "deferred": sorted(c.slot for c in outcome.deferred),
        "busy": sorted(outcome.busy),
    }
    return {key: value for key, value in found.items() if value}


@pytest.mark.parametrize(
    ("case", "overlap", "before", "slots", "capacity", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_both_deciders_decide_each_case_the_same_way(
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    overlap: str,
    before: Callable[[Job], Any],
    slots: list[int],
    capacity: int,
    expected: dict[str, list[int]],
) -> None:
    decisions = {}
    for path in ("one statement where there is one", "Python"):
        Run.objects.all().delete()
        JobState.objects.all().delete()
        job = make_job(overlap)
        before(job)
        if path == "Python":
            monkeypatch.setattr(statements, "can_claim_in_one_statement", lambda claims: False)
        outcome = store.decide(
            [store.Claim(job, slot) for slot in slots], owner="me", instance_id="i-me", ttl=30, capacity=capacity
        )
        decisions[path] = decision(outcome)
    assert decisions["Python"] == expected, f"{case}: the Python path decided {decisions['Python']}"
    assert decisions["one statement where there is one"] == expected, f"{case}: {decisions}"
