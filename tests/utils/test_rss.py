"""The resident-memory readers of datc.utils (the step's perf/rss_gb and perf/peak_mem_gb on CPU)."""

from __future__ import annotations

import numpy as np

from datc.utils import peak_rss_mb, rss_mb


def test_the_resident_set_grows_with_touched_memory_and_never_exceeds_its_peak():
    before = rss_mb()
    block = np.ones(64 * 2**20 // 8)  # 64 MB, every page touched
    after = rss_mb()
    assert 0 < before <= peak_rss_mb() and after <= peak_rss_mb()
    assert after - before > 48  # MB: most of the block's pages are resident
    del block
