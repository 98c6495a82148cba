"""oneDNN's process-wide primitive cache, bounded for vLLM's CPU engine where asked
(``rollout.vllm.onednn_cache_capacity``; measured in ``results/bench/README.md``)."""

from __future__ import annotations

import os

ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def onednn_cache(capacity: int | None) -> None:
    """Bound oneDNN's process-wide primitive cache (``rollout.vllm.onednn_cache_capacity``).

    vLLM's CPU linear layers run oneDNN matmuls whose primitives are made per input row count
    (each layer keeps its last 32 in its own cache); oneDNN also keeps every primitive it makes in a
    process-wide cache of 1024 entries by default, and as the row counts of a run's generation calls
    vary, that cache fills over hundreds of calls: the resident set creeps by megabytes a call
    (``results/bench/README.md``). A small capacity stops that creep once each layer's own cache is
    warm (the testbed's: +56 MB over 30 calls against +108), not a real run's growth (30 steps of
    SmolLM2-135M grew alike), hence null by default.
    oneDNN reads the variable at its first primitive, so it is set before the engine starts; one
    already in the environment is left as it is (the recorded setting says which held)."""
    if capacity is not None:
        os.environ.setdefault(ONEDNN_CACHE_ENV, str(capacity))
