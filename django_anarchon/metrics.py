"""Prometheus metrics, with the optional extra ``django-anarchon[prometheus]`` (``prometheus-client``).

The scheduler's parts count what they do here (in plain numbers, handed to
prometheus-client at each scrape: see :class:`_Family`); without
``prometheus-client`` every metric is a no-op. Everything goes to
prometheus-client's default registry: a
``manage.py anarchon --metrics-port 9464`` process serves it itself, and a web
process exposes it through whatever already serves that registry
(``prometheus_client.make_wsgi_app()``, django-prometheus). The cluster-wide
figures (instances alive, seconds since each job's last success) are read from
the database at each scrape, so any process can report them.

=================================================  ==========================================
``anarchon_runs_total{job,status}``                 attempts ended here, by recorded status
``anarchon_run_lateness_seconds{job}``              slot → handler start (histogram)
``anarchon_run_duration_seconds{job}``              handler start → end (histogram)
``anarchon_slots_skipped_total{job,reason}``        slots recorded skipped (busy, no_worker, behind, paused, cancelled)
``anarchon_slots_missed_total{job}``                slots nobody ran while the cluster was down
``anarchon_takeovers_total{job}``                   expired leases this instance took over
``anarchon_hand_overs_total{job}``                  runs this instance handed over at stop
``anarchon_fencings_total{job}``                    runs this instance gave up (no renewal in time)
``anarchon_lease_renewals_total{result}``           renewal statements: ok, failed
``anarchon_claims_total{result}``                   slots claimed: won, lost (decided elsewhere)
``anarchon_instances_alive``                        instances with a recent heartbeat (database)
``anarchon_job_last_success_age_seconds{job}``      without a success, as ``job_overdue`` counts (database)
=================================================  ==========================================
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("django_anarchon")

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.utils import floatToGoString
except ImportError:  # the extra is not installed: every metric is a no-op
    prometheus_client = None  # type: ignore[assignment]

LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class _Noop:
    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def get(self) -> float:
        return 0.0


# Every count below is changed under this one lock: a few additions each, so it is never held long.
_LOCK = threading.Lock()


class _Count:
    """One labelled counter's value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"Counters only go up; {amount} was added")
        with _LOCK:
            self.value += amount

    def get(self) -> float:
        return self.value


class _Spread:
    """One labelled histogram's buckets (not cumulative: each observation lands in one), sum and count."""

    __slots__ = ("bounds", "buckets", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, amount: float) -> None:
        index = bisect.bisect_left(self.bounds, amount)  # the first bound >= amount ("le")
        with _LOCK:
            self.buckets[index] += 1
            self.total += amount


class _Family:
    """A labelled counter or histogram, counted here and handed to prometheus-client at each scrape.

    prometheus-client's own metrics take a lock for each value they change and
    walk a histogram's buckets in Python: a run's three observations cost more
    than a micro-second each. Here an observation is one addition or two under
    a lock; the exposition (names, ``_total``, ``_bucket``, ``_sum``,
    ``_count``) is prometheus-client's, built from these figures by
    :class:`_Collector`.
    """

    def __init__(self, kind: str, name: str, documentation: str, labels: tuple[str, ...], buckets: Any = None):
        self.kind = kind
        self.name = name
        self.documentation = documentation
        self.label_names = list(labels)
        self.bounds = tuple(buckets) if buckets is not None else ()
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.label_names):
                raise ValueError(f"{self.name} takes the labels {self.label_names}, not {values!r}")
            with _LOCK:
                child = self._children.get(values)
                if child is None:
                    child = _Spread(self.bounds) if self.kind == "histogram" else _Count()
                    self._children = {**self._children, values: child}  # readers see a whole dict
        return child

    def family(self) -> Any:
        if self.kind == "counter":
            counter = CounterMetricFamily(self.name, self.documentation, labels=self.label_names)
            for values, count in self._children.items():
                counter.add_metric(list(values), count.value)
            return counter
        histogram = HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)
        for values, spread in self._children.items():
            with _LOCK:
                buckets, total = list(spread.buckets), spread.total
            cumulative = list(itertools.accumulate(buckets))
            bounds = [floatToGoString(bound) for bound in spread.bounds] + ["+Inf"]
            histogram.add_metric(list(values), list(zip(bounds, cumulative, strict=True)), total)
        return histogram


_FAMILIES: list[_Family] = []


class _Collector:
    """The per-instance counters and histograms, for prometheus-client's registry."""

    def describe(self) -> Iterator[Any]:
        for family in _FAMILIES:
            yield (CounterMetricFamily if family.kind == "counter" else HistogramMetricFamily)(
                family.name, family.documentation, labels=family.label_names
            )

    def collect(self) -> Iterator[Any]:
        for family in _FAMILIES:
            yield family.family()


