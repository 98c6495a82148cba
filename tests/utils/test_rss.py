"""The resident-memory readers of datc.utils (the step's perf/rss_gb and perf/peak_mem_gb on CPU)."""

from __future__ import annotations

import mmap

from datc.utils import peak_rss_mb, rss_mb


def test_the_resident_set_grows_with_touched_memory_and_never_exceeds_its_peak():
    # fresh pages from the kernel, not malloc's heap: an earlier test of this process may have
    # kept freed memory resident (trainer.keep_freed_memory), which a new array would reuse
    size, page = 64 * 2**20, mmap.PAGESIZE
    block = mmap.mmap(-1, size)
    before = rss_mb()
    for i in range(0, size, page):
        block[i] = 1  # every page touched
    after = rss_mb()
    assert 0 < before <= peak_rss_mb() and after <= peak_rss_mb()
    assert after - before > 48  # MB: most of the block's pages are resident
    block.close()
