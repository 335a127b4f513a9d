"""The run history: read-only, newest first, errors and data shown escaped."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db import connections, router
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

import django_anarchon

from .. import metrics, store
from ..dbtime import converts_to
from ..exceptions import UnknownJobError
from ..models import JobState, Run, Status
from .display import ReadOnlyAdmin, declared_job, format_seconds, moment_column, pretty_json, status_badge


class RunChangeList(ChangeList):
    """The run history's list: without its date bar where the database cannot convert times to the admin's time zone.

    On MySQL/MariaDB without the server's time zone tables, and a time zone other than the
    connection's, the date bar's query raises (``CONVERT_TZ`` answers NULL), and with it every page
    of the history. The history is shown without the bar, and says why (``anarchon.W004`` too).
    """

    def __init__(
        self,
        request: HttpRequest,
        model: Any,
        list_display: Any,
        list_display_links: Any,
        list_filter: Any,
        date_hierarchy: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        zone = timezone.get_current_timezone_name()
        if date_hierarchy and not converts_to(connections[router.db_for_read(model)], zone):
            date_hierarchy = None
            messages.warning(
                request,
                gettext(
                    "The date bar is left out: the database server cannot convert times to %(zone)s "
                    "(its time zone tables are not loaded). Load them with "
                    "“mariadb-tzinfo-to-sql /usr/share/zoneinfo | mariadb -u root mysql”."
                )
                % {"zone": zone},
            )
        super().__init__(request, model, list_display, list_display_links, list_filter, date_hierarchy, *args, **kwargs)


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    """The run history: one row per attempt, newest first."""

    list_display = [
        "job",
        "scheduled",
        "attempt",
        "reason",
        "status_badge",
        "instance_id",
        "started",
        "duration_display",
        "short_error",
    ]
    list_filter = ["status", "job", "reason"]
    search_fields = ["job", "instance_id", "error_type", "error_message"]
    date_hierarchy = "scheduled_at"
    ordering = ["-scheduled_at", "-id"]  # newest first; later attempts (higher ids) before earlier ones
    list_per_page = 50
    actions = ["cancel"]
    change_form_template = "admin/django_anarchon/run/change_form.html"

    class Media:
        css = {"all": ["django_anarchon/admin.css"]}

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RunChangeList

    def get_urls(self) -> list[Any]:
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        view = self.admin_site.admin_view(self.run_again_view)
        return [path("<path:object_id>/run-again/", view, name=f"{prefix}_run_again"), *super().get_urls()]

    def has_run_again_permission(self, request: HttpRequest) -> bool:
        """May the user request runs (``django_anarchon.run_job``)?"""
        return request.user.has_perm(f"{self.opts.app_label}.run_job")

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """A run's page, with "Run again with the same data" for a job still declared."""
        run = self.get_object(request, object_id)
        extra = {
            "can_run_again": run is not None
            and self.has_run_again_permission(request)
            and declared_job(run.job) is not None,
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra)

    def run_again_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: request a manual run of the same job with this run's data; go to the new run."""
        if not self.has_run_again_permission(request):
            raise PermissionDenied
        run = get_object_or_404(Run, pk=object_id)
        if request.method != "POST":
            return HttpResponseRedirect(
                reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[run.pk])
            )
        try:
            again = django_anarchon.run_now(run.job, run.data)
        except UnknownJobError:
            self.message_user(
                request, gettext("Job %(name)s is not declared in code.") % {"name": run.job}, messages.ERROR
            )
            return HttpResponseRedirect(
                reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[run.pk])
            )
        message = gettext("Requested a run of %(name)s again with the data of run %(pk)s.") % {
            "name": run.job,
            "pk": run.pk,
        }
        self.log_change(request, run, message)
        state = JobState.objects.filter(name=run.job).first()
        if state is not None:
            self.log_change(request, state, message)
        self.message_user(request, message, messages.SUCCESS)
        return HttpResponseRedirect(
            reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[again.pk])
        )

    show_full_result_count = False  # COUNT(*) over a long history is slow on PostgreSQL
    fieldsets = [
        (None, {"fields": ["job", "status_badge", "reason", "manual", "scheduled", "slot", "attempt"]}),
        (
            _("Execution"),
            {
                "fields": [
                    "instance_id",
                    "created",
                    "started",
                    "finished",
                    "duration_display",
                    "lease_expires",
                    "detail",
                    "task_result_display",
                ]
            },
        ),
        (_("Error"), {"fields": ["error_type", "error_message", "traceback_display"]}),
        (_("Data"), {"fields": ["data_display", "progress_display"]}),
    ]

    scheduled = moment_column("scheduled_at", _("scheduled at"))
    created = moment_column("created_at", _("created at"))
    started = moment_column("started_at", _("started at"))
    finished = moment_column("finished_at", _("finished at"))
    lease_expires = moment_column("lease_expires_at", _("lease expires at"))

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        """May the user cancel pending runs (``django_anarchon.cancel_run``)?"""
        return request.user.has_perm(f"{self.opts.app_label}.cancel_run")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """The view permission, or the permission to cancel pending runs."""
        return super().has_view_permission(request, obj) or self.has_cancel_permission(request)

    @admin.action(description=_("Cancel pending runs"), permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        """Record the selected pending runs as skipped (cancelled); runs already started are left alone."""
        user = request.user.get_username()
        detail = gettext("cancelled by %(user)s in the admin") % {"user": user}
        # Counted, and only the pending ones read: "select all" on the whole history is
        # hundreds of thousands of rows, of which a handful can be pending.
        selected = queryset.count()
        pending = list(queryset.filter(status=Status.PENDING).values_list("pk", flat=True))
        cancelled = store.cancel_pending(pending, detail)
        for run in cancelled:
            self.log_change(request, run, detail)
            metrics.SKIPPED.labels(run.job, "cancelled").inc()  # counted by the process that cancels
        if cancelled:
            message = ngettext("Cancelled %(count)d pending run.", "Cancelled %(count)d pending runs.", len(cancelled))
            self.message_user(request, message % {"count": len(cancelled)}, messages.SUCCESS)
        if len(cancelled) < selected:
            left = selected - len(cancelled)
            message = ngettext(
                "%(count)d selected run was not pending (already started or ended) and was left as it is.",
                "%(count)d selected runs were not pending (already started or ended) and were left as they are.",
                left,
            )
            self.message_user(request, message % {"count": left}, messages.WARNING)

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, run: Run) -> str:
        """The status as a coloured badge."""
        return status_badge(run.status)

    @admin.display(description=_("duration"))
    def duration_display(self, run: Run) -> str:
        """How long the attempt ran."""
        duration = run.duration
        return format_seconds(duration.total_seconds()) if duration is not None else self.get_empty_value_display()

    @admin.display(description=_("error"))
    def short_error(self, run: Run) -> str:
        """The error type and message, shortened to one line."""
        text = ": ".join(part for part in (run.error_type, run.error_message) if part)
        return Truncator(" ".join(text.split())).chars(80)

    @admin.display(description=_("traceback"))
    def traceback_display(self, run: Run) -> str:
        """The traceback, escaped, in a <pre> block."""
        return format_html("<pre>{}</pre>", run.traceback) if run.traceback else self.get_empty_value_display()

    @admin.display(description=_("task result"))
    def task_result_display(self, run: Run) -> str:
        """A task job's run: the task result it enqueued, linked to its admin page where the backend has one."""
        if not run.task_result_id:
            return self.get_empty_value_display()
        url = self._task_result_url(run)
        if url is None:
            return format_html("<code>{}</code>", run.task_result_id)
        return format_html('<a href="{}"><code>{}</code></a>', url, run.task_result_id)

    def _task_result_url(self, run: Run) -> str | None:
        """The admin page of the run's task result (django-tasks-db keeps results in a model), or None."""
        from .. import taskjobs
        from ..scheduler import scheduler

        try:
            task = scheduler.job(run.job).task
            model = taskjobs.result_model(taskjobs.backend_of(task)) if task is not None else None
        except Exception:
            return None  # the job or its backend is gone: the id is still shown
        if model is None or model not in self.admin_site._registry:
            return None
        meta = model._meta
        try:
            return reverse(
                f"{self.admin_site.name}:{meta.app_label}_{meta.model_name}_change", args=[run.task_result_id]
            )
        except Exception:
            return None

    @admin.display(description=_("data"))
    def data_display(self, run: Run) -> str:
        """The run's data as indented JSON."""
        return pretty_json(run.data) if run.data is not None else self.get_empty_value_display()

    @admin.display(description=_("progress"))
    def progress_display(self, run: Run) -> str:
        """The progress last saved by the handler, as indented JSON."""
        return pretty_json(run.progress) if run.progress is not None else self.get_empty_value_display()
