"""The scheduler instances: host, pid, heartbeat age (judged by the database clock) and what each runs."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone as django_timezone
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from .. import store
from ..conf import get_settings
from ..models import Instance, Run, Status
from .display import ReadOnlyAdmin, admin_url, format_seconds, moment_column, when


@admin.register(Instance)
class InstanceAdmin(ReadOnlyAdmin):
    """The scheduler processes that have registered, with how fresh their heartbeat is."""

    list_display = ["instance_id", "host", "pid", "started", "heartbeat", "running"]
    search_fields = ["instance_id", "host"]
    ordering = ["instance_id"]
    fieldsets = [(None, {"fields": ["instance_id", "host", "pid", "started", "heartbeat", "running"]})]
    started = moment_column("started_at", _("started at"))

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        """The instances, each with the database clock's now, to judge heartbeat age by."""
        # The heartbeat is written with the database clock, so its age is judged by it too.
        return super().get_queryset(request).annotate(db_now=store.DbNow())

    @admin.display(description=_("last heartbeat"), ordering="last_heartbeat")
    def heartbeat(self, instance: Instance) -> str:
        """The last heartbeat, its age, and a stale marker past three lease TTLs."""
        now = getattr(instance, "db_now", None) or django_timezone.now()
        age = (now - instance.last_heartbeat).total_seconds()
        stale = ""
        if age > 3 * get_settings().lease_ttl:
            stale = format_html(' <strong class="anarchon-stale" style="color:#b3261e">{}</strong>', gettext("stale"))
        ago = gettext("%(age)s ago") % {"age": format_seconds(age)}
        return format_html("{} ({}){}", when(instance.last_heartbeat), ago, stale)

    @admin.display(description=_("running"))
    def running(self, instance: Instance) -> str:
        """Links to the runs this instance holds right now."""
        rows = Run.objects.filter(status=Status.RUNNING, instance_id=instance.instance_id, owner=instance.token)
        links = [(admin_url(Run, "change", run.pk), str(run)) for run in rows.order_by("slot")[:20]]
        if not links:
            return self.get_empty_value_display()
        return format_html("<ul>{}</ul>", format_html_join("", '<li><a href="{}">{}</a></li>', links))
