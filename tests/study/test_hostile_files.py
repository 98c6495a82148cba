"""Garbage where a study keeps its files is one line, exit 2 (issue 57): a ``tuning.json`` or a
``matched.json`` that is not the file datc writes, an evaluation run's ``inputs.json`` that is a
list, and ``datc-compare --tuned --out`` an existing file."""

from __future__ import annotations

import pytest

from datc.compare import main as compare
from datc.study.cli import main as study
from datc.study.errors import TuningError
from datc.study.matched import read_search
from datc.study.reading import read_setting
from tests.helpers.tuning import sweep

ARGS = ["--policy", "tiny_gpt2", "--data", "keywords", "--eval-draws", "0", "--eval-seeds", "200,201", "--schemes", "grpo",
        "--stage", "lr", "--plan"]


def _exit(fn, argv, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as e:
        fn(argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("garbage", ["[1, 2]", "{not json", '{"schemes": 3}', '{"schemes": {}, "overrides": [1]}', "\xff"])
def test_a_garbage_tuning_json_is_one_line_exit_2(garbage, tmp_path, capsys):
    folder = tmp_path / "keywords-tiny_gpt2"
    folder.mkdir()
    (folder / "tuning.json").write_text(garbage, encoding="latin-1")
    code, err = _exit(study, [*ARGS, "--root", str(tmp_path)], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("datc-study: ") and "tuning.json" in err[0], err
    assert "move it aside" in err[0] and (folder / "tuning.json").read_text(encoding="latin-1") == garbage


@pytest.mark.parametrize("garbage", ["[1, 2]", "{not json", "7"])
def test_a_garbage_matched_json_is_one_line(garbage, tmp_path, capsys):
    folder = sweep(tmp_path / "runs")
    (folder / "matched.json").write_text(garbage)
    with pytest.raises(TuningError, match="matched.json: .*move it aside"):
        read_search(folder)
    code, err = _exit(compare, ["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1 and "matched.json" in err[0], err
    assert not (tmp_path / "out").exists()


def test_an_inputs_json_that_is_a_list_is_not_checked(tmp_path, capsys):
    folder = sweep(tmp_path / "runs")
    for d in (folder / "eval").iterdir():
        (d / "inputs.json").write_text("[1, 2, 3]")  # not the file a run writes: as without one
    assert read_setting(folder).schemes["grpo"].tuned
    compare(["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert (tmp_path / "out" / "tuned.md").is_file()


def test_tuned_out_an_existing_file_is_one_line_exit_2(tmp_path, capsys):
    sweep(tmp_path / "runs")
    out = tmp_path / "out"
    out.write_text("mine")
    code, err = _exit(compare, ["--tuned", str(tmp_path / "runs"), "--out", str(out)], capsys)
    assert code == 2 and err[-1].startswith(f"datc-compare: --out {out}: cannot write there (not a directory)"), err
    assert out.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["out", "runs"]
