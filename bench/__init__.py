"""The django-anarchon benchmark: ``python bench/run.py`` (see docs/performance.md)."""
