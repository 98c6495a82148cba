"""The README's scheme table is generated from the registry (one source: each config's header
comment), lists every credit label a run can carry, and is up to date."""

from __future__ import annotations

from pathlib import Path

from datc.credit.configs import credit_configs
from scripts.docs import reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_scheme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert reference.readme_with_schemes_table(readme) == readme, (
        "README.md's scheme table is stale: run `python -m scripts.docs.reference --readme`")


def test_the_table_names_every_label_once_with_the_baseline_first():
    rows = [ln for ln in reference.readme_schemes_table_md().splitlines()[2:]]
    labels = [r.split("`")[1] for r in rows]
    assert labels[0] == "grpo" and sorted(labels) == sorted(credit_configs()) and len(labels) == len(set(labels))
    assert "datc_end_neutral" in labels


def test_a_stale_table_is_rewritten():
    readme = f"x\n{reference.README_TABLE_START}\n| old |\n{reference.README_TABLE_END}\ny\n"
    new = reference.readme_with_schemes_table(readme)
    assert "| old |" not in new and "| `grpo` |" in new and new.startswith("x\n") and new.endswith("\ny\n")
