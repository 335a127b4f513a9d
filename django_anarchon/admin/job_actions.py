"""What can be done to one job from the admin: request a run (with data), pause, resume.

Shared by the jobs list's actions and the buttons of a job's own page. Nothing
here runs a job: a run request records a pending manual run that a scheduler
instance picks up. Each thing done is logged in the admin's history (``LogEntry``).
"""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

import django_anarchon

from ..conf import check_json
from ..exceptions import AnarchonError, UnknownJobError
from ..models import JobState, Run


class PauseForm(forms.Form):
    """The note asked for before pausing."""

    reason = forms.CharField(
        label=_("Why"),
        required=False,
        max_length=1000,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text=_("Stored with your user name as the pause note and shown in the jobs list."),
    )


class RunDataForm(forms.Form):
    """The data of a requested run: JSON, checked as ``run_now()`` checks it."""

    run_data = forms.CharField(
        label=_("Data (JSON)"),
        required=False,
        widget=forms.Textarea(attrs={"rows": 6, "cols": 60, "spellcheck": "false"}),
        help_text=_(
            "Becomes ctx.data of the run. Leave empty for the job's own data. "
            'Example: {"customer": 42, "dry_run": true}'
        ),
    )

    def clean_run_data(self) -> Any:
        text = self.cleaned_data["run_data"].strip()
        if not text:
            return None
        try:
            value = json.loads(text)
        except ValueError as error:
            raise forms.ValidationError(gettext("This is not JSON: %(error)s") % {"error": error}) from None
        try:
            return check_json(value, gettext("The data"))
        except AnarchonError as error:
            raise forms.ValidationError(str(error)) from None


def request_run(admin: Any, request: HttpRequest, state: JobState, data: Any = None) -> Run | None:
    """Record a pending manual run of ``state``'s job, log it in the admin's history; None if not declared."""
    try:
        run = django_anarchon.run_now(state.name, data)
    except UnknownJobError:
        return None
    shown = "" if data is None else " " + gettext("with data %(data)s") % {"data": json.dumps(data)}
    admin.log_change(request, state, gettext("Requested a run now%(data)s.") % {"data": shown})
    return run


def no_instance_message(count: int) -> str:
    """What a run requested while no scheduler instance runs does (``%(names)s``, ``%(count)d`` to fill in)."""
    return ngettext(
        "Requested a run of %(names)s, but no scheduler instance has sent a heartbeat lately: "
        "it waits until 'manage.py anarchon' runs somewhere.",
        "Requested runs of %(count)d jobs (%(names)s), but no scheduler instance has sent a heartbeat lately: "
        "they wait until 'manage.py anarchon' runs somewhere.",
        count,
    )


def pause_note(request: HttpRequest, reason: str) -> str:
    user = request.user.get_username()
    if reason:
        return gettext("Paused by %(user)s: %(reason)s") % {"user": user, "reason": reason}
    return gettext("Paused by %(user)s") % {"user": user}


def pause(admin: Any, request: HttpRequest, state: JobState, reason: str) -> bool:
    """Pause ``state``'s job with the user's note; log it. False if it was already paused."""
    note = pause_note(request, reason)
    if not state.pause(note):
        return False
    admin.log_change(request, state, note)
    return True


def resume(admin: Any, request: HttpRequest, state: JobState) -> bool:
    """Resume ``state``'s job; log it. False if it was not paused."""
    if not state.resume():
        return False
    admin.log_change(request, state, gettext("Resumed by %(user)s") % {"user": request.user.get_username()})
    return True


def form_page(
    admin: Any, request: HttpRequest, template: str, title: str, states: list[JobState], form: forms.Form, **extra: Any
) -> HttpResponse:
    """The confirmation page of an action or a button: the jobs concerned and the form."""
    opts = admin.opts
    context = {
        **admin.admin_site.each_context(request),
        "title": title,
        "opts": opts,
        "queryset": states,
        "form": form,
        "action_checkbox_name": ACTION_CHECKBOX_NAME,
        "media": admin.media + form.media,
        **extra,
    }
    request.current_app = admin.admin_site.name
    return TemplateResponse(
        request, [f"admin/{opts.app_label}/{opts.model_name}/{template}", f"admin/{opts.app_label}/{template}"], context
    )


