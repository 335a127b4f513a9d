"""Run the selected scenarios against one database (started by bench/run.py).

python -m bench.child --db postgres --only lateness,claims --out /tmp/postgres.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from importlib import import_module
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--only", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("ANARCHON_BENCH_PACKAGE"):  # run.py --package
        sys.path.insert(0, os.environ["ANARCHON_BENCH_PACKAGE"])
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    os.environ["ANARCHON_BENCH_DB"] = args.db
    for key in ("ANARCHON_BENCH_JOBS", "ANARCHON_BENCH_PROBE"):
        os.environ.pop(key, None)

    import django

    django.setup()
    from bench.context import Context

    ctx = Context(args.db, args.quick, Path(args.scratch))
    results: dict[str, Any] = {}
    for name in args.only.split(","):
        started = time.monotonic()
        try:
            results[name] = import_module(f"bench.scenarios.{name}").run(ctx)
        except Exception:
            ctx.log(f"{name} failed:\n{traceback.format_exc()}")
            results[name] = {"error": traceback.format_exc()}
        results[name]["elapsed_s"] = round(time.monotonic() - started, 1)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
