"""A failure alert: e-mail the ADMINS whenever a run fails."""

from __future__ import annotations

from typing import Any

from django.core.mail import mail_admins
from django.dispatch import receiver

from django_anarchon.signals import run_failed


@receiver(run_failed)
def email_admins_on_failure(sender: Any, run: Any, exception: BaseException | None = None, **kwargs: Any) -> None:
    mail_admins(
        subject=f"Job {run.job} failed (attempt {run.attempt})",
        message=(
            f"Job: {run.job}\n"
            f"Scheduled at: {run.scheduled_at:%Y-%m-%d %H:%M:%S %Z}\n"
            f"Attempt: {run.attempt} ({run.reason}) on {run.instance_id}\n"
            f"Error: {run.error_type}: {run.error_message}\n\n{run.traceback}"
        ),
    )
