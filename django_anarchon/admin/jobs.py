"""The jobs: one row per job, declared or left in the database, with Run now, Pause and Resume.

Nothing here runs a job: "Run now" records a pending manual run that a
scheduler instance picks up, and pause/resume are the conditional UPDATEs of
:meth:`JobState.pause` and :meth:`JobState.resume`.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

from django.contrib import admin, messages
from django.db.models import BooleanField, OuterRef, QuerySet, Subquery, Value
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

import django_anarchon

from .. import store
from ..conf import get_settings
from ..durations import format_ms
from ..exceptions import AnarchonError, UnknownJobError
from ..models import Instance, JobState, Run
from ..scheduler import check_run_data
from .display import (
    ReadOnlyAdmin,
    admin_url,
    declared_job,
    describe_schedule,
    moment_column,
    status_badge,
    when,
)
from .job_actions import (
    JobPageButtons,
    PauseForm,
    RunDataForm,
    form_page,
    no_instance_message,
    pause,
    request_run,
    resume,
)


class DeclaredFilter(admin.SimpleListFilter):
    """Jobs declared in this project's code, or only left in the database."""

    title = _("declared in code")
    parameter_name = "declared"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        """The filter's choices."""
        return [("yes", _("Yes")), ("no", _("No (not declared in code)"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """Keep the jobs declared in code, or the ones that are not."""
        names = django_anarchon.scheduler.registry.names()
        if self.value() == "yes":
            return queryset.filter(name__in=names)
        if self.value() == "no":
            return queryset.exclude(name__in=names)
        return queryset


@admin.register(JobState)
class JobStateAdmin(JobPageButtons, ReadOnlyAdmin):
    """The jobs: declared ones and those left in the database; changed only through actions."""

    list_display = [
        "name",
        "schedule_in_words",
        "next_due",
        "last_run",
        "last_status",
        "paused",
        "pause_note_shown",
        "missed_count",
    ]
    list_filter = ["paused", DeclaredFilter]
    search_fields = ["name"]
    ordering = ["name"]
    actions = ["run_now", "run_now_with_data", "pause", "resume"]
    change_form_template = "admin/django_anarchon/jobstate/change_form.html"
    fieldsets = [
        (None, {"fields": ["name", "schedule_in_words", "options", "handler", "next_due"]}),
        (_("History"), {"fields": ["last_run", "last_status", "runs", "missed_count", "first_seen_at"]}),
        (_("Pause"), {"fields": ["paused", "pause_note", "paused_since", "resumed"]}),
    ]
    first_seen_at = moment_column("first_seen", _("first seen"))
    paused_since = moment_column("paused_at", _("paused at"))
    resumed = moment_column("resumed_at", _("resumed at"))

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        """The jobs, each annotated with its newest run (pk, scheduled time, status)."""
        latest = Run.objects.filter(job=OuterRef("name")).order_by("-slot", "-attempt")
        # A user who may not view runs gets the time without a link (the link would answer 403).
        may_view_runs = request.user.has_perm(f"{Run._meta.app_label}.view_run")
        return (
            super()
            .get_queryset(request)
            .annotate(
                last_run_pk=Subquery(latest.values("pk")[:1]),
                last_run_at=Subquery(latest.values("scheduled_at")[:1]),
                last_run_status=Subquery(latest.values("status")[:1]),
                last_run_linked=Value(may_view_runs, output_field=BooleanField()),
            )
        )

    class Media:
        css = {"all": ["django_anarchon/admin.css"]}

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """A job's page, with the buttons the user may use."""
        extra = {
            "can_run": self.has_run_permission(request) and declared_job(object_id) is not None,
            "can_pause": self.has_pause_permission(request),
            "can_resume": self.has_resume_permission(request),
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """The jobs list, after giving every declared job its row."""
        self.create_missing_states()
        return super().changelist_view(request, extra_context)

    def create_missing_states(self) -> None:
        """Give every declared job a row, so that jobs no scheduler has started yet are listed.

        Reads first and writes only when a row is missing, so that viewing the
        list does not take SQLite's write lock; racing inserts are ignored.
        """
        jobs = django_anarchon.scheduler.jobs
        for start in range(0, len(jobs), 500):
            chunk = jobs[start : start + 500]
            known = set(JobState.objects.filter(name__in=[j.name for j in chunk]).values_list("name", flat=True))
            missing = [
                JobState(name=j.name, schedule=j.schedule.describe()[:300], first_seen=store.DbNow())
                for j in chunk
                if j.name not in known
            ]
            if missing:
                JobState.objects.bulk_create(missing, ignore_conflicts=True)

    # Permissions: one per action; holding any of them also lets a user see the jobs.

    def has_run_permission(self, request: HttpRequest) -> bool:
        """May the user request a run now (``django_anarchon.run_job``)?"""
        return request.user.has_perm(f"{self.opts.app_label}.run_job")

    def has_pause_permission(self, request: HttpRequest) -> bool:
        """May the user pause jobs (``django_anarchon.pause_job``)?"""
        return request.user.has_perm(f"{self.opts.app_label}.pause_job")

    def has_resume_permission(self, request: HttpRequest) -> bool:
        """May the user resume jobs (``django_anarchon.resume_job``)?"""
        return request.user.has_perm(f"{self.opts.app_label}.resume_job")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """The view permission, or any of the three action permissions."""
        return (
            super().has_view_permission(request, obj)
            or self.has_run_permission(request)
            or self.has_pause_permission(request)
            or self.has_resume_permission(request)
        )

    # Columns.

    @admin.display(description=_("schedule"))
    def schedule_in_words(self, state: JobState) -> str:
        """The schedule in words, or a clear 'not declared in code'."""
        job = declared_job(state.name)
        if job is not None:
            return describe_schedule(job.schedule)
        was = f" ({gettext('last known schedule: %s') % state.schedule})" if state.schedule else ""
        return format_html('<strong class="anarchon-undeclared">{}</strong>{}', gettext("not declared in code"), was)

    @admin.display(description=_("next due"))
    def next_due(self, state: JobState) -> str:
        """The next slot after now (declared jobs only)."""
        job = declared_job(state.name)
        if job is None:
            return self.get_empty_value_display()
        due = when(datetime.fromtimestamp(job.schedule.next_after(int(time.time() * 1000)) / 1000, tz=timezone.utc))
        if state.paused:
            return format_html(
                '<span class="anarchon-paused">{}</span> <del title="{}">{}</del>',
                gettext("paused"),
                gettext("its scheduled slots are not run while it is paused"),
                due,
            )
        return due

    @admin.display(description=_("last run"), ordering="last_run_at")
    def last_run(self, state: JobState) -> str:
        """A link to the newest run of the job."""
        pk, moment = getattr(state, "last_run_pk", None), getattr(state, "last_run_at", None)
        if pk is None or moment is None:
            return self.get_empty_value_display()
        if not getattr(state, "last_run_linked", True):
            return when(moment)
        return format_html('<a href="{}">{}</a>', admin_url(Run, "change", pk), when(moment))

    @admin.display(description=_("last status"), ordering="last_run_status")
    def last_status(self, state: JobState) -> str:
        """The newest run's status as a badge."""
        status = getattr(state, "last_run_status", None)
        return status_badge(status) if status else self.get_empty_value_display()

    @admin.display(description=_("pause note"))
    def pause_note_shown(self, state: JobState) -> str:
        """The pause note, while the job is paused."""
        return Truncator(state.pause_note).chars(80) if state.paused else ""

    @admin.display(description=_("options"))
    def options(self, state: JobState) -> str:
        """The job's overlap, catch-up and timeout options."""
        job = declared_job(state.name)
        if job is None:
            return self.get_empty_value_display()
        parts = [f"overlap={job.overlap}", f"catch_up={job.catch_up}"]
        if job.timeout_ms:
            parts.append(f"timeout={format_ms(job.timeout_ms)}")
        return ", ".join(parts)

    @admin.display(description=_("handler"))
    def handler(self, state: JobState) -> str:
        """Where the handler is defined."""
        job = declared_job(state.name)
        return job.origin if job is not None else self.get_empty_value_display()

    @admin.display(description=_("runs"))
    def runs(self, state: JobState) -> str:
        """A link to the run history filtered on this job."""
        url = f"{admin_url(Run, 'changelist')}?{urlencode({'job': state.name})}"
        return format_html('<a href="{}">{}</a>', url, gettext("Run history of this job"))

    # Actions.

    @admin.action(description=_("Run now"), permissions=["run"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[JobState]) -> None:
        """Record a pending manual run of each selected job; a scheduler instance runs it."""
        self._request_runs(request, list(queryset), None)

    @admin.action(description=_("Run now with data…"), permissions=["run"])
    def run_now_with_data(self, request: HttpRequest, queryset: QuerySet[JobState]) -> HttpResponse | None:
        """Ask for the run's data (JSON) on a form, then record a pending manual run of each selected job."""
        form = RunDataForm(request.POST if "run_data" in request.POST else None)
        states = list(queryset)
        if not form.is_bound or not form.is_valid():
            return form_page(self, request, "run_now_confirmation.html", gettext("Run now"), states, form)
        data = form.cleaned_data["run_data"]
        # Data a selected job cannot take (a task job whose task has no data argument) is refused on
        # the form before any run is recorded, as the job page's button does.
        for state in states:
            try:
                check_run_data(state.name, data)
            except UnknownJobError:
                continue  # said after the others are requested
            except AnarchonError as error:
                form.add_error("run_data", str(error))
        if form.errors:
            return form_page(self, request, "run_now_confirmation.html", gettext("Run now"), states, form)
        self._request_runs(request, states, data)
        return None

    def _request_runs(self, request: HttpRequest, states: list[JobState], data: Any) -> None:
        requested, undeclared = [], []
        for state in states:
            if request_run(self, request, state, data) is None:
                undeclared.append(state.name)
            else:
                requested.append(state.name)
        if requested:
            names = {"count": len(requested), "names": ", ".join(requested)}
            if self._instances_alive():
                message = ngettext(
                    "Requested a run of %(names)s: a scheduler instance starts it within one poll interval.",
                    "Requested runs of %(count)d jobs (%(names)s): scheduler instances start them within one poll "
                    "interval.",
                    len(requested),
                )
                self.message_user(request, message % names, messages.SUCCESS)
            else:
                self.message_user(request, no_instance_message(len(requested)) % names, messages.WARNING)
        if undeclared:
            message = ngettext(
                "Cannot run %(names)s: it is not declared in code (no jobs.py of this project declares it).",
                "Cannot run %(names)s: they are not declared in code (no jobs.py of this project declares them).",
                len(undeclared),
            ) % {"names": ", ".join(undeclared)}
            self.message_user(request, message, messages.ERROR)

    @admin.action(description=_("Pause"), permissions=["pause"])
    def pause(self, request: HttpRequest, queryset: QuerySet[JobState]) -> HttpResponse | None:
        """Ask for a note on a confirmation page, then pause the selected jobs with it."""
        form = PauseForm(request.POST if "post" in request.POST else None)
        if not form.is_bound or not form.is_valid():
            return form_page(self, request, "pause_confirmation.html", gettext("Pause jobs"), list(queryset), form)
        reason = form.cleaned_data["reason"].strip()
        states = list(queryset)
        paused = [s.name for s in states if pause(self, request, s, reason)]
        if paused:
            message = ngettext("Paused %(names)s.", "Paused %(count)d jobs: %(names)s.", len(paused))
            self.message_user(request, message % {"count": len(paused), "names": ", ".join(paused)}, messages.SUCCESS)
        if len(paused) < len(states):
            skipped = len(states) - len(paused)
            message = ngettext("%(count)d job was already paused.", "%(count)d jobs were already paused.", skipped)
            self.message_user(request, message % {"count": skipped}, messages.WARNING)
        return None

    @admin.action(description=_("Resume"), permissions=["resume"])
    def resume(self, request: HttpRequest, queryset: QuerySet[JobState]) -> None:
        """Resume the selected paused jobs; the paused period is never caught up."""
        states = list(queryset)
        resumed = [s.name for s in states if resume(self, request, s)]
        if resumed:
            message = ngettext("Resumed %(names)s.", "Resumed %(count)d jobs: %(names)s.", len(resumed))
            self.message_user(request, message % {"count": len(resumed), "names": ", ".join(resumed)})
        if len(resumed) < len(states):
            skipped = len(states) - len(resumed)
            message = ngettext("%(count)d job was not paused.", "%(count)d jobs were not paused.", skipped)
            self.message_user(request, message % {"count": skipped}, messages.WARNING)

    def _instances_alive(self) -> bool:
        since = store.database_time() - timedelta(seconds=3 * get_settings().lease_ttl)
        return Instance.objects.filter(last_heartbeat__gte=since).exists()
