"""Atomic checkpoints: a checkpoint directory appears complete or not at all.

Each checkpoint is ``<run_dir>/checkpoints/step_XXXXXXX/state.pt`` holding the policy,
optimizer, scheduler, every RNG state and the step. It is written into a temporary sibling
and renamed into place, so a run killed mid-write leaves only a ``.tmp`` directory that is
never loaded.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch

from datc.utils import atomic_dir

_NAME = re.compile(r"^step_(\d{7})$")


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / "state.pt").exists()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    for stale in root.glob(".step_*.tmp"):  # leftovers of a run killed while writing
        shutil.rmtree(stale, ignore_errors=True)
    path = root / f"step_{step:07d}"
    with atomic_dir(path) as tmp:
        torch.save({**state, "step": step}, tmp / "state.pt")
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    # Our own file with RNG states (numpy arrays, tuples): not a weights-only pickle.
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
