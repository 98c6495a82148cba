"""METHOD §6's matched-KL control (datc/report/matched_kl.py, scripts/tuned_sweep.py --stage kl):
the rate search's proposals on hand-computed points, a round's commands on a hand-made sweep (the
search on the selection seeds, then the matched rate on the evaluation seeds), the report's
reading, and the refusal of a matched run on a selection seed."""

from __future__ import annotations

import json
import math

import pytest

from datc.compare import main as compare
from datc.study.matched import MATCHED_DIR, matched_lr, propose_lr
from datc.study.reading import MANIFEST, read_setting
from tests.test_tuning import EVAL, LR, SELECT, sweep, write_run

try:
    from scripts.tuned_sweep import kl_round
except ImportError:  # removed by issue 54: the rounds are datc.study.jobs.kl_jobs (tests/study/)
    kl_round = None
needs_script = pytest.mark.skipif(kl_round is None, reason="scripts/tuned_sweep.py (lanes, ±20%) replaced by datc-study")


def test_the_rate_is_interpolated_in_log_log_between_the_points_that_bracket_the_target():
    pts = [(1e-3, 1.0), (2e-3, 4.0)]
    assert propose_lr(pts, 2.0) == pytest.approx(1.41e-3)  # sqrt(1e-3 * 2e-3), 3 significant digits
    assert propose_lr(pts, 16.0) == pytest.approx(4e-3)  # slope 2 beyond the top: x2
    assert propose_lr(pts, 1e6) == pytest.approx(8e-3)  # the move is at most x4
    assert propose_lr(pts, 0.5) == pytest.approx(7.07e-4)  # below: down from the smallest KL, slope 2
    assert propose_lr([(1e-3, 1.0)], 2.0) == pytest.approx(2e-3)  # one point: slope 1
    # a flat segment is taken at the least slope (0.5), from the higher rate: x4 for twice the KL
    assert propose_lr([(1e-3, 1.0), (2e-3, 1.0)], 2.0) == pytest.approx(8e-3)
    # not monotone: the lowest bracketing pair is used
    assert propose_lr([(1e-3, 1.0), (2e-3, 3.0), (4e-3, 1.5)], 2.0) == pytest.approx(
        float(f"{math.exp(math.log(1e-3) + math.log(2) / math.log(3) * math.log(2)):.3g}"))


def test_the_matched_rate_is_the_nearest_within_twenty_percent_or_none():
    pts = [(1e-3, 1.0), (1.2e-3, 1.9), (1.5e-3, 2.3)]
    assert matched_lr(pts, 2.0) == 1.2e-3  # 0.95 and 1.15 both within; 0.95 nearer in log
    assert matched_lr(pts, 3.0) is None  # 2.3 / 3 = 0.77
    assert matched_lr([(1e-3, 1.2)], 1.0) == 1e-3 and matched_lr([(1e-3, 1.21)], 1.0) is None  # the bound: inclusive


def _manifest(folder):
    m = json.loads((folder / MANIFEST).read_text())
    m.update(experiment="four_settings", overrides=["trainer.threads=1"])
    return m


def _arg(cmd, key):
    return next(c.split("=", 1)[1] for c in cmd if c.startswith(key + "="))


def matched_sweep(root):
    """The sweep of tests/test_tuning.py with KLs: grpo's selection points 0.1, 0.2, 0.4 at x0.5, x1,
    x2; datc's chosen configuration (x2, tau 0.5) at 0.8 on the selection seeds; its tuned gain over
    tuned grpo is +0.300 on every evaluation seed (resolved)."""
    folder = sweep(root)
    for d in (folder / "select").iterdir():
        s = json.loads((d / "summary.json").read_text())
        ident = json.loads((d / "run.json").read_text())["identity"]
        lr, tau = ident["trainer"]["lr"], ident["credit"].get("tau")
        kl = {LR / 2: 0.1, LR: 0.2, 2 * LR: 0.4}[lr] if s["credit"] == "grpo" else (0.8 if tau == 0.5 else 0.3)
        s["eval"]["final"]["eval/kl"] = kl
        (d / "summary.json").write_text(json.dumps(s))
    return folder


