"""datc-compare --tuned (datc/report/tuning.py): the coordinate search's choice on hand-made run
summaries, the evaluation table on evaluation seeds only, and the refusal of an evaluation that
shares a seed with its selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datc.compare import main
from datc.study.reading import TuningError, knob_for, read_setting
from tests.helpers.tuning import LR, sweep, write_run


def test_the_coordinate_search_chooses_rate_then_knob_on_the_selection_seeds(tmp_path):
    st = read_setting(sweep(tmp_path))
    grpo, datc = st.schemes["grpo"], st.schemes["datc"]
    assert (grpo.lr, grpo.knob) == (LR, None)  # a tie keeps the default rate
    assert (datc.lr, datc.knob) == (2 * LR, 0.5)  # not the better off-path point (LR, tau 0.5)
    assert datc.chosen.score.mean == pytest.approx(0.60) and datc.chosen.seeds == (100, 101)
    assert datc.default_candidate.score.mean == pytest.approx(0.40)
    # the evaluation runs: the chosen configuration's and the default's, on evaluation seeds only
    assert sorted(r.seed for r in datc.tuned) == [200, 201, 202, 203]
    assert sorted(r.seed for r in datc.default) == [200, 201, 202, 203]
    assert all(r.final_gold < 0.6 for r in datc.tuned)


def test_the_table_reports_choice_selection_score_and_evaluation_apart(tmp_path, capsys):
    sweep(tmp_path / "runs")
    out = tmp_path / "out"
    main(["--tuned", str(tmp_path / "runs"), "--out", str(out)])
    md = (out / "tuned.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| datc | lr"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "lr 0.001 (×2), credit.tau 0.5"
    assert cells[2] == "0.600 (seeds 100, 101)" and cells[3] == "0.400 (seeds 100, 101)"
    # evaluation: datc tuned - grpo tuned is +0.300 on every seed; default - default +0.100
    assert cells[4].startswith("0.512 ± ")  # the evaluation seeds alone and cells[5] == "**+0.300 ± 0.000**"
    assert cells[7] == "**+0.100 ± 0.000**"
    assert cells[8] == "4 (1 collapsed: seed 203) / 4"  # the collapsed run is named, not folded in silently
    assert "Selection: draw 0, seeds 100, 101. Evaluation" in md
    assert "| datc | lr 0.0005 (×1), credit.tau 0.5 | off the search path (not eligible) | 0.990" in md
    assert "- datc − grpo: 4 pairs, ±0.000; detectable: 0.000" in md  # the same difference on every seed
    report = json.loads((out / "evaluation" / "report.json").read_text())
    assert {tuple(r["seeds"]) for r in report["rows"]} == {(200, 201, 202, 203)}  # no selection seed
    assert "1 collapsed" in (out / "evaluation" / "table.md").read_text()
    assert json.loads((out / "tuned.json").read_text())["settings"][0]["schemes"]["datc"]["chosen"] == {"lr": 2 * LR, "knob": 0.5}


def test_an_evaluation_that_shares_a_seed_with_its_selection_is_refused(tmp_path, capsys):
    folder = sweep(tmp_path / "runs")
    write_run(folder / "eval", "grpo", 101, LR, 0.3)
    with pytest.raises(SystemExit) as e:
        main(["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "shares seed(s) 101 with its selection" in err
    assert not (tmp_path / "out").exists()


def test_an_incomplete_grid_chooses_nothing(tmp_path):
    folder = sweep(tmp_path)
    for d in (folder / "select").glob("*datc-p0-s101-lr0.001-tau2.0"):
        (d / "summary.json").unlink()  # one seed of tau 2 unfinished
    st = read_setting(folder)
    assert st.schemes["datc"].lr == 2 * LR and st.schemes["datc"].knob is None and st.schemes["datc"].tuned == []
    assert any("no summary.json" in w for w in st.warnings)


def test_the_knob_follows_the_scheme_declarations():
    assert knob_for({"name": "datc", "normalizer": "softmax", "tau": 1.0}, "scores") == "tau"
    assert knob_for({"name": "gcpo", "normalizer": "rank_power", "alpha": 2.15}, "scores") == "alpha"
    assert knob_for({"name": "grail", "std": 0.5}, "weights") == "std"
    assert knob_for({"name": "grpo"}, "weights") is None


def _trained_on(run_dir: Path, reward_sha: str) -> None:
    """An inputs.json as a run writes it, its reward model's weights hashed to ``reward_sha``."""
    files = {"policy": {"model.safetensors": "p" * 64}, "reward": {"model.safetensors": reward_sha * 64},
             "data": {"train.jsonl": "d" * 64}}
    (run_dir / "inputs.json").write_text(json.dumps({"inputs": {
        kind: {"files": {n: {"hashed": "whole", "sha256": h, "size": 1} for n, h in fs.items()}, "path": "/cache"}
        for kind, fs in files.items()}}))


