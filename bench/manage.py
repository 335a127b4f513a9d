#!/usr/bin/env python
"""manage.py for the benchmark project: ``manage.py anarchon`` runs one measured instance."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if os.environ.get("ANARCHON_BENCH_PACKAGE"):  # run.py --package: a patched copy of django_anarchon
        sys.path.insert(0, os.environ["ANARCHON_BENCH_PACKAGE"])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
