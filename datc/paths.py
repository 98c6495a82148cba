"""Where the package finds its own files. A leaf module (imports nothing from ``datc``), so the
entry point, the prepare step and the analysis scripts can all read it without import cycles."""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")  # Hydra's configs/ (train.yaml)

CHECKOUT_CACHE = ".cache/datc"  # the cache's default before it moved to the user's cache folder


def default_cache_dir() -> str:
    """Where prepared assets are cached when ``cache_dir`` is not given: ``$DATC_CACHE``; else a
    ``.cache/datc`` folder in the current directory where one exists (the earlier default, so a
    checkout's existing cache keeps working, under the same relative path); else the user's own
    cache, ``$XDG_CACHE_HOME/datc`` or ``~/.cache/datc`` (as Hugging Face keeps
    ``~/.cache/huggingface``), shared by every folder the user runs from."""
    if env := os.environ.get("DATC_CACHE"):
        return env
    if Path(CHECKOUT_CACHE).is_dir():
        return CHECKOUT_CACHE
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "datc")
