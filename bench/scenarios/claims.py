"""2. Claim throughput: slot claims per second the cluster decides and records (won + lost).

N closed-loop clients (separate processes, like N instances) walk the same sequence of
(job, slot) claims through the engine's claim path (``bench_claims --mode decide``): batches
of 1 (one job due per instant) and of 100 (100 jobs due at the same instant, one transaction,
as the loop claims them). Measured two ways: *shared out*, as instances claim (each client
first claims the slots dealt to it, and the others' a little later, when the first look
usually finds them decided), and *all racing*, the worst case, where every client claims
every slot at once and all but one wait for the winner's lock. The racing runs are measured
twice: claims alone (what the reference does: decide and record the decision) and claims
plus recording the won runs as ended (``--finish``).
Beside every rate: how busy the machine's CPUs were while it was measured and, for the
Python clients, their own CPU time per decision, which say whether a rate was bound by the
CPU (two cores shared by the clients and their server processes) or by commits.
References at the same concurrency, in the same run: pgbench with a
one-row INSERT ... ON CONFLICT on a primary key (PostgreSQL's commit-bound limit here), and
the same one-row INSERT from N Python clients through Django (every database).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import machine
from bench.cluster import MANAGE, ROOT
from bench.context import Context, reset_database, sleep_until
from bench.dbconf import DB_NAME

SCRIPT = ROOT / "bench" / "pgbench_claim.sql"
FUNCTION_SCRIPT = ROOT / "bench" / "pgbench_claim_function.sql"
# More jobs than the fastest run walks through in a window: no job's next slot comes
# round while its run (never ended without --finish) still counts as running.
JOBS = 30000


def pgbench(
    clients: int, seconds: int, script: Path = SCRIPT, define: dict[str, int] | None = None
) -> tuple[float, float | None]:
    """pgbench's transactions per second running ``script`` at ``clients`` clients, and the CPU busy share meanwhile."""
    host = os.environ.get("ANARCHON_BENCH_PG_HOST", "127.0.0.1")
    user = os.environ.get("ANARCHON_BENCH_PG_USER", "postgres")
    variables = [f"-D{name}={value}" for name, value in (define or {}).items()]
    before = machine.cpu_ticks()
    done = subprocess.run(
        ["pgbench", "-h", host, "-U", user, "-n", "-c", str(clients), "-j", str(clients), "-T", str(seconds)]
        + [*variables, "-f", str(script), DB_NAME],
        capture_output=True,
        text=True,
        check=True,
    )
    busy = machine.busy_share(before, machine.cpu_ticks())
    found = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", done.stdout)
    if found is None:
        raise RuntimeError(f"could not read pgbench's output:\n{done.stdout}\n{done.stderr}")
    return float(found.group(1)), busy


def claim_function(ctx: Context, count: int, seconds: int) -> tuple[float, float | None]:
    """pgbench calling ``django_anarchon_claim()`` for slots that all ``count`` clients race for.

    The database side of ``decide_1`` with no Python client: what the claim itself costs
    PostgreSQL, against the one-row INSERT of the reference.
    """
    from django.db import connection

    reset_database()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings", "ANARCHON_BENCH_DB": ctx.db}
    setup = [sys.executable, str(MANAGE), "bench_claims", "--mode", "setup", "--jobs", str(JOBS)]
    setup += ["--base", "0", "--start-at", "0", "--seconds", "0"]
    subprocess.run(setup, cwd=ROOT, env=env, check=True, capture_output=True)
    with connection.cursor() as cursor:
        cursor.execute("DROP SEQUENCE IF EXISTS anarchon_bench_claim_seq")
        cursor.execute("CREATE SEQUENCE anarchon_bench_claim_seq")
    connection.close()
    base = (int(time.time()) - 3600) * 1000
    return pgbench(count, seconds, FUNCTION_SCRIPT, {"clients": count, "jobs": JOBS, "base": base})


