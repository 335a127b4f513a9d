"""The SQL that lives in the database (PostgreSQL only): versioned files that migrations apply.

Each version of ``django_anarchon_claim()`` is a file in ``store/sql/``
(``claim_v1.sql`` ...); a migration that changes the function adds a new file
and applies it, and its reverse applies the previous one. The files name the
tables through placeholders, filled in from the models' ``_meta`` as the
migration sees them, so the function and :mod:`.statements` read the same
names.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

SQL_DIR = Path(__file__).resolve().parent / "sql"
CLAIM_FUNCTION = "django_anarchon_claim"
CLAIM_SIGNATURE = "text[], bigint[], boolean[], text[], text, text, double precision, integer, boolean, integer"
# The class of the two-key advisory locks the claim function takes ("anar" in ASCII): one-key
# advisory locks of the application never meet them.
ADVISORY_CLASS = 1634623858


def claim_function_sql(version: int, run_table: str, jobstate_table: str) -> str:
    """The ``CREATE OR REPLACE FUNCTION`` statement of claim function ``version``."""
    text = (SQL_DIR / f"claim_v{version}.sql").read_text()
    return (
        text.replace("__RUN_TABLE__", run_table)
        .replace("__JOBSTATE_TABLE__", jobstate_table)
        .replace("__ADVISORY_CLASS__", str(ADVISORY_CLASS))
    )


def _tables(apps: Any, schema_editor: Any) -> tuple[str, str]:
    quote = schema_editor.connection.ops.quote_name
    run = apps.get_model("django_anarchon", "Run")._meta.db_table
    state = apps.get_model("django_anarchon", "JobState")._meta.db_table
    return quote(run), quote(state)


def install_claim_function(version: int | None) -> Callable[[Any, Any], None]:
    """A ``RunPython`` callable that installs claim function ``version`` (None drops it)."""

    def apply(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        if version is None:
            schema_editor.execute(f"DROP FUNCTION IF EXISTS {CLAIM_FUNCTION}({CLAIM_SIGNATURE})")
        else:
            schema_editor.execute(claim_function_sql(version, *_tables(apps, schema_editor)))

    return apply
