"""``trainer.keep_freed_memory`` (:func:`datc.utils.keep_freed_memory`): a large tensor's memory,
once freed, stays in the process's heap for the next one instead of going back to the OS. Each
case runs in a fresh interpreter (the setting is process-wide and cannot be undone there)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

CHILD = """
import ctypes, json, sys, torch
from datc.utils import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
x = torch.empty(64 * 2**20 // 4)  # 64 MB, above glibc's largest mmap threshold (32 MB)
x.fill_(1.0)
during = libc.mallinfo2().hblkhd
del x
after = libc.mallinfo2()
print(json.dumps({"applied": applied, "mmapped_during": during, "heap_free_after": after.fordblks}))
"""


def _child(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="a glibc malloc setting")
def test_a_freed_large_tensor_stays_in_the_heap_for_the_next():
    plain, keep = _child("plain"), _child("keep")
    mb = 2**20
    assert not plain["applied"] and plain["mmapped_during"] >= 64 * mb and plain["heap_free_after"] < 64 * mb
    assert keep["applied"] and keep["mmapped_during"] < 64 * mb and keep["heap_free_after"] >= 64 * mb


TRIM_CHILD = """
import ctypes, json, torch
from datc.utils import keep_freed_memory, trim_heap
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
keep_freed_memory()
x = torch.empty(256 * 2**20 // 4)  # 256 MB in the heap (no mmap under keep_freed_memory)
x.fill_(1.0)
y = torch.ones(1)  # a block above it: the freed 256 MB is a hole, not the heap's top
del x
kept = rss()
ran = trim_heap()
print(json.dumps({"ran": ran, "kept_mb": kept, "trimmed_mb": rss()}))
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="a glibc malloc setting")
def test_trim_heap_gives_a_kept_hole_back_to_the_os():
    # datc.utils.trim_heap (rollout.vllm.trim_heap): the free pages of the kept heap go back to the OS
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ran"] and r["kept_mb"] - r["trimmed_mb"] >= 200, r
