"""A study's jobs share the setting's step-0 evaluation (``trainer.eval_cache``) unless the study's
own overrides set it."""

from __future__ import annotations

from pathlib import Path

from datc.study.jobs import EVAL_CACHE, base


def _manifest(*overrides: str) -> dict:
    return {"experiment": "real_smollm2", "setting": {"policy": "smollm2_135m_instruct", "data": "reviews"},
            "overrides": list(overrides)}


def test_every_job_of_a_setting_names_its_eval_cache_and_an_own_override_takes_its_place(tmp_path):
    folder = tmp_path / "reviews-smollm2"
    args = base(_manifest("trainer.threads=1"), folder, "select")
    assert f"trainer.eval_cache={folder / EVAL_CACHE}" in args and args[-1] == "trainer.threads=1"
    for own in ("trainer.eval_cache=null", "+trainer.eval_cache=/elsewhere"):
        args = base(_manifest(own), folder, "eval")
        assert [a for a in args if "eval_cache" in a] == [own]


def test_a_study_under_way_may_turn_its_eval_cache_off_without_becoming_another_protocol(tmp_path):
    import json

    import pytest

    from datc.study.protocol import Refused, merge_manifest, new_manifest

    def manifest(*task: str) -> dict:
        return new_manifest("reviews", "smollm2_135m_instruct", "real_smollm2", list(task), 0, [100, 101], [0],
                            [200, 201], {"grpo": {"lr": 5e-5}})

    (tmp_path / "tuning.json").write_text(json.dumps(manifest("trainer.threads=1")))
    merged, _ = merge_manifest(tmp_path, manifest("trainer.threads=1", "trainer.eval_cache=null"))
    assert merged["overrides"] == ["trainer.threads=1", "trainer.eval_cache=null"]  # the jobs get the new value
    with pytest.raises(Refused, match="another protocol"):  # what a run computes still may not change
        merge_manifest(tmp_path, manifest("trainer.threads=2"))


def test_defaults_later_leaves_the_default_configurations_for_another_invocation_and_says_so():
    import json

    from datc.study.jobs import eval_jobs
    from datc.study.reading import read_setting

    folder = Path(__file__).resolve().parents[2] / "results" / "tuned" / "records" / "keywords-tiny_gpt2"
    m = json.loads((folder / "tuning.json").read_text())
    st = read_setting(folder, m)
    every, _ = eval_jobs(m, folder, st)
    chosen, notes = eval_jobs(m, folder, st, defaults=False)
    assert any(" default " in j.label for j in every)
    assert chosen == [j for j in every if " chosen " in j.label] and chosen
    assert any("--defaults-later" in n for n in notes)
