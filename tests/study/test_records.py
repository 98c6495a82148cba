"""The committed records of ``results/tuned/`` stay readable by the study's reading: ``datc-compare
--tuned`` regenerates every committed ``tuned.md`` and ``tuned.json`` byte for byte (the tables of
the fixed ×0.5/×1/×2 grid and the ±20% matched-KL rule the records were made under)."""

from __future__ import annotations

from pathlib import Path

import pytest

from datc.compare import main as compare

TUNED = Path(__file__).resolve().parents[2] / "results" / "tuned"
SETTINGS = sorted(p.name for p in (TUNED / "records").iterdir() if (p / "tuning.json").is_file())
CASES = [(s, "grpo", TUNED / s) for s in SETTINGS] + [
    (s, b, TUNED / f"vs_{b}" / s) for b in ("oracle", "datc") for s in SETTINGS if (TUNED / f"vs_{b}" / s).is_dir()]


@pytest.mark.parametrize("setting, baseline, committed", [
    pytest.param(*c, marks=() if c[0] == "keywords-tiny_gpt2" and c[1] == "grpo" else pytest.mark.slow) for c in CASES],
    ids=[f"{c[0]}-vs-{c[1]}" for c in CASES])
def test_the_committed_tables_regenerate_byte_for_byte(setting, baseline, committed, tmp_path, capsys):
    compare(["--tuned", str(TUNED / "records" / setting), "--baseline", baseline, "--out", str(tmp_path / "out")])
    capsys.readouterr()
    for name in ("tuned.md", "tuned.json"):
        assert (tmp_path / "out" / name).read_bytes() == (committed / name).read_bytes(), f"{setting} {baseline} {name}"


def test_every_setting_is_checked():
    assert len(SETTINGS) == 5 and len(CASES) == 13
