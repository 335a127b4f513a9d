"""A database task backend that pauses inside its enqueue, so a test can SIGKILL an instance there."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

_Database: Any = import_string(settings.TASKS_DATABASE_BACKEND)


class SlowDatabaseBackend(_Database):  # type: ignore[misc,valid-type]
    """Writes the task's row, says so on stdout, then sleeps ANARCHON_TEST_ENQUEUE_DELAY seconds."""

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        result = super().enqueue(task, args, kwargs)
        delay = float(os.environ.get("ANARCHON_TEST_ENQUEUE_DELAY", "0"))
        if delay:
            print(f"ENQUEUED-NOT-COMMITTED slot={kwargs.get('slot')} pid={os.getpid()}", file=sys.stdout, flush=True)
            time.sleep(delay)
        return result
