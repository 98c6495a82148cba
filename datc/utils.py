"""Small shared helpers: seeding, RNG state, process settings (atomic writes: :mod:`datc.atomic`;
config hashing: :mod:`datc.hashing`)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import os
import platform
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace (read when its first handle is made)


@contextlib.contextmanager
def deterministic_mode(on: bool):
    """``trainer.deterministic``: within the block, torch's deterministic algorithms (an op with
    no deterministic kernel warns, naming itself, rather than stopping the run), cuDNN
    deterministic with its benchmark off, and ``CUBLAS_WORKSPACE_CONFIG`` set if unset (before
    CUDA's first cuBLAS handle: a warning if CUDA is already initialised). The process's former
    settings come back after the block (the environment variable stays). ``on=False``: nothing
    is touched, so a default run is bit for bit what it was before the option."""
    if not on:
        yield
        return
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_initialized():
            logging.getLogger(__name__).warning(
                "trainer.deterministic: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set; export "
                "CUBLAS_WORKSPACE_CONFIG=%s before the run for cuBLAS to take it", CUBLAS_WORKSPACE)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def quiet_libraries() -> None:
    """Silence per-call progress bars and advisory warnings of transformers and datasets (the
    run's own progress bar and logs say what is happening)."""
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def _status_mb(*keys: str) -> tuple[float, ...]:
    """``kB`` fields of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in MB, from one read; NaN
    where /proc is missing. One read matters: the kernel fills VmHWM as at least VmRSS in the same
    read, while two reads can see VmRSS above VmHWM (memory a thread touched between them)."""
    found: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in keys:
                found[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return tuple(found.get(k, math.nan) for k in keys)


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), in MB; NaN where /proc is missing. Unlike
    ``ru_maxrss``, VmHWM belongs to the process image, so a child does not inherit its parent's
    peak across ``exec``."""
    return _status_mb("VmHWM")[0]


def rss_mb() -> float:
    """This process's resident memory now (VmRSS), in MB; NaN where /proc is missing."""
    return _status_mb("VmRSS")[0]


def resident_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB from one read of ``/proc/self/status``, so the peak is never below
    the resident set it is reported beside; NaNs where /proc is missing."""
    return _status_mb("VmRSS", "VmHWM")  # type: ignore[return-value]  # two keys, two values


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Keep the memory that freed tensors give back in this process's heap, for the next
    tensors, instead of returning it to the OS (``trainer.keep_freed_memory``). PyTorch's CPU
    tensors come from glibc's malloc, which serves every block above 32 MB (a real vocabulary's
    ``(8, 48, 49152)`` logits are 75 MB) with a fresh ``mmap`` and unmaps it on free, so every
    such tensor is first-touched page by page (the kernel zeroes each page): filling 75 MB took
    45 ms fresh and 6 ms reused here. With mmap off and no heap trimming, freed blocks are
    reused, as a GPU's caching allocator does; the process's resident memory then stays at its
    peak. Returns whether it applied (Linux with glibc; elsewhere nothing changes)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS now (glibc's ``malloc_trim(0)``, which also
    releases free pages between blocks in use, whatever the trim threshold). The vLLM engine on a
    CPU calls it after each generation (``rollout.vllm.trim_heap``): its allocations leave holes the
    heap keeps, and a run's resident set climbs by them step after step. Returns whether it ran
    (Linux with glibc; elsewhere nothing happens)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    return True
