"""Landing a study's finished runs: the records the tables read, copied so that the tables made from
them are the committed ones; a run still running waits; another study's result is never replaced."""

from __future__ import annotations

import json
import shutil

import pytest

from scripts.results import land_study

SETTING = "keywords-tiny_gpt2"


def test_a_landed_study_gives_the_committed_tables_and_a_running_run_waits(tmp_path, capsys):
    study = tmp_path / "study" / SETTING
    shutil.copytree(land_study.TUNED / "records" / SETTING, study)
    running = study / "eval" / "keywords-tiny_gpt2-grpo-p0-s999-abcdef"
    running.mkdir()
    (running / "run.json").write_text("{}")  # no summary.json, no diverged.json: still running
    records = tmp_path / "records" / SETTING
    new, total = land_study.copy_records(study, records)
    assert new == total > 0 and not (records / running.relative_to(study)).exists()
    land_study.make_tables(records, tmp_path / "out")
    capsys.readouterr()
    for name in ("tuned.md", "tuned.json"):
        assert (tmp_path / "out" / name).read_bytes() == (land_study.TUNED / SETTING / name).read_bytes()
    assert land_study.copy_records(study, records) == (0, total)  # landing again adds nothing


def test_another_studys_result_under_the_same_name_is_not_replaced(tmp_path):
    study = tmp_path / "study" / SETTING
    shutil.copytree(land_study.TUNED / "records" / SETTING, study)
    records = tmp_path / "records" / SETTING
    land_study.copy_records(study, records)
    summary = sorted(records.glob("eval/*/summary.json"))[0]
    summary.write_text(summary.read_text().replace("{", '{"other": 1, ', 1))
    before = {p: p.read_bytes() for p in records.rglob("*") if p.is_file()}
    with pytest.raises(land_study.Conflict, match="another run's summary.json"):
        land_study.copy_records(study, records)
    assert before == {p: p.read_bytes() for p in records.rglob("*") if p.is_file()}
    with pytest.raises(land_study.Conflict, match="not a study folder"):
        land_study.copy_records(tmp_path, records)
    summary.write_bytes(before[summary])  # the same run again, but the study's copy diverged instead
    run = study / summary.parent.relative_to(records)
    (run / "summary.json").rename(run / "diverged.json")
    with pytest.raises(land_study.Conflict, match="another outcome"):
        land_study.copy_records(study, records)
    (run / "diverged.json").rename(run / "summary.json")
    (run / "config.yaml").write_text((run / "config.yaml").read_text() + "# edited\n")
    with pytest.raises(land_study.Conflict, match="another run's config.yaml"):
        land_study.copy_records(study, records)


def test_a_landed_tuning_json_of_another_study_is_not_replaced(tmp_path):
    study = tmp_path / "study" / SETTING
    shutil.copytree(land_study.TUNED / "records" / SETTING, study)
    records = tmp_path / "records" / SETTING
    land_study.copy_records(study, records)
    m = json.loads((study / "tuning.json").read_text())
    (study / "tuning.json").write_text(json.dumps({**m, "selection": {**m["selection"], "seeds": [7, 8]}}))
    with pytest.raises(land_study.Conflict, match="another study's \\(selection differ"):
        land_study.copy_records(study, records)


def test_the_answer_block_is_replaced_and_the_rest_of_the_readme_kept(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{land_study.ANSWER_START}old table\n{land_study.ANSWER_END}\n\nafter\n")
    land_study.paste_answer(readme, "| new |\n")
    assert readme.read_text() == f"# Title\n\n{land_study.ANSWER_START}| new |\n{land_study.ANSWER_END}\n\nafter\n"
    readme.write_text("# no block\n")
    with pytest.raises(land_study.Conflict, match="no answer block"):
        land_study.paste_answer(readme, "| new |\n")
    assert readme.read_text() == "# no block\n"


def test_a_restored_study_resumes_with_its_landed_runs_done_and_nothing_of_its_own_replaced(tmp_path, capsys):
    from datc.study.launch import state

    records = land_study.TUNED / "records" / SETTING
    study = tmp_path / "elsewhere" / SETTING  # a machine that never ran the study
    new, total = land_study.restore_records(records, study)
    assert new == total == sum(1 for d in land_study.RUN_DIRS for _ in (records / d).glob("*/")) > 0
    for run in (r for d in land_study.RUN_DIRS for r in (records / d).glob("*/")):
        assert state(study / run.relative_to(records)) == state(run) != "todo"  # the driver launches none of them
    assert (study / "tuning.json").read_bytes() == (records / "tuning.json").read_bytes()
    assert not list(study.rglob(".*.tmp"))  # every run's directory appeared whole
    land_study.copy_records(study, tmp_path / "again")  # landing it back: the same records
    land_study.make_tables(tmp_path / "again", tmp_path / "out")
    capsys.readouterr()
    assert (tmp_path / "out" / "tuned.md").read_bytes() == (land_study.TUNED / SETTING / "tuned.md").read_bytes()

    own = json.loads((study / "tuning.json").read_text())  # the folder's own protocol, grown since: kept
    (study / "tuning.json").write_text(json.dumps({**own, "note": "grown"}))
    assert land_study.restore_records(records, study) == (0, total)
    assert json.loads((study / "tuning.json").read_text())["note"] == "grown"

    running = sorted(study.glob("eval/*/"))[0]  # a landed name running here: stop, nothing written
    (running / "summary.json").unlink()
    with pytest.raises(land_study.Conflict, match="another outcome"):
        land_study.restore_records(records, study)
    assert not (running / "summary.json").exists()
    (study / "tuning.json").write_text(json.dumps({**own, "selection": {**own["selection"], "seeds": [7, 8]}}))
    with pytest.raises(land_study.Conflict, match="another study's"):
        land_study.restore_records(records, study)
    with pytest.raises(land_study.Conflict, match="nothing of this setting has landed"):
        land_study.restore_records(tmp_path / "none", study)


def test_the_restore_command_fills_a_folder_and_says_how_many_runs_it_restored(tmp_path, capsys):
    study = tmp_path / SETTING
    assert land_study.main(["--restore", str(study)]) == 0
    total = sum(1 for d in land_study.RUN_DIRS for _ in (land_study.TUNED / "records" / SETTING / d).glob("*/"))
    assert f"{total} of the {total} landed runs restored" in capsys.readouterr().out
    assert land_study.main(["--restore", str(study)]) == 0  # again: nothing new, nothing replaced
    assert f"0 of the {total} landed runs restored" in capsys.readouterr().out
    (study / "tuning.json").write_text("{}")  # another study's protocol there: refused, exit 2
    assert land_study.main(["--restore", str(study)]) == 2
    assert "another study's" in capsys.readouterr().err
