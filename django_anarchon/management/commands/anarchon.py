"""``manage.py anarchon``: run the scheduler loop, list the jobs, or run one job now."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from argparse import ArgumentParser, ArgumentTypeError
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from django.core.checks import Tags
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from django_anarchon import scheduler
from django_anarchon.dbtrouble import reset_connection
from django_anarchon.exceptions import AnarchonError
from django_anarchon.taskjobs import task_name


def _errors_reach_stderr() -> bool:
    """Whether an ERROR record of the ``django_anarchon`` logger (with its traceback) is written to stderr.

    Looks for a handler on the way up the logger tree that writes to stderr and lets
    ERROR through (or, with no handler at all, Python's last-resort one, which does).
    """
    logger: logging.Logger | None = logging.getLogger("django_anarchon")
    if not logger or not logger.isEnabledFor(logging.ERROR):
        return False
    found_any = False
    while logger is not None:
        for handler in logger.handlers:
            found_any = True
            stream = getattr(handler, "stream", None)
            if (
                isinstance(handler, logging.StreamHandler)
                and stream in (sys.stderr, sys.__stderr__)
                and handler.level <= logging.ERROR
                and not handler.filters
            ):
                return True
        logger = logger.parent if logger.propagate else None
    last = logging.lastResort
    return not found_any and last is not None and last.level <= logging.ERROR


def _instance_id(value: str) -> str:
    if not value.strip() or len(value) > 200:
        raise ArgumentTypeError("must be a non-empty string of at most 200 characters")
    return value


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 < port < 65536:
        raise ArgumentTypeError(f"{port} is not a port number (1-65535)")
    return port


def _json(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError as error:
        raise ArgumentTypeError(f"is not valid JSON ({error})") from None


class Command(BaseCommand):
    help = (
        "Run the django-anarchon scheduler until SIGTERM or SIGINT (a second SIGINT exits at once). "
        "Run it on every instance of the project: exactly one instance wins each scheduled run."
    )
    # The system checks run in handle(), where a database that cannot be reached yet is waited for:
    # from Django 6.1 the model checks connect (a JSONField's asks SQLite and MySQL what they support),
    # and Django running them first made the command crash on a database down at start.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: ArgumentParser) -> None:
        if not any("--skip-checks" in action.option_strings for action in parser._actions):
            # Django adds it only for a command whose checks it runs itself (see requires_system_checks).
            parser.add_argument("--skip-checks", action="store_true", help="Skip system checks.")
        parser.add_argument("--instance-id", type=_instance_id, help="Name this instance (default: host:pid:random).")
        action = parser.add_mutually_exclusive_group()
        action.add_argument("--list", action="store_true", help="List the jobs, their schedules and next due times.")
        action.add_argument("--run", metavar="NAME", help="Run job NAME once in the foreground (reason 'manual').")
        action.add_argument(
            "--check",
            action="store_true",
            help="Exit 0 if a scheduler instance (with --instance-id: that one) is alive and well, else 1 "
            "with the reason. For health probes; runs no scheduler.",
        )
        parser.add_argument("--data", type=_json, help="JSON data for --run (becomes ctx.data).")
        parser.add_argument(
            "--metrics-port",
            type=_port,
            metavar="PORT",
            help="Serve Prometheus metrics on this port (needs django-anarchon[prometheus]).",
        )
        parser.add_argument(
            "--metrics-address",
            default="0.0.0.0",  # noqa: S104 - a metrics endpoint is meant to be scraped
            metavar="ADDRESS",
            help="The address --metrics-port listens on (default 0.0.0.0, every interface; 127.0.0.1: this host only).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self._configure_logging(options["verbosity"])
        skip_checks = bool(options.get("skip_checks"))
        if options["list"]:
            from django_anarchon import store
            from django_anarchon.health import absent_sqlite_file

            # Read before anything connects: connecting creates an empty SQLite file (helper 37), and
            # Django 6.1's system checks connect (JSONField's), as --check knows.
            absent = absent_sqlite_file(store.alias())
            with contextlib.suppress(DatabaseError):  # what follows says the database is unreachable
                self._system_checks(skip=skip_checks, offline=absent is not None)
            self._list(absent)
            return
        if options["check"]:
            self._check_health(options["instance_id"])
            return
        if not self._checked_once_reachable(wait=not options["run"], skip_checks=skip_checks):
            return  # stopped while waiting for the database
        if options["run"]:
            self._run_one(options["run"], options["data"], options["instance_id"])
            return
        if options["data"] is not None:
            raise CommandError("--data only applies to --run")
        if options["metrics_port"]:
            from django_anarchon import metrics

            try:
                metrics.serve(options["metrics_port"], options["metrics_address"])
            except (AnarchonError, OSError) as error:
                raise CommandError(f"--metrics-port: {error}") from None
        self._serve(options["instance_id"])

    def _checked_once_reachable(self, *, wait: bool = True, skip_checks: bool = False) -> bool:
        """Run the checks that need the database (e.g. the MySQL session time zone, the migrations).

        An instance started during a database outage does not crash: it says so, and waits for
        the database (retrying with backoff) to run them before it schedules anything, so that a
        database it must refuse is refused then. False if it was stopped while waiting. Without
        ``wait`` (``--run``, a one-off command), an unreachable database is an error at once.
        """
        from django_anarchon import store

        log = logging.getLogger("django_anarchon")
        delay, waited_since = START_RETRY_S, None
        general_done = False
        with _stopped_by_signals() as stop:
            while True:
                try:
                    if not general_done:
                        self._system_checks(skip=skip_checks)
                        general_done = True
                    self.check(databases=[store.alias()], tags=[Tags.database])
                    _refuse_unapplied_migrations(store.alias())
                except DatabaseError as error:
                    if not wait:
                        raise CommandError(f"the database is unreachable: {str(error).strip()}") from None
                    if waited_since is None:
                        waited_since = time.monotonic()
                        log.warning(
                            "Database unreachable at start (%s); waiting for it to run the checks that need it "
                            "before scheduling anything",
                            str(error).strip(),
                        )
                    reset_connection(store.alias())
                    if stop.wait(delay):
                        return False
                    delay = min(2 * delay, START_RETRY_MAX_S)
                    continue
                if waited_since is not None:
                    log.warning(
                        "Database reachable after %.1fs; its checks passed, starting",
                        time.monotonic() - waited_since,
                    )
                return True

    def _system_checks(self, *, skip: bool, offline: bool = False) -> None:
        """Django's system checks but the ``database`` ones, as BaseCommand runs them (unless --skip-checks).

        ``offline``: the SQLite file does not exist, and connecting would create it empty. The model
        checks are left out too (from Django 6.1 a JSONField's connects); the others, ours among
        them (settings, job declarations), still run.
        """
        if skip:
            return
        if not offline:
            self.check()
            return
        from django.core.checks import registry

        tags = sorted(set(registry.registry.tags_available()) - {Tags.models, Tags.database})
        if tags:
            self.check(tags=tags)

    def _configure_logging(self, verbosity: int) -> None:
        """Log to stderr unless the project's LOGGING already handles ``django_anarchon``.

        ``-v 0`` logs warnings and errors only, ``-v 2`` and more debug too (whatever
        LOGGING says: they are asked for on the command line); the default ``-v 1``
        logs from INFO, or at the level LOGGING gives the logger.
        """
        logger = logging.getLogger("django_anarchon")
        level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
        if logger.hasHandlers() and any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            if verbosity != 1:
                logger.setLevel(level)
            return
        if logging.getLogger().handlers:
            logger.setLevel(level)
            return
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)

    def _list(self, absent: str | None) -> None:
        """The jobs; ``absent``: the SQLite file of the database, which does not exist (not to be created)."""
        jobs = scheduler.jobs
        if not jobs:
            self.stdout.write("No jobs are declared. Add a jobs.py to an installed app.")
            return
        from django_anarchon import store

        try:
            if absent is not None:
                raise DatabaseError(f"the SQLite database file {absent} does not exist")
            now = int(store.database_time().timestamp() * 1000)
            paused = self._paused_names()
        except DatabaseError as error:
            # Still worth listing (schedules, next due times), but not as if all were known.
            now, paused = int(time.time() * 1000), set()
            self.stderr.write(
                f"Could not read the database ({type(error).__name__}: {str(error).strip()}): "
                "next due times are by this host's clock, and paused jobs are not marked PAUSED."
            )
        width = max(len(j.name) for j in jobs)
        schedule_width = max(len(j.schedule.describe()) for j in jobs)
        for job in jobs:
            due = datetime.fromtimestamp(job.schedule.next_after(now) / 1000, tz=timezone.utc)
            tz = getattr(job.schedule, "tz", None)
            local = f" ({_when(due.astimezone(tz))} {due.astimezone(tz):%Z})" if tz is not None else ""
            flags = [f"overlap={job.overlap}", f"catch_up={job.catch_up}"]
            if job.timeout_ms:
                flags.append(f"timeout={job.timeout_ms / 1000:g}s")
            if job.alert_after_ms:
                flags.append(f"alert_after={job.alert_after_ms / 1000:g}s")
            if job.is_task_job:
                flags.append(f"task={task_name(job.task)}")
            if job.name in paused:
                flags.append("PAUSED")
            self.stdout.write(
                f"{job.name:<{width}}  {job.schedule.describe():<{schedule_width}}  "
                f"next {_when(due)} UTC{local}  " + " ".join(flags)
            )

    def _check_health(self, instance_id: str | None) -> None:
        from django_anarchon.health import check_health

        health = check_health(instance_id)
        if not health.ok:
            raise CommandError(f"unhealthy: {health.reason}", returncode=1)
        self.stdout.write(f"ok: {health.reason}")

    def _paused_names(self) -> set[str]:
        from django_anarchon.models import JobState

        return set(JobState.objects.filter(paused=True).values_list("name", flat=True))

    def _run_one(self, name: str, data: Any, instance_id: str | None) -> None:
        with _stopped_by_signals() as stop:
            try:
                run = scheduler.run_once(name, data, instance_id=instance_id, stop=stop)
            except AnarchonError as error:
                raise CommandError(str(error)) from None
        if run is None:
            raise CommandError(f"stopped before job {name!r} could run (another run of it had not ended)")
        self.stdout.write(f"{run.job} slot={run.slot} attempt={run.attempt}: {run.status}")
        if run.status != "success":
            # The run's "Run failed" log line carries the handler's traceback where it reaches the
            # terminal; a task job's log line has this process's, and the row the task's own.
            if run.traceback and (scheduler.job(name).is_task_job or not _errors_reach_stderr()):
                self.stderr.write(run.traceback.rstrip("\n"))
            raise CommandError(f"the run ended {run.status}: {run.error_type}: {run.error_message}".rstrip(": "))

    def _serve(self, instance_id: str | None) -> None:
        with _stopped_by_signals() as stop:
            _freeze_startup_objects()
            try:
                scheduler.start(instance_id=instance_id)
            except AnarchonError as error:
                raise CommandError(str(error)) from None
            while not stop.wait(1.0):
                pass
            log = logging.getLogger("django_anarchon")
            log.info("Stopping: handlers get their grace period")
            if not scheduler.stop():
                # A handler that ignored its signal was handed over and may run
                # again elsewhere already; it must not go on here. Its thread may
                # be one Python waits for at exit (an executor's, an async
                # handler's sync_to_async), so leave without waiting.
                log.warning("Exiting without waiting for handlers that did not end within the grace period")
                _flush_and_exit(0)


# Waiting for an unreachable database at start: the first retry, and the longest wait between two.
START_RETRY_S = 0.5
START_RETRY_MAX_S = 5.0


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[threading.Event]:
    """An event set by SIGTERM or SIGINT while inside; a second SIGINT exits at once (130).

    Installed whatever was there before: a process started in the background by a
    shell without job control inherits SIGINT ignored, and would never stop on it.
    """
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and stop.is_set():
            os._exit(130)  # a second Ctrl-C: leave now, leases expire on their own
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _refuse_unapplied_migrations(alias: str) -> None:
    """Stop with a clear error when django_anarchon's tables are missing or out of date.

    Otherwise the scheduler would start, fail every query with a missing table,
    and retry quietly for ever. Raises ``DatabaseError`` when the database
    cannot be reached (the caller starts anyway and retries).
    """
    from django_anarchon.health import unapplied_migrations

    missing = unapplied_migrations(alias)
    if missing:
        raise CommandError(
            f"The database {alias!r} lacks django_anarchon's migrations {', '.join(missing)}: "
            f"run `python manage.py migrate` first."
        )


def _freeze_startup_objects() -> None:
    """Leave what start-up created (Django, the project's modules, the jobs) out of garbage collections.

    Those objects live as long as the process. In a Django process a full
    collection scans them all, and one that struck when runs were due delayed
    every handler of that instant by as long as it took (docs/performance.md).
    ``gc.freeze()`` moves them to the permanent generation, which no collection
    scans. This process is ours; an embedded :meth:`Scheduler.start` leaves the
    host's collector alone.
    """
    gc.collect()
    gc.freeze()


def _flush_and_exit(code: int) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe must not keep us here
            stream.flush()
    os._exit(code)


def _when(moment: datetime) -> str:
    """``2027-01-15 08:00:00``, with milliseconds when the moment has them (a 1500ms job's slots)."""
    text = f"{moment:%Y-%m-%d %H:%M:%S}"
    return f"{text}.{moment.microsecond // 1000:03d}" if moment.microsecond else text
