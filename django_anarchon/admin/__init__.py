"""The admin: read-only run history, the jobs with Run now / Pause / Resume, and the live instances.

Importing this package registers the three ModelAdmins on the default admin
site. Every value that comes from the database or from a handler is rendered
escaped; see docs/admin.md for the pages, actions and permissions.
"""

from __future__ import annotations

from .display import describe_schedule, format_seconds, status_badge
from .instances import InstanceAdmin
from .jobs import JobStateAdmin
from .runs import RunAdmin

__all__ = ["InstanceAdmin", "JobStateAdmin", "RunAdmin", "describe_schedule", "format_seconds", "status_badge"]
