"""Alerts: e-mail the ADMINS when a run fails, a job is overdue, or slots were missed."""

from __future__ import annotations

from typing import Any

from django.core.mail import mail_admins
from django.dispatch import receiver

from django_anarchon.signals import job_overdue, run_failed, run_missed


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


@receiver(job_overdue)
def email_admins_when_overdue(sender: Any, job: str, last_success: Any, without_success: Any, **kwargs: Any) -> None:
    """The dead-man alert: a job declared with alert_after has not succeeded for that long (sent once)."""
    since = f"since {last_success:%Y-%m-%d %H:%M:%S %Z}" if last_success else "ever"
    mail_admins(subject=f"Job {job} is overdue", message=f"No successful run of {job} {since} ({without_success}).")


@receiver(run_missed)
def email_admins_on_missed_slots(sender: Any, run: Any, **kwargs: Any) -> None:
    """Slots nobody ran while the whole cluster was down."""
    mail_admins(subject=f"Job {run.job} missed slots", message=run.detail)
