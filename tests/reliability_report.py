"""Print the reliability table of docs/reliability.md from test-artifacts/faults-*.json.

Run the fault suite on each database first (`tox -e py311-dj52-sqlite,py311-dj52-postgres,
py311-dj52-mariadb`, which runs `pytest -m faults`), then `python tests/reliability_report.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
DATABASES = ["sqlite", "postgresql", "mariadb"]


def load() -> dict[str, dict[str, Any]]:
    found = {}
    for db in DATABASES:
        path = ARTIFACTS / f"faults-{db}.json"
        if path.exists():
            found[db] = json.loads(path.read_text())
    return found


def cell(data: dict[str, Any], test: str, render: Any) -> str:
    figures = data.get(test)
    return render(figures) if figures else "–"


def skew(f: dict[str, Any], meaning: str) -> str:
    claimed = f"claimed its own job's {f.get('solo_slots', '?')} slots {ahead(f)} before the slot {meaning}"
    raced = f"won {f.get('skewed_instance_tick_wins', '?')} of {f.get('tick_slots', '?')} slots raced with the others"
    return f"no lease stolen, no slot twice; the skewed instance {claimed} and {raced}"


def ahead(figures: dict[str, Any]) -> str:
    late = figures.get("claimed_ahead_ms") or {}
    return f"p50 {late.get('p50_ms', '–')} / max {late.get('max_ms', '–')} ms"


def lateness(figures: dict[str, Any]) -> str:
    late = figures.get("lateness") or {}
    return f"p50 {late.get('p50_ms', '–')} / p99 {late.get('p99_ms', '–')} / max {late.get('max_ms', '–')} ms"


ROWS: list[tuple[str, str, str, Any]] = [
    (
        "Crash",
        "SIGKILL the runner of a long job among 3 instances",
        "sigkill_takeover",
        lambda f: (
            f"attempt 2 started {f['takeover_s']} s later on another instance "
            f"(LEASE_TTL {f['lease_ttl_s']} s + POLL {f['poll_interval_s']} s)"
        ),
    ),
    (
        "Stop",
        "SIGTERM the runner of a long job among 3 instances",
        "sigterm_hand_over",
        lambda f: f"handed over, attempt 2 started {f['hand_over_s']} s later elsewhere; exit code {f['exit_code']}",
    ),
    (
        "Contention",
        "6 instances, 50 jobs every 1 s, 30 s",
        "contention",
        lambda f: (
            f"{f['slots_checked']} slots, {f['executions']} executions, duplicates {f['duplicates']}, "
            f"missed {f['missed']}, skipped because the previous run overran {f.get('skipped_overrun', 0)}; "
            f"lateness {lateness(f)}"
        ),
    ),
    (
        "Crash storm",
        "SIGKILL a random instance every 2–4 s and restart it, 60 s",
        "crash_storm",
        lambda f: (
            f"{f['sigkills']} kills, {f['takeover_attempts']} takeovers, {f['executions']} executions, "
            f"duplicates {f['duplicates']}, overlapping attempts 0 ({f['attempt_pairs_checked_for_overlap']} pairs), "
            f"left running {f['left_running']}"
        ),
    ),
    (
        "Freeze",
        "SIGSTOP a checkpointing runner past its lease, SIGCONT",
        "freeze",
        lambda f: (
            f"takeover {f['takeover_after_sigstop_s']} s after SIGSTOP (LEASE_TTL {f['lease_ttl_s']} s); "
            f"frozen runner fenced, its late writes changed nothing; steps repeated {f['duplicated_steps']}"
        ),
    ),
    (
        "Database outage",
        "stop the server (SQLite: hold its write lock) for LEASE_TTL + 2 s under 3 instances",
        "database_outage",
        lambda f: (
            f"{f['outage_s']} s until the server was back; runner fenced {f['fenced_after_s']} s in (< LEASE_TTL "
            f"{f['lease_ttl_s']} s); {f['instances_survived']}/3 instances survived; catch-up runs {f['catch_up_runs']}"
        ),
    ),
    (
        "Database restart, handlers that query",
        "stop the server (SQLite: hold its write lock) for 2 s under 2 instances, a job writing a row every second",
        "handlers_after_outage",
        lambda f: (
            f"{f['outage_s']} s until the server was back; runs after it that failed on a connection the "
            f"restart had killed: {f['failed_runs']}"
        ),
    ),
    (
        "Clock skew, ahead",
        "one of 3 instances with its clock 6 s ahead (libfaketime)",
        "clock_skew_ahead",
        lambda f: skew(f, "(the claim-ahead margin, not 6 s)"),
    ),
    (
        "Clock skew, behind",
        "one of 3 instances with its clock 6 s behind (libfaketime)",
        "clock_skew_behind",
        lambda f: skew(f, "(on time, not 6 s late)"),
    ),
    (
        "Clock stepped",
        "NTP steps one of 2 instances' clock 6 s forward while it runs (libfaketime)",
        "clock_step",
        lambda f: (
            f"the step was noticed at the next loop turn and the database clock measured again; "
            f"{f['slots_after_step']} slots after the step, {f['stepper_wins']} won by the stepped instance, "
            f"{f['early_claims']} claimed early"
        ),
    ),
    (
        "Clock stepped back and forth",
        "the one instance's clock stepped 20 s back and forth 8 times while runs every 250 ms wait for their slots "
        "(libfaketime)",
        "clock_steps_back_and_forth",
        lambda f: f"{f['runs']} runs, none early, none late: handler start − slot {lateness(f)}",
    ),
    (
        "Clock stepped in an outage",
        "NTP steps the one instance's clock 60 s forward while the database is down (libfaketime)",
        "clock_step_in_outage",
        lambda f: (
            f"the step was absorbed at once and the database clock measured when it came back; "
            f"{f['missed_counted']} slots counted missed in a {f['outage_s']} s outage, none decided early"
        ),
    ),
    (
        "Rolling deploy",
        "SIGTERM and restart 3 instances one at a time under a long checkpointing job",
        "rolling_deploy",
        lambda f: (
            f"{f['hand_overs']} hand-over(s), {f['hand_over_after_sigterm_s']} s after SIGTERM; "
            f"steps lost or repeated {f['steps_lost_or_repeated']}"
        ),
    ),
    (
        "Unstorable error",
        "a handler raises a message with NUL and a lone surrogate every second beside another job, 2 instances, 8 s",
        "unstorable_message",
        lambda f: (
            f"{f['recorded_failed']} of {f['slots']} slots recorded failed with the message escaped; "
            f"the other job's runs held up {f['stalled']}"
        ),
    ),
    (
        "Catch-up beyond workers",
        "5 jobs, MAX_WORKERS = 2, the whole cluster down over their slots, one instance back",
        "catch_up_beyond_workers",
        lambda f: (
            f"{f['caught_up']} of {f['jobs']} jobs caught up ({f['waited_for_a_worker']} waited as pending runs "
            "for a free worker); none dropped"
        ),
    ),
    (
        "Crash behind a backlog",
        "300 pending runs of a job no instance declares, then SIGKILL the runner of another job",
        "takeover_behind_backlog",
        lambda f: f"taken over {f['takeover_after_sigkill_s']} s after SIGKILL (LEASE_TTL 2.0 s + POLL 0.2 s)",
    ),
    (
        "Frozen before its slot",
        "SIGSTOP an instance after it claimed a slot ahead, before the slot; SIGCONT after the takeover",
        "frozen_before_slot",
        lambda f: (
            f"frozen {f['frozen_before_slot_ms']} ms before the slot; attempt 1 started {f['attempt_1_started']} "
            f"times, the takeover attempt {f['attempt_2_started']}"
        ),
    ),
]


def main() -> None:
    data = load()
    print("| fault | what was done | " + " | ".join(DATABASES) + " |")
    print("|---|---|" + "---|" * len(DATABASES))
    for title, what, test, render in ROWS:
        cells = [cell(data.get(db, {}), test, render) for db in DATABASES]
        print(f"| {title} | {what} | " + " | ".join(cells) + " |")
    stamps = sorted({v.get("at", "") for per_db in data.values() for v in per_db.values()})
    if stamps:
        print(f"\nFigures from runs between {stamps[0]} and {stamps[-1]} UTC.")


if __name__ == "__main__":
    main()
