"""Call ``django_anarchon.run_now()`` a few times from a process that runs no scheduler.

The manual run's slot is the call's wall-clock time, and the handler records its start, so
the pickup latency is the recorded lateness of each ``manual`` start.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

import django_anarchon


class Command(BaseCommand):
    help = "Ask for manual runs with run_now(), spaced out at random."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("job")
        parser.add_argument("--count", type=int, default=5)
        parser.add_argument("--spacing", type=float, default=1.0, help="mean seconds between calls")

    def handle(self, *args: Any, **options: Any) -> None:
        calls = []
        for _ in range(options["count"]):
            time.sleep(random.uniform(0.5, 1.5) * options["spacing"])  # noqa: S311 - spread over the poll phase
            before = time.time()
            run = django_anarchon.run_now(options["job"])
            calls.append({"slot": run.slot, "called": before, "returned": time.time()})
        self.stdout.write(json.dumps(calls))
