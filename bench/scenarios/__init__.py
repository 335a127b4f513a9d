"""One module per measured figure; each has ``run(ctx) -> dict`` (JSON-ready)."""
