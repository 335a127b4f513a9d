"""The public scheduler: job declarations plus start/stop, ``run_now`` and ``run_once``."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async

from .clock import sleep
from .conf import check_json, get_settings, problems
from .exceptions import AnarchonError, JobDeclarationError, SettingsError
from .registry import Declarations, Job, Registry

if TYPE_CHECKING:
    from .engine import Engine
    from .models import Run

logger = logging.getLogger("django_anarchon")


class Scheduler(Declarations):
    """A set of jobs and, once started, the engine that runs them in this process.

    ``django_anarchon.scheduler`` is the process-wide default one, which every
    app's ``jobs.py`` declares its jobs on.
    """

    def __init__(self) -> None:
        self.registry = Registry()
        self._engine: Engine | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = f"running as {self._engine.instance_id}" if self._engine else "stopped"
        return f"<Scheduler {len(self.registry)} job(s), {state}>"

    @property
    def jobs(self) -> list[Job]:
        """The declared jobs, in declaration order."""
        return list(self.registry)

    def job(self, name: str) -> Job:
        """The job named ``name``; raises :class:`UnknownJobError` naming the declared ones."""
        return self.registry.get(name)

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._engine is not None

    @property
    def instance_id(self) -> str | None:
        """The id this process runs under while started."""
        return self._engine.instance_id if self._engine else None

    def start(self, *, instance_id: str | None = None) -> None:
        """Start claiming and running this scheduler's jobs in background threads.

        Raises on the configuration mistakes the system checks report as errors.
        """
        from django.core.checks import Tags, run_checks
        from django.db import DatabaseError

        from . import store
        from .engine import Engine

        _require_installed()
        settings = get_settings()
        found = problems(settings)
        if found:
            raise SettingsError(None, found[0])
        # What the command's system checks refuse beyond the ANARCHON dict (parsed above):
        # USE_TZ = False (E001), a MySQL session not in UTC (E002).
        reported = list(run_checks(tags=["anarchon"]))
        try:
            reported += run_checks(tags=[Tags.database], databases=[store.alias()])
        except DatabaseError:
            pass  # unreachable for now: the loop waits for it
        for message in reported:
            setting = {"anarchon.E001": "USE_TZ", "anarchon.E002": "DATABASES"}.get(message.id or "")
            if setting is not None:
                raise SettingsError(None, f"{message.msg} {message.hint}", setting=setting)
        if self.registry.errors:
            module, error = self.registry.errors[0]
            raise JobDeclarationError(error.job, f"{error.problem} (in {module}; fix it before starting the scheduler)")
        with self._lock:
            if self._engine is not None:
                raise RuntimeError(f"{self!r} is already running; call stop() first")
            self._engine = Engine(self.registry, settings, instance_id=instance_id)
            self._engine.start()

    def wait_started(self, timeout: float | None = None) -> bool:
        """Block until the engine finished its start-up (database reached, catch-up done)."""
        engine = self._engine
        return engine.wait_started(timeout) if engine else False

    def stop(self, timeout: float | None = None) -> bool:
        """Stop gracefully: abort handlers' signals, wait up to ``timeout`` (default
        ``SHUTDOWN_GRACE``) seconds, hand interrupted runs over. True if every handler ended.
        """
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is None:
            return True
        return engine.stop(timeout)

    def run_now(self, name: str, data: Any = None) -> Run:
        """Ask for a run of job ``name`` as soon as possible; return the pending run.

        Works from any process (a view, a shell, a task worker); a running
        scheduler instance picks the run up within one poll interval (at once on
        PostgreSQL) and runs it with ``reason="manual"``. ``data`` (JSON) becomes
        ``ctx.data``; without it, the job's or the scheduler's data is used.
        """
        _require_installed()
        from . import store

        job = self.job(name)
        return store.create_manual(job.name, self._run_data(job, data), schedule=job.schedule.describe())

    async def arun_now(self, name: str, data: Any = None) -> Run:
        """The async twin of :meth:`run_now`."""
        # Thread-sensitive, as Django's own a*() ORM methods: the call's connection is the request's
        # (closed with it), not one left open on a pool thread outside any request.
        return await sync_to_async(self.run_now)(name, data)

    def _run_data(self, job: Job, data: Any) -> Any:
        if data is not None:
            job.refuse_data_for_dataless_task(data, "run_now")
            return check_json(data, f"The data given to run_now({job.name!r})")
        return job.data if job.has_data else get_settings().data

    def run_once(
        self, name: str, data: Any = None, *, instance_id: str | None = None, stop: threading.Event | None = None
    ) -> Run | None:
        """Run job ``name`` once in this process, in the foreground, as a manual run.

        Waits while the job's overlap policy says another run must end first.
        Returns the finished run record. Used by ``manage.py anarchon --run``.

        Once ``stop`` is set, the run is stopped as :meth:`stop` stops runs (its
        signal aborts, the handler gets ``SHUTDOWN_GRACE``, a run interrupted is
        handed over), and the record returned says how it ended; None if it was
        set before the run could start (nothing was claimed).
        """
        from django.db import connections

        from . import store
        from .engine import Engine
        from .models import Status

        job = self.job(name)
        payload = self._run_data(job, data)
        if connections[store.alias()].in_atomic_block:
            # The run's row would be written in the caller's transaction, where the engine's own
            # connections (renewals, the end) cannot see it: on SQLite they wait on its lock, on
            # PostgreSQL the run is lost, and stopping closed the caller's connection.
            raise AnarchonError(
                f"run_once({name!r}) cannot run inside a transaction (an atomic() block; Django's TestCase "
                "wraps each test in one): its run is recorded and its lease kept on connections of its own, "
                "which cannot see this one's uncommitted writes. In a test, call "
                f"django_anarchon.testing.run_job({name!r}) (or use TransactionTestCase); elsewhere, call it "
                "outside atomic()"
            )
        settings = get_settings()
        engine = Engine([job], settings, instance_id=instance_id, schedule_jobs=False)
        engine.start()
        try:
            waited = False
            while True:
                sent = time.monotonic()
                run = store.claim_manual(
                    job,
                    payload,
                    int(time.time() * 1000),
                    owner=engine.token,
                    instance_id=engine.instance_id,
                    ttl=settings.lease_ttl,
                )
                if run is not None:
                    break
                if not waited:
                    waited = True
                    logger.info("Job %r is running elsewhere; waiting for that run to end", name)
                    holder = store.orphaned_holder(name)
                    if holder is not None:
                        logger.warning(
                            "Job %r is held by its run of slot %s (attempt %d, %s on %s) that only a running "
                            "scheduler moves on (it takes over an expired lease, and runs a handed-over "
                            "attempt): is `manage.py anarchon` running? Waiting",
                            name,
                            holder.slot,
                            holder.attempt,
                            "lease expired" if holder.status == Status.RUNNING else "handed over, pending",
                            holder.instance_id or "no instance",
                            extra={"job": name},
                        )
                if stop is None:
                    sleep(settings.poll_interval)
                elif stop.wait(settings.poll_interval):
                    return None
            active = engine.adopt(run, sent)
            while active is not None and not active.finished.wait(0.2):
                if stop is not None and stop.is_set():
                    break  # engine.stop() below stops it
        finally:
            engine.stop()
        run.refresh_from_db()
        return run


scheduler = Scheduler()


def _require_installed() -> None:
    """Say what to do when the app is missing from INSTALLED_APPS (Django's own error names a model's app_label)."""
    from django.apps import apps

    if not apps.is_installed("django_anarchon"):
        raise SettingsError(
            None,
            "'django_anarchon' is not in INSTALLED_APPS: add it, then run `python manage.py migrate`",
            setting="INSTALLED_APPS",
        )


def run_now(name: str, data: Any = None) -> Run:
    """Ask for a manual run of job ``name`` on the default scheduler (see :meth:`Scheduler.run_now`)."""
    return scheduler.run_now(name, data)


async def arun_now(name: str, data: Any = None) -> Run:
    """The async twin of :func:`run_now`."""
    return await scheduler.arun_now(name, data)


def check_run_data(name: str, data: Any) -> None:
    """Raise what :func:`run_now` would raise for ``name`` and ``data``, recording nothing (the admin's forms)."""
    job = scheduler.job(name)
    scheduler._run_data(job, data)
