from __future__ import annotations

import os

from django.apps import AppConfig


class BenchAppConfig(AppConfig):
    name = "bench.benchapp"
    label = "benchapp"
    verbose_name = "django-anarchon benchmark"

    def ready(self) -> None:
        if os.environ.get("ANARCHON_BENCH_PROBE"):
            from . import probe

            probe.install(os.environ["ANARCHON_BENCH_PROBE"])
