from django.db import models


class ClaimRef(models.Model):
    """The reference claim: one row, one primary key (what pgbench inserts too)."""

    k = models.BigIntegerField(primary_key=True)

    def __str__(self) -> str:
        return str(self.k)


class Tick(models.Model):
    """The row an ``orm`` benchmark handler writes: what a real handler does (a query, a row written)."""

    job = models.CharField(max_length=200)
    slot = models.BigIntegerField()
    at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.job}@{self.slot}"