def clients(
    ctx: Context, mode: str, count: int, seconds: int, batch: int = 1, finish: bool = False, share_out: bool = False
) -> dict[str, Any]:
    """Run ``count`` ``bench_claims`` clients at once; their summed counts and rates."""
    reset_database()
    base = (int(time.time()) - 3600) * 1000
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings", "ANARCHON_BENCH_DB": ctx.db}
    env.pop("ANARCHON_BENCH_JOBS", None)
    env.pop("ANARCHON_BENCH_PROBE", None)
    command = [sys.executable, str(MANAGE), "bench_claims", "--batch", str(batch), "--jobs", str(JOBS)]
    command += ["--base", str(base), "--seconds", str(seconds)]
    if mode == "decide":  # the job rows, as instances create them when they start
        setup = [*command, "--mode", "setup", "--start-at", "0"]
        subprocess.run(setup, cwd=ROOT, env=env, check=True, capture_output=True)
    command += ["--mode", mode] + (["--finish"] if finish else [])
    if share_out:  # the clients' common clock: each one's batch count (bench_claims._Progress)
        progress = ctx.scratch / "claims-progress"
        progress.write_bytes(bytes(8 * count))
        command += ["--share-out", str(count), "--progress-file", str(progress)]
    processes = [
        subprocess.Popen(
            command + (["--index", str(i)] if share_out else []),
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    for process in processes:  # a barrier: every client has set Django up and connected
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":
            _, err = process.communicate(timeout=60)
            raise RuntimeError(f"bench_claims failed before the start:\n{err[-3000:]}")
    start_at = time.time() + 0.2
    for process in processes:
        assert process.stdin is not None
        process.stdin.write(f"{start_at}\n")
        process.stdin.flush()
    sleep_until(start_at)
    before = machine.cpu_ticks()
    sleep_until(start_at + seconds)
    busy = machine.busy_share(before, machine.cpu_ticks())
    totals: dict[str, int] = {}
    for process in processes:
        out, err = process.communicate(timeout=seconds + 60)
        if process.returncode != 0:
            raise RuntimeError(f"bench_claims failed:\n{err[-3000:]}")
        for key, value in json.loads(out.strip().splitlines()[-1]).items():
            combine = max if key == "late_start_ms" else sum
            totals[key] = combine((totals.get(key, 0), value))
    late = time.time() - (start_at + seconds)
    return {
        "clients": count,
        "batch": batch,
        "seconds": seconds,
        "per_s": round(totals["decisions"] / seconds, 1),
        "won_per_s": round(totals["won"] / seconds, 1),
        "transactions_per_s": round(totals["transactions"] / seconds, 1),
        "overrun_s": round(late, 2),
        "cpu_busy": busy,
        # The clients' own CPU time (Python, psycopg, the kernel's side of their sockets).
        "client_cpu_us": round(totals["cpu_ms"] * 1000 / totals["decisions"], 1) if totals.get("decisions") else None,
        **totals,
    }


def run(ctx: Context) -> dict[str, Any]:
    seconds = 4 if ctx.quick else (8 if ctx.primary else 5)
    rows = []
    for count in (2, 4, 8):
        row: dict[str, Any] = {"clients": count}
        if ctx.db == "postgres":
            ctx.log(f"claims: pgbench -c {count}")
            reset_database()
            rate, row["pgbench_cpu_busy"] = pgbench(count, seconds)
            row["pgbench_per_s"] = round(rate, 1)
            ctx.log(f"claims: pgbench -c {count} calling the claim function (no Python)")
            rate, row["pgbench_function_cpu_busy"] = claim_function(ctx, count, seconds)
            row["pgbench_function_per_s"] = round(rate, 1)
        ctx.log(f"claims: one-row INSERT from {count} Python clients")
        row["insert"] = clients(ctx, "insert", count, seconds)
        for batch in (1, 100):
            ctx.log(f"claims: {count} clients sharing slots out as instances do, {batch} due at once")
            row[f"shared_{batch}"] = clients(ctx, "decide", count, seconds, batch, share_out=True)
            ctx.log(f"claims: store.decide, {count} clients, {batch} claim(s) per transaction")
            row[f"decide_{batch}"] = clients(ctx, "decide", count, seconds, batch)
            ctx.log(f"claims: store.decide + finish_many, {count} clients, {batch} claim(s) per transaction")
            row[f"finish_{batch}"] = clients(ctx, "decide", count, seconds, batch, finish=True)
        reference = row.get("pgbench_per_s") or row["insert"]["per_s"]
        for batch in (1, 100):
            row[f"ratio_{batch}"] = round(row[f"decide_{batch}"]["per_s"] / reference, 3)
            row[f"ratio_finish_{batch}"] = round(row[f"finish_{batch}"]["per_s"] / reference, 3)
            row[f"ratio_shared_{batch}"] = round(row[f"shared_{batch}"]["per_s"] / reference, 3)
        row["ratio_insert_1"] = round(row["decide_1"]["per_s"] / row["insert"]["per_s"], 3)
        if "pgbench_function_per_s" in row:
            row["ratio_function"] = round(row["pgbench_function_per_s"] / reference, 3)
        ctx.log(
            "  reference {:.0f}/s, shared out x1 {:.0f}/s x100 {:.0f}/s, "
            "all racing x1 {:.0f}/s (+end {:.0f}/s), x100 {:.0f}/s (+end {:.0f}/s)".format(
                reference,
                row["shared_1"]["per_s"],
                row["shared_100"]["per_s"],
                row["decide_1"]["per_s"],
                row["finish_1"]["per_s"],
                row["decide_100"]["per_s"],
                row["finish_100"]["per_s"],
            )
        )
        rows.append(row)
    return {
        "jobs": JOBS,
        "seconds": seconds,
        "reference": "pgbench" if ctx.db == "postgres" else "insert",
        "rows": rows,
    }