def test_runs_trained_on_other_assets_are_compared_only_where_they_may_be(tmp_path, capsys):
    # A real model's reward model prepared again on another machine is another reward model (the
    # sampled pool differs): a scheme's candidates must share one, and so must the runs paired at
    # a seed; different seeds may differ (as asset draws do), said in a warning.
    folder = sweep(tmp_path / "runs")
    for d in (folder / "select").iterdir():
        _trained_on(d, "a")
    for d in (folder / "eval").iterdir():
        _trained_on(d, "a" if "-s200-" in d.name or "-s201-" in d.name else "b")  # draw 0 on a, draw 1 on b
    st = read_setting(folder)
    assert st.schemes["datc"].lr == 2 * LR and not any("sets of assets" in w for w in st.warnings)  # a set per draw
    for d in (folder / "eval").glob("*-s203-*"):
        _trained_on(d, "c")  # seed 203's pair on a third reward model, still one pair on one
    assert any("span 3 sets of assets over 2 draw(s)" in w for w in read_setting(folder).warnings)

    [run] = (folder / "eval").glob("*-grpo-*-s202-*")
    _trained_on(run, "c")  # grpo at seed 202 trained on another reward model than datc at 202
    with pytest.raises(SystemExit) as e:
        main(["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "evaluation seed 202" in err, err
    assert "were trained on different assets (reward/model.safetensors differ" in err and "one prepare cache" in err
    _trained_on(run, "b")

    [run] = (folder / "eval").glob("*-datc-*-s200-lr0.0005-tau1.0")
    _trained_on(run, "c")  # datc's default run at 200 on another reward model than grpo's (a default pair)
    with pytest.raises(TuningError, match=r"evaluation seed 200 \(default configurations\): .* different assets"):
        read_setting(folder)
    _trained_on(run, "a")

    # the matched-KL control's search for grpo's rate (off grpo's grid) in another session: it chooses
    # none of grpo's configurations, so its runs may be on another reward model than grpo's candidates
    for seed in (100, 101):
        write_run(folder / "select", "grpo", seed, 3 * LR, 0.2)
    searched = list((folder / "select").glob("*-grpo-*-lr0.0015-*"))
    assert len(searched) == 2
    for d in searched:
        _trained_on(d, "b")
    with pytest.raises(TuningError, match="grpo's selection"):  # without a search file, an off-grid run is a candidate
        read_setting(folder)
    (folder / "matched.json").write_text(json.dumps({"baseline": "grpo"}))
    st = read_setting(folder)
    assert st.schemes["grpo"].lr == LR
    assert any("matched-KL search's grpo runs were trained on other assets" in w for w in st.warnings), st.warnings

    [run] = (folder / "select").glob("*-datc-*-s101-lr0.00025-*")
    _trained_on(run, "b")  # one of datc's candidates trained on another reward model
    with pytest.raises(TuningError, match=r"datc's selection: .* were trained on different assets \(reward/model.safetensors"):
        read_setting(folder)
    _trained_on(run, "a")
    [run] = (folder / "select").glob("*-datc-*-s100-lr0.001-tau2.0")
    _trained_on(run, "b")  # a knob candidate at the chosen rate: on the path too
    with pytest.raises(TuningError, match=r"datc's selection"):
        read_setting(folder)


def test_the_detectable_difference_is_the_planning_formula_by_hand():
    from datc.report.statistics import detectable_difference, t_interval

    # differences 0.1, 0.2, 0.3: n 3, sd 0.1; t(0.975, 2) = 4.302653, t(0.80, 2) = 1.060660
    iv = t_interval([0.1, 0.2, 0.3])
    assert iv.half_width == pytest.approx(4.302653 * 0.1 / 3 ** 0.5, rel=1e-6)
    assert detectable_difference(iv) == pytest.approx((4.302653 + 1.060660) * 0.1 / 3 ** 0.5, rel=1e-6)
    assert detectable_difference(iv, power=0.5) == pytest.approx(iv.half_width, rel=1e-9)  # t(0.5) = 0
    assert detectable_difference(t_interval([0.2])) is None
