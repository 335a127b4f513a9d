from django.db import models


class Execution(models.Model):
    """What a test handler did, written by the handler itself (not by the scheduler)."""

    job = models.CharField(max_length=200)
    slot = models.BigIntegerField()
    attempt = models.PositiveIntegerField()
    reason = models.CharField(max_length=20)
    manual = models.BooleanField(default=False)
    instance_id = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    event = models.CharField(max_length=20)  # start, end, aborted, failed, checkpoint
    at = models.FloatField()  # time.time() of the handler's process
    data = models.JSONField(null=True)
    progress = models.JSONField(null=True)
    note = models.TextField(blank=True)
