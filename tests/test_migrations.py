"""The committed migrations match the models on every supported Django."""

from __future__ import annotations

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    try:
        call_command("makemigrations", "django_anarchon", "--check", "--dry-run", verbosity=1)
    except SystemExit as exit_:  # makemigrations --check exits 1 when a migration is missing
        pytest.fail(f"models and migrations differ (makemigrations --check exited {exit_.code})")