@needs_script
def test_a_round_searches_on_the_selection_seeds_then_evaluates_the_matched_rate(tmp_path, capsys):
    folder = matched_sweep(tmp_path / "runs")
    m = _manifest(folder)
    (cmd,), waiting = kl_round(m, folder, "grpo")  # no grpo point near 0.8: one new rate, slope 1 from x2 -> x4
    assert _arg(cmd, "credit") == "grpo" and float(_arg(cmd, "trainer.lr")) == pytest.approx(4 * LR) and waiting is None
    assert _arg(cmd, "hydra.sweep.dir").endswith("select") and _arg(cmd, "seed") == "100,101"
    assert json.loads((folder / "matched.json").read_text()) == {"datc": {"target_kl": 0.8, "tried": [0.002]}, "baseline": "grpo"}
    assert kl_round(m, folder, "grpo").cmds == [cmd]  # the same round again until its runs finish
    for seed in SELECT:  # grpo at x4: KL 0.75 on the selection seeds, within 20% of 0.8
        write_run(folder / "select", "grpo", seed, 4 * LR, 0.35, kl=0.75)
    cmds = kl_round(m, folder, "grpo").cmds
    assert [(_arg(c, "prepare_seed"), _arg(c, "seed")) for c in cmds] == [("0", "200,201"), ("1", "202,203")]
    assert all(_arg(c, "hydra.sweep.dir").endswith(MATCHED_DIR) and float(_arg(c, "trainer.lr")) == pytest.approx(4 * LR)
               for c in cmds)
    lanes = [[(_arg(c, "prepare_seed"), _arg(c, "seed")) for c in kl_round(m, folder, "grpo", (k, 2)).cmds] for k in (0, 1)]
    assert lanes == [[("0", "200"), ("1", "202")], [("0", "201"), ("1", "203")]]  # two batches share the seeds
    for draw, seeds in EVAL.items():  # the matched grpo: 0.45 + ..., so datc's gain shrinks to +0.050
        for seed in seeds:
            write_run(folder / MATCHED_DIR, "grpo", seed, 4 * LR, 0.45 + 0.01 * (seed % 3), draw=int(draw), kl=0.9)
    assert kl_round(m, folder, "grpo") == ([], None)  # nothing left to run, nothing to wait for
    compare(["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "tuned.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| datc | **+0.300"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "0.800" and cells[3] == "0.002 (×4)" and cells[4] == "0.750 (ratio 0.94)"
    assert cells[5] == "0.100 / 0.900 (ratio 9.00)"  # the evaluation KLs are reported as they came out
    assert cells[6] == "**+0.050 ± 0.000**"
    assert cells[7] == "credit: the gain holds at matched KL (the evaluation seeds' KLs are not within ±20%)"
    control = json.loads((tmp_path / "out" / "tuned.json").read_text())["settings"][0]["matched_kl"]
    assert [(r["scheme"], r["lr"], r["vs_matched"]["seeds"]) for r in control] == [("datc", 4 * LR, [200, 201, 202, 203])]


@needs_script
def test_lanes_share_each_search_round_and_wait_for_each_other(tmp_path):
    """--stage kl --lane k/n: each searched rate's selection seeds are split among the lanes; lane 0
    chooses every next rate (the others wait for it), and a lane whose share of a round is done
    waits for the others' runs before the next round is chosen."""
    folder = matched_sweep(tmp_path / "runs")
    m = _manifest(folder)
    assert kl_round(m, folder, "grpo", (1, 2)) == ([], "datc: lane 0's next grpo rate")  # nothing asked for yet
    (c0,), w0 = kl_round(m, folder, "grpo", (0, 2))
    (c1,), w1 = kl_round(m, folder, "grpo", (1, 2))  # lane 1 reads lane 0's rate from matched.json
    assert (_arg(c0, "seed"), _arg(c1, "seed")) == ("100", "101") and w0 is w1 is None
    assert _arg(c0, "trainer.lr") == _arg(c1, "trainer.lr") and float(_arg(c0, "trainer.lr")) == pytest.approx(4 * LR)
    write_run(folder / "select", "grpo", 100, 4 * LR, 0.35, kl=0.3)  # lane 0's run done, lane 1's not: x4 is short of 0.8
    assert kl_round(m, folder, "grpo", (0, 2)) == ([], "datc: grpo at 0.002 on the other lanes' selection seeds")
    assert kl_round(m, folder, "grpo", (1, 2)).cmds == [c1]  # lane 1 resumes its own
    assert json.loads((folder / "matched.json").read_text())["datc"]["tried"] == [0.002]  # no rate chosen on half a round
    write_run(folder / "select", "grpo", 101, 4 * LR, 0.35, kl=0.3)
    assert kl_round(m, folder, "grpo", (1, 2)) == ([], "datc: lane 0's next grpo rate")
    (n0,), _ = kl_round(m, folder, "grpo", (0, 2))  # the round complete: lane 0 chooses the next rate
    assert float(_arg(n0, "trainer.lr")) > 4 * LR and _arg(n0, "seed") == "100"
    assert json.loads((folder / "matched.json").read_text())["datc"]["tried"] == [0.002, float(_arg(n0, "trainer.lr"))]


@needs_script
def test_a_search_that_stops_says_so_to_every_lane(tmp_path, capsys):
    folder = matched_sweep(tmp_path / "runs")
    m = _manifest(folder)
    search = {"datc": {"target_kl": 0.8, "tried": []}, "baseline": "grpo"}
    for i in range(4):  # four rounds tried, none within 20% of 0.8
        lr = LR * (3 + i)
        search["datc"]["tried"].append(lr)
        for seed in SELECT:
            write_run(folder / "select", "grpo", seed, lr, 0.35, kl=0.42 + 0.01 * i)
    (folder / "matched.json").write_text(json.dumps(search))
    assert kl_round(m, folder, "grpo", (0, 2)) == ([], None)
    assert "no grpo rate within ±20% of KL 0.800 in 4 rounds: stopped" in capsys.readouterr().err
    assert "in 4 rounds" in json.loads((folder / "matched.json").read_text())["datc"]["stopped"]
    assert kl_round(m, folder, "grpo", (1, 2)) == ([], None)  # lane 1 does not wait for a search that stopped


@needs_script
def test_a_gain_that_vanishes_at_matched_kl_reads_as_step_size(tmp_path):
    folder = matched_sweep(tmp_path / "runs")
    kl_round(_manifest(folder), folder, "grpo")
    for seed in SELECT:
        write_run(folder / "select", "grpo", seed, 4 * LR, 0.35, kl=0.85)
    for draw, seeds in EVAL.items():
        for i, seed in enumerate(seeds):  # matched grpo as good as datc, up to noise of either sign
            write_run(folder / MATCHED_DIR, "grpo", seed, 4 * LR, 0.5 + 0.01 * (seed % 3) + (0.02 if i else -0.02),
                      draw=int(draw), kl=0.11)
    compare(["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    row = next(ln for ln in (tmp_path / "out" / "tuned.md").read_text().splitlines() if ln.startswith("| datc | **+0.300"))
    assert row.rstrip(" |").split(" | ")[-2] == "step size: the gain is not resolved at matched KL"


def test_a_matched_run_on_a_selection_seed_is_refused(tmp_path, capsys):
    folder = matched_sweep(tmp_path / "runs")
    write_run(folder / MATCHED_DIR, "grpo", 100, 4 * LR, 0.3)
    with pytest.raises(SystemExit) as e:
        compare(["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "matched-KL evaluation run on selection seed 100" in err


@needs_script
def test_the_round_waits_for_a_complete_evaluation(tmp_path):
    folder = matched_sweep(tmp_path / "runs")
    next((folder / "eval").glob("*datc-p1-s203-lr0.001-tau0.5")).joinpath("summary.json").unlink()
    from scripts.tuned_sweep import Refused

    with pytest.raises(Refused, match="evaluation is not complete for datc"):
        kl_round(_manifest(folder), folder, "grpo")
    assert read_setting(folder).schemes["datc"].chosen.kl.mean == pytest.approx(0.8)


@needs_script
def test_a_rate_the_comparison_already_evaluated_is_not_run_again(tmp_path):
    folder = matched_sweep(tmp_path / "runs")
    for d in (folder / "select").glob("*-datc-*tau0.5"):  # datc's target 0.21: grpo's chosen rate (x1, KL 0.2) matches
        s = json.loads((d / "summary.json").read_text())
        s["eval"]["final"]["eval/kl"] = 0.21
        (d / "summary.json").write_text(json.dumps(s))
    assert kl_round(_manifest(folder), folder, "grpo") == ([], None)
    compare(["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--baseline", "datc"])
    assert json.loads((tmp_path / "out" / "tuned.json").read_text())["settings"][0]["matched_kl"] == []  # ran for grpo only
    compare(["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    (row,) = json.loads((tmp_path / "out" / "tuned.json").read_text())["settings"][0]["matched_kl"]
    assert row["lr"] == LR and row["vs_matched"]["mean"] == pytest.approx(0.3)  # against tuned grpo's own runs
    assert len(row["matched_runs"]) == 4 and not (folder / MATCHED_DIR).exists()


@needs_script
def test_targets_within_ten_percent_share_a_round(tmp_path):
    folder = matched_sweep(tmp_path / "runs")
    m = json.loads((folder / MANIFEST).read_text())
    m["schemes"]["oracle"] = m["schemes"]["datc"]
    (folder / MANIFEST).write_text(json.dumps(m))
    for where in ("select", "eval"):  # oracle: datc's runs, its selection KL 0.84 (within 10% of datc's 0.8)
        for d in list((folder / where).glob("*-datc-*")):
            new = folder / where / d.name.replace("-datc-", "-oracle-")
            new.mkdir()
            for f in ("run.json", "summary.json"):
                text = (d / f).read_text().replace('"datc"', '"oracle"').replace("-datc-", "-oracle-")
                s = json.loads(text)
                if f == "summary.json" and where == "select" and s["eval"]["final"]["eval/kl"] == 0.8:
                    s["eval"]["final"]["eval/kl"] = 0.84
                (new / f).write_text(json.dumps(s))
    (cmd,), _ = kl_round(_manifest(folder), folder, "grpo")  # one rate for both this round
    assert float(_arg(cmd, "trainer.lr")) == pytest.approx(4 * LR)
    assert json.loads((folder / "matched.json").read_text())["oracle"]["tried"] == []
