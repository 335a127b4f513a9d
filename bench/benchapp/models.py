from django.db import models


class ClaimRef(models.Model):
    """The reference claim: one row, one primary key (what pgbench inserts too)."""

    k = models.BigIntegerField(primary_key=True)

    def __str__(self) -> str:
        return str(self.k)
