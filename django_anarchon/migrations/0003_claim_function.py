"""PostgreSQL only: ``django_anarchon_claim()``, a scheduled claim in one round trip.

The function decides the plain case of :func:`django_anarchon.store.decide`
(scheduled slots of jobs that nothing of theirs is running, or whose overlap
is ``allow``) in the same steps as the Python path: an unlocked first look,
the job rows locked ``FOR UPDATE`` ordered by name (with ``skip_locked``: the
free ones at once, then a wait of at most ``p_lock_wait_ms`` for the others,
which are answered ``busy`` past it), then, seeing everything committed before (each statement of a volatile
PL/pgSQL function takes a new snapshot), one ``running`` row per claim with
``ON CONFLICT DO NOTHING``. Whatever needs the overlap policy (a busy job) or a
missing job row is handed back ``undecided`` for the Python path. Other
databases get nothing from this migration.
"""

from __future__ import annotations

from django.db import migrations

from django_anarchon.store.schema import install_claim_function


class Migration(migrations.Migration):
    dependencies = [("django_anarchon", "0002_job_pruned_slot")]
    operations = [
        migrations.RunPython(install_claim_function(1), install_claim_function(None), elidable=False),
    ]
