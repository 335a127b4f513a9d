"""Run history, per-job state and live instances.

Ownership of a run is decided by these tables only: the unique constraint on
(job, slot, attempt) and conditional UPDATEs on the lease columns, judged by the
database clock. The ``store`` package holds every query that depends on them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import models, router
from django.db.models.lookups import IContains, IEndsWith, IExact, IStartsWith
from django.db.models.sql import Query
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from .dbtime import DbNow


class Status(models.TextChoices):
    """Where a run stands. ``pending`` and ``running`` are the only non-final states."""

    PENDING = "pending", _("pending")
    RUNNING = "running", _("running")
    SUCCESS = "success", _("success")
    FAILED = "failed", _("failed")
    INTERRUPTED = "interrupted", _("interrupted")
    SKIPPED = "skipped", _("skipped")
    MISSED = "missed", _("missed")


FINAL_STATUSES = (Status.SUCCESS, Status.FAILED, Status.INTERRUPTED, Status.SKIPPED, Status.MISSED)


class Reason(models.TextChoices):
    """Why a run started."""

    SCHEDULED = "scheduled", _("scheduled")
    MANUAL = "manual", _("manual")
    CATCH_UP = "catch-up", _("catch-up")
    TAKEOVER = "takeover", _("takeover")


# A run that holds its job (overlap): running, or handed over and waiting for its next attempt.
# The one definition of an "active" run; the partial index anarchon_run_active is built on it,
# and the claim function (store/sql/claim_v*.sql) asks the same of the index.
ACTIVE = models.Q(status=Status.RUNNING) | models.Q(status=Status.PENDING, attempt__gt=1)


class ActiveRunsIndex(models.Index):
    """The index of active runs by job: partial (``WHERE`` :data:`ACTIVE`) where the database has
    partial indexes (PostgreSQL, SQLite), a plain index on ``job`` elsewhere (MySQL/MariaDB).

    A plain ``Index(condition=...)`` would do the same, but Django's system checks warn
    (``models.W037``) on every project that runs on MySQL/MariaDB, whose users can do nothing
    about it.
    """

    def __init__(self, *, name: str = "anarchon_run_active", **kwargs: Any) -> None:
        super().__init__(fields=["job"], name=name)

    def deconstruct(self) -> Any:
        path, args, kwargs = super().deconstruct()
        return path, args, {"name": self.name}

    def _get_condition_sql(self, model: Any, schema_editor: Any) -> str | None:
        return _where_sql(model, schema_editor, ACTIVE)


def _where_sql(model: Any, schema_editor: Any, condition: models.Q) -> str | None:
    """``condition`` as the SQL of a partial index's ``WHERE``; None where there are no partial indexes."""
    if not schema_editor.connection.features.supports_partial_indexes:
        return None
    query = Query(model=model, alias_cols=False)
    where = query.build_where(condition)
    compiler = query.get_compiler(connection=schema_editor.connection)
    sql, params = where.as_sql(compiler, schema_editor.connection)
    return str(sql % tuple(schema_editor.quote_value(p) for p in params))


class SuccessesIndex(models.Index):
    """The index of successful runs by job and end: what "the newest success of each job" reads
    (``job_overdue``, the last-success gauge). Partial (``WHERE status = 'success'``) where the
    database has partial indexes (PostgreSQL, SQLite); on ``(job, status, finished_at)`` elsewhere
    (MySQL/MariaDB).

    It replaced an index on ``(job, status)``, whose entry of every run was written at its claim
    and moved at its end: a hundred runs a second, each of another job, wrote to about a hundred
    leaf pages of it per transaction. Which runs of a job are running or pending is read through
    ``anarchon_run_status_lease`` (a few rows per status) or ``anarchon_run_active``.
    """

    def __init__(self, *, name: str = "anarchon_run_successes", **kwargs: Any) -> None:
        super().__init__(fields=["job", "finished_at"], name=name)

    def deconstruct(self) -> Any:
        path, args, kwargs = super().deconstruct()
        return path, args, {"name": self.name}

    def _get_condition_sql(self, model: Any, schema_editor: Any) -> str | None:
        # As ActiveRunsIndex: no ``condition=`` (models.W037 on MySQL/MariaDB).
        return _where_sql(model, schema_editor, models.Q(status=Status.SUCCESS))

    def create_sql(self, model: Any, schema_editor: Any, using: str = "", **kwargs: Any) -> Any:
        if schema_editor.connection.features.supports_partial_indexes:
            return super().create_sql(model, schema_editor, using=using, **kwargs)
        plain = models.Index(fields=["job", "status", "finished_at"], name=self.name)
        return plain.create_sql(model, schema_editor, using=using, **kwargs)