def _metric(kind: str, name: str, documentation: str, labels: tuple[str, ...], **kwargs: Any) -> Any:
    if prometheus_client is None:
        return _Noop()
    family = _Family(kind, name, documentation, labels, **kwargs)
    _FAMILIES.append(family)
    return family


RUNS = _metric("counter", "anarchon_runs", "Run attempts ended on this instance, by status.", ("job", "status"))
LATENESS = _metric(
    "histogram", "anarchon_run_lateness_seconds", "From the slot to the handler's start.", ("job",),
    buckets=LATENESS_BUCKETS,
)  # fmt: skip
DURATION = _metric(
    "histogram", "anarchon_run_duration_seconds", "From the handler's start to its end.", ("job",),
    buckets=DURATION_BUCKETS,
)  # fmt: skip
SKIPPED = _metric("counter", "anarchon_slots_skipped", "Slots recorded skipped, by reason.", ("job", "reason"))
MISSED = _metric("counter", "anarchon_slots_missed", "Slots nobody ran while the whole cluster was down.", ("job",))
TAKEOVERS = _metric("counter", "anarchon_takeovers", "Expired leases this instance took over.", ("job",))
HAND_OVERS = _metric("counter", "anarchon_hand_overs", "Runs this instance handed over when it stopped.", ("job",))
FENCINGS = _metric("counter", "anarchon_fencings", "Runs given up because no renewal came in time.", ("job",))
RENEWALS = _metric("counter", "anarchon_lease_renewals", "Lease renewal statements, by result.", ("result",))
CLAIMS = _metric("counter", "anarchon_claims", "Slots this instance claimed, by result.", ("result",))

_MISSED_COUNT = re.compile(r"^(\d+) slot")


def skip_reason(detail: str) -> str:
    """The ``reason`` label of a skipped slot, from the detail the store recorded."""
    if "free worker" in detail:
        return "no_worker"
    if "were behind" in detail:
        return "behind"
    if "paused" in detail:
        return "paused"
    if "cancelled" in detail:
        return "cancelled"
    return "busy"


def missed(job: str, detail: str) -> None:
    """Count a ``missed`` record: its detail starts with how many slots it stands for."""
    found = _MISSED_COUNT.match(detail)
    MISSED.labels(job).inc(int(found.group(1)) if found else 1)


class ClusterCollector:
    """Cluster-wide gauges read from the database at each scrape (any process can serve them)."""

    @staticmethod
    def _families() -> tuple[Any, Any]:
        alive = GaugeMetricFamily("anarchon_instances_alive", "Scheduler instances with a recent heartbeat.")
        age = GaugeMetricFamily(
            "anarchon_job_last_success_age_seconds",
            "Seconds since each job's last successful run (or first sighting, or resume; paused jobs left out).",
            labels=["job"],
        )
        return alive, age

    def describe(self) -> Iterator[Any]:
        """The metrics' names, without reading the database (registering calls this, not collect)."""
        yield from self._families()

    def collect(self) -> Iterator[Any]:
        from datetime import timedelta

        from django.db import DatabaseError

        from . import store
        from .conf import get_settings
        from .models import Instance, JobState

        alive, age = self._families()
        try:
            now = store.database_time()
            fresh = now - timedelta(seconds=3 * get_settings().heartbeat_every)
            alive.add_metric([], Instance.objects.using(store.alias()).filter(last_heartbeat__gte=fresh).count())
            last = store.newest_successes()
            # Counted as job_overdue counts (store.overdue_since); a paused job has no series (its
            # slots are not run, so it is not overdue).
            states = JobState.objects.using(store.alias()).filter(paused=False)
            for name, first_seen, resumed_at in states.values_list("name", "first_seen", "resumed_at"):
                since = store.overdue_since(last.get(name), first_seen, resumed_at)
                if since is not None:
                    age.add_metric([name], (now - since).total_seconds())
        except DatabaseError as error:
            logger.warning("Could not read the cluster metrics from the database (%s)", error)
            return
        yield alive
        yield age


if prometheus_client is not None:
    prometheus_client.REGISTRY.register(_Collector())
    prometheus_client.REGISTRY.register(ClusterCollector())


def serve(port: int, address: str = "0.0.0.0") -> None:  # noqa: S104 - a metrics endpoint is meant to be scraped
    """Serve the metrics on ``port`` (``manage.py anarchon --metrics-port``)."""
    if prometheus_client is None:
        from .exceptions import SettingsError

        raise SettingsError(None, "--metrics-port needs prometheus-client: pip install 'django-anarchon[prometheus]'")
    prometheus_client.start_http_server(port, addr=address)
