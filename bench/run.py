#!/usr/bin/env python
"""Run the django-anarchon benchmark and write bench/results/latest.{json,md,png}.

    python bench/run.py                      # everything, ~45 minutes
    python bench/run.py --quick              # short windows, for development
    python bench/run.py --only lateness,claims --databases postgres

Every figure is reported next to a reference measured in the same run (APScheduler 3 for
lateness, pgbench and a one-row INSERT for claims) and checked against its target.
See docs/performance.md for the method.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import machine, report  # noqa: E402
from bench.dbconf import DB_NAME, VENDORS  # noqa: E402

SCENARIOS = ("lateness", "claims", "idle", "failover", "scale", "load")


def _list(value: str, allowed: tuple[str, ...]) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return items


def prepare(db: str) -> None:
    """Create the benchmark's own database if needed, and migrate it."""
    if db == "postgres":
        host = os.environ.get("ANARCHON_BENCH_PG_HOST", "127.0.0.1")
        user = os.environ.get("ANARCHON_BENCH_PG_USER", "postgres")
        exists = subprocess.run(
            [
                "psql",
                "-h",
                host,
                "-U",
                user,
                "-Atc",
                f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}'",  # noqa: S608 - a constant
                "postgres",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if exists != "1":
            subprocess.run(["createdb", "-h", host, "-U", user, DB_NAME], check=True)
    elif db == "mariadb":
        subprocess.run(
            ["mariadb", "-h", os.environ.get("ANARCHON_BENCH_MYSQL_HOST", "127.0.0.1"), "-u", "root", "-e"]
            + [f"CREATE DATABASE IF NOT EXISTS {DB_NAME} CHARACTER SET utf8mb4"],
            check=True,
        )
    elif db == "sqlite":
        # What the anarchon.W002 check asks of a SQLite file shared by several processes.
        import sqlite3

        from bench.dbconf import SQLITE_PATH

        with sqlite3.connect(SQLITE_PATH) as connection:
            connection.execute("PRAGMA journal_mode=WAL")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings", "ANARCHON_BENCH_DB": db}
    subprocess.run([sys.executable, str(ROOT / "bench" / "manage.py"), "migrate", "-v0"], env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short measuring windows (development)")
    parser.add_argument("--only", type=lambda v: _list(v, SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--databases", type=lambda v: _list(v, VENDORS), default=list(VENDORS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument(
        "--package",
        type=Path,
        help="measure the django_anarchon package in this folder (a patched copy) instead of the installed one",
    )
    parser.add_argument("--report-only", action="store_true", help="rewrite latest.md/png from latest.json")
    args = parser.parse_args(argv)
    if args.report_only:
        write(json.loads((args.out / "latest.json").read_text()), args.out)
        return 0
    if args.package:
        os.environ["ANARCHON_BENCH_PACKAGE"] = str(args.package.resolve())

    started = time.time()
    scratch = args.out / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "quick": args.quick,
            "only": args.only,
            "databases": args.databases,
            "machine": machine.describe(),
            "engine": machine.engine_version(args.package),
            "command": " ".join(["python bench/run.py", *(argv if argv is not None else sys.argv[1:])]),
        },
        "reference": {},
        "databases": {},
    }
    if "lateness" in args.only:
        from bench.scenarios import lateness

        seconds = lateness.seconds(args.quick)
        print(f"reference: APScheduler 3, 100 jobs every 1 s, {seconds}s", file=sys.stderr, flush=True)
        folder = scratch / "apscheduler"
        for old in folder.glob("*"):
            old.unlink()
        folder.mkdir(exist_ok=True)
        results["reference"]["apscheduler"] = lateness.apscheduler(folder, seconds)
        print(f"  p99 {results['reference']['apscheduler']['p99_ms']} ms", file=sys.stderr, flush=True)

    for db in args.databases:
        prepare(db)
        out = scratch / f"{db}.json"
        out.unlink(missing_ok=True)
        command = [sys.executable, "-m", "bench.child", "--db", db, "--only", ",".join(args.only)]
        command += ["--out", str(out), "--scratch", str(scratch)] + (["--quick"] if args.quick else [])
        subprocess.run(command, cwd=ROOT, check=True)
        results["databases"][db] = json.loads(out.read_text())

    results["meta"]["elapsed_s"] = round(time.time() - started, 1)
    results["meta"]["python_implementation"] = platform.python_implementation()
    results["meta"]["package"] = str(args.package) if args.package else "installed"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2))
    write(results, args.out)
    failed = [f"{db} {name}" for db, found in results["databases"].items() for name, r in found.items() if "error" in r]
    if failed:
        # The report lists them too; a run that lost a scenario must not look like a clean one.
        print(f"failed scenarios (tracebacks in latest.json): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def write(results: dict[str, Any], out: Path) -> None:
    """Check the targets and write latest.json, latest.md and latest.png."""
    results["targets"] = report.targets(results)
    (out / "latest.json").write_text(json.dumps(results, indent=2))
    (out / "latest.md").write_text(report.markdown(results))
    report.plot(results, out / "latest.png")
    print(report.targets_table(results["targets"]))
    print(f"\nwrote {out}/latest.json, latest.md, latest.png ({results['meta']['elapsed_s']:.0f}s of measuring)")


if __name__ == "__main__":
    sys.exit(main())
