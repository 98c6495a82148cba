"""A short stable hash of a JSON-serialisable object (cache keys, run identity, run names), in a
module of its own so the run name's resolver and the run directory need neither torch nor each
other."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def config_hash(obj: Any, n: int = 10) -> str:
    """The first ``n`` hex digits of the SHA-256 of ``obj`` as sorted JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]