class JobNameField(models.CharField):
    """A job's name: compared exactly on every database, searched ignoring case.

    MySQL/MariaDB columns take the database's collation, usually case- and accent-insensitive,
    under which "sync" and "Sync" would be one job; this field asks for a binary collation there.
    Migration 0010 gives it to tables made by the migrations; this covers tables made from the
    models (``--no-migrations`` test databases). It deconstructs as a ``CharField``, so
    migrations never see it: a later migration altering the column must keep the collation.
    """

    def db_parameters(self, connection: Any) -> dict[str, Any]:
        parameters = super().db_parameters(connection)
        if connection.vendor == "mysql" and not self.db_collation:
            parameters["collation"] = "utf8mb4_bin"
        return parameters

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.CharField", args, kwargs


class _FoldingCase:
    """A case-insensitive lookup that ignores case on MySQL too, whose LIKE follows the binary collation.

    Both sides are lowered there; Django's own operators (``LIKE %s``, or the pattern for an
    expression on the right) do the rest, so wildcards stay escaped.
    """

    def as_mysql(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        lookup: Any = self
        lhs, lhs_params = lookup.process_lhs(compiler, connection)
        rhs, rhs_params = lookup.process_rhs(compiler, connection)
        return f"LOWER({lhs}) {lookup.get_rhs_op(connection, f'LOWER({rhs})')}", [*lhs_params, *rhs_params]


for _lookup in (IContains, IExact, IStartsWith, IEndsWith):
    JobNameField.register_lookup(type(f"_Folding{_lookup.__name__}", (_FoldingCase, _lookup), {}))


class RunQuerySet(models.QuerySet["Run"]):
    def active(self) -> RunQuerySet:
        """Runs that hold their job: running, or handed over and waiting for the next attempt."""
        return self.filter(ACTIVE)

    def finished(self) -> RunQuerySet:
        return self.filter(status__in=FINAL_STATUSES)


class Run(models.Model):
    """One attempt of one run of a job: the claim, the lease and the outcome."""

    job = JobNameField(_("job"), max_length=200)
    slot = models.BigIntegerField(_("slot"), help_text=_("Scheduled time in milliseconds since 1970 (UTC)."))
    attempt = models.PositiveIntegerField(_("attempt"), default=1)
    status = models.CharField(_("status"), max_length=16, choices=Status.choices)
    reason = models.CharField(_("reason"), max_length=16, choices=Reason.choices)
    manual = models.BooleanField(_("manual"), default=False)
    scheduled_at = models.DateTimeField(_("scheduled at"))
    instance_id = models.CharField(_("instance"), max_length=200, blank=True)
    # The per-process token of the runner holding the lease; private.
    owner = models.CharField(max_length=32, blank=True, editable=False)
    lease_expires_at = models.DateTimeField(_("lease expires at"), null=True, blank=True)
    created_at = models.DateTimeField(_("created at"), null=True, blank=True)
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    data = models.JSONField(_("data"), null=True, blank=True)
    progress = models.JSONField(_("progress"), null=True, blank=True)
    error_type = models.CharField(_("error type"), max_length=255, blank=True)
    error_message = models.TextField(_("error message"), blank=True)
    traceback = models.TextField(_("traceback"), blank=True)
    detail = models.TextField(_("detail"), blank=True)
    # A task job's run: the id of the task result its enqueue returned (committed with the run).
    # NULL for every other run: the claim statements (store/sql/claim_v*.sql) insert rows without
    # naming this column, and Django 4.2 has no database default to give them instead.
    task_result_id = models.CharField(_("task result"), max_length=255, null=True, blank=True)  # noqa: DJ001

    objects = RunQuerySet.as_manager()

    class Meta:
        verbose_name = _("run")
        verbose_name_plural = _("runs")
        constraints = [
            # Manual runs have a slot space of their own: run_now() at the very millisecond
            # of a scheduled slot must not take that slot's row.
            models.UniqueConstraint(
                fields=["job", "slot", "attempt", "manual"], name="anarchon_one_winner_per_attempt"
            ),
        ]
        permissions = [("cancel_run", _("Can cancel a pending run"))]
        indexes = [
            ActiveRunsIndex(name="anarchon_run_active"),
            models.Index(fields=["status", "lease_expires_at"], name="anarchon_run_status_lease"),
            SuccessesIndex(name="anarchon_run_successes"),
            models.Index(fields=["scheduled_at"], name="anarchon_run_scheduled"),
            models.Index(fields=["finished_at"], name="anarchon_run_finished"),
        ]

    def __str__(self) -> str:
        # In the current time zone, as the admin shows every other time, and named: the admin's
        # headings, its history and the instances page show this beside local times (helper 38).
        moment = self.scheduled_at
        if moment is not None and timezone.is_aware(moment):
            moment = timezone.localtime(moment)
        return f"{self.job} @ {moment:%Y-%m-%d %H:%M:%S %Z} #{self.attempt} ({self.status})"

    @property
    def is_active(self) -> bool:
        """Whether this run holds its job (see :data:`ACTIVE`)."""
        return self.status == Status.RUNNING or (self.status == Status.PENDING and self.attempt > 1)

    @property
    def duration(self) -> timedelta | None:
        """How long the attempt ran (None until it has started and finished)."""
        if self.started_at and self.finished_at:
            return self.finished_at - self.started_at
        return None


class JobState(models.Model):
    """The cluster-wide state of a job: paused or not, missed slots; one row per job name."""

    name = JobNameField(_("name"), max_length=200, primary_key=True)
    schedule = models.CharField(_("schedule"), max_length=300, blank=True)
    paused = models.BooleanField(_("paused"), default=False)
    pause_note = models.TextField(_("pause note"), blank=True)
    paused_at = models.DateTimeField(_("paused at"), null=True, blank=True)
    resumed_at = models.DateTimeField(_("resumed at"), null=True, blank=True)
    missed_count = models.PositiveBigIntegerField(_("missed slots"), default=0)
    # Bumped by every claim so that the UPDATE takes the job's row lock (on
    # SQLite: the database write lock) before anything is read.
    lock_seq = models.BigIntegerField(default=0, editable=False)
    first_seen = models.DateTimeField(_("first seen"), null=True, blank=True)
    # The newest scheduled (not manual) slot among the runs that history pruning
    # deleted: catch-up counts from it when no run of the job is left on record.
    pruned_slot = models.BigIntegerField(null=True, blank=True, editable=False)
    # When a running instance last said it declares the job (at start, then hourly): the
    # pending and running rows of a job no instance has declared for a while are closed.
    declared_at = models.DateTimeField(_("last declared"), null=True, blank=True)
    # When job_overdue was last sent for the job (alert_after): once per lapse, cluster-wide.
    overdue_alerted_at = models.DateTimeField(_("overdue alert sent"), null=True, blank=True)

    class Meta:
        verbose_name = _("job")
        verbose_name_plural = _("jobs")
        permissions = [
            ("run_job", _("Can run a job now")),
            ("pause_job", _("Can pause a job")),
            ("resume_job", _("Can resume a job")),
        ]

    def __str__(self) -> str:
        return self.name

    def pause(self, note: str = "") -> bool:
        """Pause the job cluster-wide with ``note``; False if it was already paused.

        One conditional UPDATE (``paused`` is false) that stamps ``paused_at``
        with the database clock. It takes the row lock that every claim takes
        first, so no scheduled or catch-up slot decided after it commits runs
        (manual runs still do).
        """
        return self._transition(paused=False, values={"paused": True, "pause_note": note, "paused_at": DbNow()})

    def resume(self) -> bool:
        """Resume a paused job; False if it was not paused.

        ``resumed_at`` (database clock) becomes the floor of catch-up, so the
        slots that fell in the paused period are never run afterwards. The
        note and ``paused_at`` stay as the record of the last pause.
        """
        return self._transition(paused=True, values={"paused": False, "resumed_at": DbNow()})

    def _transition(self, *, paused: bool, values: dict[str, object]) -> bool:
        db = self._state.db or router.db_for_write(JobState)
        won = bool(JobState.objects.using(db).filter(pk=self.pk, paused=paused).update(**values))
        # Read back what the database holds: ours if we won, else the concurrent winner's.
        try:
            self.refresh_from_db(using=db, fields=list(values))
        except JobState.DoesNotExist:
            return False
        return won


class Instance(models.Model):
    """A running ``manage.py anarchon`` process (or embedded scheduler)."""

    token = models.CharField(max_length=32, primary_key=True, editable=False)
    instance_id = models.CharField(_("instance"), max_length=200)
    host = models.CharField(_("host"), max_length=255)
    pid = models.PositiveIntegerField(_("pid"))
    started_at = models.DateTimeField(_("started at"))
    last_heartbeat = models.DateTimeField(_("last heartbeat"))
    # The database clock minus this host's, in ms, as the instance last measured it.
    clock_offset_ms = models.FloatField(_("clock offset (ms)"), null=True, blank=True)

    class Meta:
        verbose_name = _("instance")
        verbose_name_plural = _("instances")

    def __str__(self) -> str:
        return self.instance_id
