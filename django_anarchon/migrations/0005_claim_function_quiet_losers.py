"""PostgreSQL only: ``django_anarchon_claim()`` whose losers wait without writing.

When several instances claim the same slot at once, one takes the job's row lock
and the others wait for it. In the function of migration 0004 they waited by
asking for that row lock themselves (``FOR UPDATE``): once the winner committed,
each loser locked the row it no longer needed, which gave it a transaction id, a
WAL record and a commit PostgreSQL must flush to disk, only to find the slot
taken. With eight instances that is seven flushed commits per slot for nothing;
measured with pgbench calling the function (``bench/pgbench_claim_function.sql``),
about as many transaction ids as calls.

This version makes each claimer take a transaction-level advisory lock on the
job (``pg_try_advisory_xact_lock(ADVISORY_CLASS, hashtext(job))``) before its row
lock. A claimer that finds either held waits on the advisory lock in shared mode,
which takes no transaction id and writes nothing, then looks again: slots decided
meanwhile are lost there and then, with nothing locked. Only a job with a claim
still undecided (another slot of it was being claimed, or the holder was not a
claim: a pause, a takeover) goes on to wait for the row lock, as before. The row
lock still decides everything; the advisory lock only says when to look again,
so a hash collision between two names costs a wait, never a wrong answer.

The advisory locks use the two-key form with the class ``ADVISORY_CLASS``
("anar" in ASCII); one-key advisory locks of the application never meet them.
Same signature and result as before; the Python side is unchanged. Other
databases get nothing from this migration.
"""

from __future__ import annotations

from django.db import migrations

from django_anarchon.store.schema import install_claim_function


class Migration(migrations.Migration):
    dependencies = [("django_anarchon", "0004_claim_function_cached_plans")]
    operations = [
        migrations.RunPython(install_claim_function(3), install_claim_function(2), elidable=False),
    ]
