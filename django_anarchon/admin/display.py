"""What the admin pages share: status badges, durations, times to the second, schedules in words."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from typing import Any

from cron_descriptor import ExpressionDescriptor, Options
from django.contrib import admin
from django.contrib.admin.utils import flatten_fieldsets
from django.db.models import Model
from django.http import HttpRequest
from django.urls import reverse
from django.utils import dateformat
from django.utils import timezone as django_timezone
from django.utils.html import format_html
from django.utils.translation import get_language, to_locale

import django_anarchon

from ..models import Status
from ..registry import Job
from ..schedules import Schedule

STATUS_COLOURS: dict[str, str] = {
    Status.PENDING: "#5f6b7a",
    Status.RUNNING: "#0b5cad",
    Status.SUCCESS: "#1e7b34",
    Status.FAILED: "#b3261e",
    Status.INTERRUPTED: "#a15c00",
    Status.SKIPPED: "#6b7280",
    Status.MISSED: "#7b2d8e",
}
BADGE_STYLE = "display:inline-block;padding:1px 8px;border-radius:8px;color:#fff;font-weight:bold;background:"


def status_badge(status: str) -> str:
    """A coloured badge for a run status (escaped, whatever the stored value)."""
    label = Status(status).label if status in Status.values else status
    return format_html(
        '<span class="anarchon-status anarchon-status-{}" style="{}{}">{}</span>',
        status,
        BADGE_STYLE,
        STATUS_COLOURS.get(status, "#444"),
        label,
    )


def format_seconds(seconds: float) -> str:
    """A short human duration: ``0.25 s``, ``42 s``, ``3 min 5 s``, ``2 h``, ``3 d 4 h`` (two units at most)."""
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days >= 2:
        big, small = (days, "d"), (hours, "h")
    elif hours or days:
        big, small = (days * 24 + hours, "h"), (minutes, "min")
    else:
        big, small = (minutes, "min"), (secs, "s")
    return f"{big[0]} {big[1]} {small[0]} {small[1]}" if small[0] else f"{big[0]} {big[1]}"


def when(moment: datetime) -> str:
    """``moment`` in the current time zone, to the second (a job's slots can be seconds apart).

    On one line (admin.css), except in the run history's and the jobs list's narrow columns, where
    the date and the time may take two (each kept whole: a date is not broken at its hyphens).
    """
    local = django_timezone.localtime(moment) if django_timezone.is_aware(moment) else moment
    return format_html(
        '<span class="anarchon-time"><span>{}</span> <span>{}</span></span>',
        dateformat.format(local, "Y-m-d"),
        dateformat.format(local, "H:i:s"),
    )


def moment_column(field: str, description: Any) -> Callable[[Any, Model], str]:
    """An admin column (or read-only field) showing the datetime ``field`` to the second."""

    def column(model_admin: Any, obj: Model) -> str:
        moment = getattr(obj, field)
        return when(moment) if moment is not None else model_admin.get_empty_value_display()

    return admin.display(description=description, ordering=field)(column)  # type: ignore[no-any-return]


def pretty_json(value: Any) -> str:
    """A JSON value indented in a ``<pre>`` block (escaped)."""
    return format_html("<pre>{}</pre>", json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


def _cron_locale() -> str:
    locale = to_locale(get_language() or "en-us")
    # cron-descriptor ships e.g. fr_FR; unknown locales fall back to English.
    return locale if "_" in locale else f"{locale}_{locale.upper()}"


@lru_cache(maxsize=512)
def _cron_words(expression: str, declared: str, tz_name: str, locale: str) -> str:
    fields = expression.split()
    if len(fields) == 6:
        # croniter reads a sixth field as seconds at the end; cron-descriptor expects it first.
        fields = [fields[5], *fields[:5]]
    options = Options()
    options.locale_code = locale
    options.use_24hour_time_format = True
    try:
        words = ExpressionDescriptor(" ".join(fields), options).get_description()
    except Exception:  # cron-descriptor raises several unrelated types; the raw form is always right
        return f"cron {declared} ({tz_name})"
    return f"{words} ({tz_name}; cron {declared})"


def describe_schedule(schedule: Schedule) -> str:
    """A schedule in words: ``every 10s``, or a cron expression spelled out with its timezone."""
    if schedule.kind != "cron":
        return schedule.describe()
    expression, declared, tz = schedule.expression, schedule.declared, schedule.tz  # type: ignore[attr-defined]
    return _cron_words(expression, declared, tz.key, _cron_locale())


def declared_job(name: str) -> Job | None:
    """The job declared in code under ``name`` on the default scheduler, or None."""
    registry = django_anarchon.scheduler.registry
    return registry.get(name) if name in registry else None


def admin_url(model: type[Model], view: str, *args: Any) -> str:
    """The URL of an admin view of ``model`` on the default site, e.g. ``admin_url(Run, "change", 1)``."""
    opts = model._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_{view}", args=args)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Viewable with the view permission; nobody adds, changes or deletes through the admin."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Nobody adds rows here: the scheduler writes them."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Nobody edits rows here: state changes go through actions or the scheduler."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Nobody deletes rows here: history is pruned by the scheduler (HISTORY_RETENTION)."""
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        """Every field on the detail page is read-only, including the computed ones."""
        return flatten_fieldsets(self.get_fieldsets(request, obj))
