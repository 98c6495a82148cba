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


def test_the_resident_set_and_its_peak_come_from_one_read_while_another_thread_allocates():
    # datc.utils.resident_mb: the kernel fills VmHWM as at least VmRSS within one read of
    # /proc/self/status; two separate reads could report the resident set above the peak
    import threading

    from datc.utils import resident_mb

    stop = threading.Event()

    def churn() -> None:  # map, touch and unmap 16 MB over and over: the resident set moves
        while not stop.is_set():
            m = mmap.mmap(-1, 16 * 2**20)
            for i in range(0, len(m), mmap.PAGESIZE):
                m[i] = 1
            m.close()

    th = threading.Thread(target=churn, daemon=True)
    th.start()
    try:
        reads = [resident_mb() for _ in range(2000)]  # peak read before the resident set: ~4 in 1000 above it
    finally:
        stop.set()
        th.join()
    assert all(0 < now <= peak for now, peak in reads)
    assert len({now for now, _ in reads}) > 1  # the resident set did move during the reads
