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
    # the four testbed settings, the real model's superseded studies (reward models 09ab3fe7, 5e1e6828); a
    # study in progress (no tables yet) is not a case until its tables are committed
    assert {_id(c) for c in CASES if c[1] == "grpo"} >= {
        "keywords-tiny_gpt2-vs-grpo", "keywords-tiny_llama-vs-grpo", "arithmetic-tiny_gpt2-vs-grpo",
        "arithmetic-tiny_llama-vs-grpo", "legacy_rm09ab3fe7/reviews-smollm2_135m_instruct-vs-grpo",
        "legacy_rm5e1e6828/reviews-smollm2_135m_instruct-vs-grpo"}
    assert len(CASES) >= 13


@pytest.mark.parametrize("pin, folders, at_least", [
    ("../real_model/prepared.json", ["records", "in_progress"], 0),  # the study on the committed delta, as it lands
    ("legacy_rm5e1e6828/prepared.json", ["legacy_rm5e1e6828/records"], 90),
], ids=["current", "legacy_rm5e1e6828"])
def test_the_real_models_runs_trained_on_the_pinned_files(pin, folders, at_least):
    # a pin keeps, beside each prepared file's sha256, the hash a run records of it in inputs.json:
    # every committed run of a real-model study (finished or in progress) names its pin's files, so
    # its pairs span sessions (results/real_model/prepared.json: the committed delta's reward model;
    # legacy_rm5e1e6828/prepared.json: the earlier one, which no machine can build again)
    import json

    want = json.loads((TUNED / pin).read_text())["run_hashes"]
    runs = sorted(p for f in folders for p in TUNED.glob(f"{f}/reviews-smollm2_135m_instruct/*/*/inputs.json"))
    assert len(runs) >= at_least
    for p in runs:
        inputs = json.loads(p.read_text())["inputs"]
        for name, rec in want.items():
            label, file = name.split("/")
            assert inputs[label]["files"][file]["sha256"] == rec["sha256"], f"{p}: {name}"