class JobPageButtons:
    """The buttons of a job's own page (``ModelAdmin`` mixin): Run now, Run now with data, Pause, Resume."""

    def get_urls(self) -> list[Any]:
        wrap = self.admin_site.admin_view  # type: ignore[attr-defined]
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"  # type: ignore[attr-defined]
        return [
            path("<path:object_id>/run-now/", wrap(self.run_now_view), name=f"{prefix}_run_now"),
            path("<path:object_id>/pause/", wrap(self.pause_view), name=f"{prefix}_pause"),
            path("<path:object_id>/resume/", wrap(self.resume_view), name=f"{prefix}_resume"),
            *super().get_urls(),  # type: ignore[misc]
        ]

    def _state(self, request: HttpRequest, object_id: str, permission: str) -> JobState:
        if not getattr(self, f"has_{permission}_permission")(request):
            raise PermissionDenied
        return get_object_or_404(JobState, pk=object_id)

    def _back(self, state: JobState) -> HttpResponseRedirect:
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"  # type: ignore[attr-defined]
        return HttpResponseRedirect(reverse(f"admin:{prefix}_change", args=[state.pk]))

    def run_now_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: request a run now (with the data of the form, when it was shown)."""
        state = self._state(request, object_id, "run")
        admin: Any = self
        if request.method != "POST":
            return self._back(state)
        form = RunDataForm(request.POST if "run_data" in request.POST else None)
        if "with_data" in request.POST and not form.is_bound:
            return form_page(admin, request, "run_now_confirmation.html", gettext("Run now"), [state], form)
        if form.is_bound and not form.is_valid():
            return form_page(admin, request, "run_now_confirmation.html", gettext("Run now"), [state], form)
        data = form.cleaned_data["run_data"] if form.is_bound else None
        try:
            requested = request_run(admin, request, state, data)
        except AnarchonError as error:  # data the job cannot take (a task job's task without a data argument)
            if not form.is_bound:
                raise
            form.add_error("run_data", str(error))
            return form_page(admin, request, "run_now_confirmation.html", gettext("Run now"), [state], form)
        if requested is None:
            admin.message_user(
                request, gettext("Job %(name)s is not declared in code.") % {"name": state.name}, messages.ERROR
            )
        elif admin._instances_alive():
            admin.message_user(
                request,
                gettext("Requested a run of %(name)s: a scheduler instance starts it within one poll interval.")
                % {"name": state.name},
                messages.SUCCESS,
            )
        else:
            admin.message_user(request, no_instance_message(1) % {"names": state.name, "count": 1}, messages.WARNING)
        return self._back(state)

    def pause_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Ask for the note, then pause the job."""
        state = self._state(request, object_id, "pause")
        admin: Any = self
        form = PauseForm(request.POST if "post" in request.POST else None)
        if not form.is_bound or not form.is_valid():
            return form_page(admin, request, "pause_confirmation.html", gettext("Pause jobs"), [state], form)
        if pause(admin, request, state, form.cleaned_data["reason"].strip()):
            admin.message_user(request, gettext("Paused %(names)s.") % {"names": state.name}, messages.SUCCESS)
        else:
            admin.message_user(
                request, gettext("Job %(name)s was already paused.") % {"name": state.name}, messages.WARNING
            )
        return self._back(state)

    def resume_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: resume the job."""
        state = self._state(request, object_id, "resume")
        admin: Any = self
        if request.method == "POST":
            if resume(admin, request, state):
                admin.message_user(request, gettext("Resumed %(names)s.") % {"names": state.name}, messages.SUCCESS)
            else:
                admin.message_user(
                    request, gettext("Job %(name)s was not paused.") % {"name": state.name}, messages.WARNING
                )
        return self._back(state)
