"""``datc-train --help``: the config groups, every field of the composed config (with the values
the given overrides give it) and where each field's meaning is written; no run directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_the_groups_the_fields_and_where_they_are_described(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "datc.train", "credit=datc", f"run_dir={tmp_path / 'run'}", "--help"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("datc-train: GRPO with token-level credit assignment")
    assert "credit: datc, datc_end_neutral, datc_identity" in out and "deepspeed: none, zero2, zero3" in out  # the groups
    assert "lm_head_chunk: null" in out and "logit_map: jacobian" in out  # fields, as composed with credit=datc
    assert "docs/configuration.md" in out
    assert not (tmp_path / "run").exists()
