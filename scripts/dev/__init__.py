"""Tools for changing the code, not for results: ``equality_runs`` (``python -m
scripts.dev.equality_runs``), the equality protocol of a structural change."""
