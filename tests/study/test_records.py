"""The committed records of ``results/tuned/`` stay readable by the study's reading: ``datc-compare
--tuned`` regenerates every committed ``tuned.md`` and ``tuned.json`` byte for byte (the tables of
the fixed ×0.5/×1/×2 grid and the ±20% matched-KL rule the records were made under)."""

from __future__ import annotations

from pathlib import Path

import pytest

from datc.compare import main as compare

TUNED = Path(__file__).resolve().parents[2] / "results" / "tuned"
# (records, committed tables): each study's folder and its tables; a superseded study's (its reward
# model not re-creatable) kept with its tables in a folder named for that reward model
STUDIES = sorted([(p, TUNED / p.name) for p in (TUNED / "records").iterdir() if (p / "tuning.json").is_file()] + [
    (p, old / p.name) for old in TUNED.glob("legacy_*") for p in (old / "records").iterdir() if (p / "tuning.json").is_file()])
CASES = [(r, "grpo", t) for r, t in STUDIES if (t / "tuned.md").is_file()] + [
    (r, b, TUNED / f"vs_{b}" / r.name) for b in ("oracle", "datc") for r, _ in STUDIES if (TUNED / f"vs_{b}" / r.name).is_dir()]


def _id(c) -> str:
    return f"{c[0].relative_to(TUNED).as_posix().replace('records/', '')}-vs-{c[1]}"


@pytest.mark.parametrize("records, baseline, committed", [
    pytest.param(*c, marks=() if c[0].name == "keywords-tiny_gpt2" and c[1] == "grpo" else pytest.mark.slow) for c in CASES],
    ids=[_id(c) for c in CASES])
def test_the_committed_tables_regenerate_byte_for_byte(records, baseline, committed, tmp_path, capsys):
    compare(["--tuned", str(records), "--baseline", baseline, "--out", str(tmp_path / "out")])
    capsys.readouterr()
    for name in ("tuned.md", "tuned.json"):
        assert (tmp_path / "out" / name).read_bytes() == (committed / name).read_bytes(), f"{records} {baseline} {name}"


def test_every_setting_is_checked():
    # the four testbed settings, the real model's superseded study (reward model 09ab3fe7); a
    # study in progress (no tables yet) is not a case until its tables are committed
    assert {_id(c) for c in CASES if c[1] == "grpo"} >= {
        "keywords-tiny_gpt2-vs-grpo", "keywords-tiny_llama-vs-grpo", "arithmetic-tiny_gpt2-vs-grpo",
        "arithmetic-tiny_llama-vs-grpo", "legacy_rm09ab3fe7/reviews-smollm2_135m_instruct-vs-grpo"}
    assert len(CASES) >= 13


def test_the_real_models_runs_trained_on_the_pinned_files():
    # results/real_model/prepared.json pins the real preset's prepared files and keeps, beside each
    # sha256, the hash a run records of it in inputs.json: every committed run of the study on the
    # pinned reward model (finished or in progress) names those files, so its pairs span sessions
    import json

    pin = json.loads((TUNED.parent / "real_model" / "prepared.json").read_text())["run_hashes"]
    runs = sorted(TUNED.glob("*/reviews-smollm2_135m_instruct/*/*/inputs.json"))
    runs = [p for p in runs if "legacy_" not in p.as_posix()]
    assert len(runs) >= 50
    for p in runs:
        inputs = json.loads(p.read_text())["inputs"]
        for name, want in pin.items():
            label, file = name.split("/")
            assert inputs[label]["files"][file]["sha256"] == want["sha256"], f"{p}: {name}"
