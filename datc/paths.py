"""Where the package finds its own files. A leaf module (imports nothing from ``datc``), so the
entry point, the prepare step and the analysis scripts can all read it without import cycles."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")  # Hydra's configs/ (train.yaml)
