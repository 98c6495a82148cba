"""datc.report: aggregation over seeds, paired differences to the baseline, the written outputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from datc.report import (
    build_report,
    curve_band,
    deduplicate,
    gold_auc,
    load_run_dirs,
    run_from_summary,
    summary_from_wandb,
    write_outputs,
)

REPO = Path(__file__).resolve().parents[2]
# Student-t 97.5% quantiles (p = 0.975) in closed form. 2 degrees of freedom (3 seeds):
# (2p - 1) / sqrt(2p(1 - p)) = 0.95 / sqrt(0.04875) = 4.30265272975 (the 4.302652729911275
# sometimes quoted is off in the 10th digit); 1 degree of freedom (2 seeds):
# tan(pi (p - 1/2)) = tan(0.475 pi) = 12.7062047362.
T2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
T1 = math.tan(0.475 * math.pi)


def approx(expected):
    """Tight enough to pin the hand arithmetic, loose enough for float rounding."""
    return pytest.approx(expected, rel=1e-9, abs=1e-12)


PLOTS = ("gold_curves.png", "credit_accuracy.png", "rm_vs_gold.png")
OUTPUTS = ("table.md", "table.tex", "summary.md", "runs.csv", "report.json", *PLOTS)

# Two settings x two schemes x seeds 0, 1, 2. Keywords: DATC clearly ahead of GRPO on every seed;
# arithmetic: DATC mixed (ahead on one seed, behind on two).
GOLD = {
    ("keywords", "tiny_gpt2", "grpo"): [0.1, 0.2, 0.3],
    ("keywords", "tiny_gpt2", "datc"): [0.3, 0.5, 0.6],
    ("arithmetic", "tiny_llama", "grpo"): [0.1, 0.2, 0.3],
    ("arithmetic", "tiny_llama", "datc"): [0.0, 0.3, 0.2],
}
AUC = {
    ("keywords", "tiny_gpt2", "grpo"): [0.05, 0.1, 0.15],
    ("keywords", "tiny_gpt2", "datc"): [0.15, 0.2, 0.3],
    ("arithmetic", "tiny_llama", "grpo"): [0.1, 0.1, 0.1],
    ("arithmetic", "tiny_llama", "datc"): [0.1, 0.2, 0.0],
}
ACCURACY = {"datc": [0.2, 0.3, 0.4], "grpo": [0.0, None, None]}  # a stray 0 for GRPO must not show
STEP_S = {"datc": [0.1, 0.2, 0.3], "grpo": [0.1, 0.1, 0.1]}


def summary(data, policy, credit, seed, gold, auc=None, accuracy=None, step_s=None, rm=None):
    """A summary.json dict as the trainer writes it; the eval curve rises linearly to ``gold``."""
    return {
        "run_name": f"{data}-{policy}-{credit}-s{seed}",
        "run_id": f"id{seed}",
        "seed": seed,
        "credit": credit,
        "policy": policy,
        "data": data,
        "steps": 100,
        "wall_time_s": 10.0,
        "git_commit": "abc123",
        "eval": {
            "initial": {"eval/gold": 0.0, "eval/rm_score": 0.0, "eval/kl": 0.0},
            "final": {
                "eval/gold": gold,
                "eval/rm_score": gold if rm is None else rm,
                "eval/kl": 0.5,
            },
            "curve": [
                {"step": s, "gold": gold * s / 100, "rm_score": gold * s / 100}
                for s in (0, 50, 100)
            ],
            "gold_auc": auc,
        },
        "train_mean": {"perf/step_s": step_s, "credit/accuracy": accuracy},
        "rm_report": {"heldout_within_group_corr": 0.9},
    }


def write_summary(root: Path, s: dict, name: str | None = None) -> Path:
    d = root / (name or s["run_name"])
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(s))
    return d / "summary.json"


@pytest.fixture
def runs_root(tmp_path):
    root = tmp_path / "runs"
    for (data, policy, credit), golds in GOLD.items():
        for seed, gold in enumerate(golds):
            write_summary(
                root,
                summary(
                    data,
                    policy,
                    credit,
                    seed,
                    gold,
                    AUC[(data, policy, credit)][seed],
                    ACCURACY[credit][seed],
                    STEP_S[credit][seed],
                    rm=gold + 0.1 if credit == "datc" else gold,  # DATC's RM over-rates it a little
                ),
            )
    return root


def table_row(table_md: str, setting: str, scheme: str) -> list[str]:
    """The cells of the Markdown table row for (setting, scheme)."""
    line = next(ln for ln in table_md.splitlines() if ln.startswith(f"| {setting} | {scheme} |"))
    return [c.strip() for c in line.strip("|").split("|")]


# Markdown columns: setting, scheme, final gold, Δ final gold, gold AUC, Δ gold AUC, final RM score,
# final KL, credit accuracy, step time, n seeds.
GOLD_COL, DGOLD_COL, AUC_COL, DAUC_COL, RM_COL, KL_COL, ACC_COL, STEP_COL, N_COL = range(2, 11)


def test_table_means_intervals_and_paired_differences(runs_root, tmp_path):
    loaded = load_run_dirs([runs_root])
    assert loaded.warnings == [] and len(loaded.runs) == 12
    report = build_report(loaded.runs, "grpo")
    out = tmp_path / "out"
    write_outputs(report, out)
    rows = {
        (r["setting"], r["scheme"]): r
        for r in json.loads((out / "report.json").read_text())["rows"]
    }
    table = (out / "table.md").read_text()

    # Keywords GRPO final gold [0.1, 0.2, 0.3]: mean 0.2, sd 0.1,
    # half-width = T2 * 0.1 / sqrt(3) = 0.24841.
    g = rows[("keywords / tiny_gpt2", "grpo")]["metrics"]["final_gold"]
    assert g["mean"] == approx(0.2) and g["n"] == 3
    assert g["half_width"] == approx(T2 * 0.1 / math.sqrt(3))
    # Keywords DATC final gold [0.3, 0.5, 0.6]: mean 1.4/3 = 0.46667; deviations -1/6, 1/30, 2/15,
    # squares sum 0.046667, /2 -> var 0.023333, sd 0.152753;
    # half-width T2 * 0.152753 / sqrt(3) = 0.37946.
    g = rows[("keywords / tiny_gpt2", "datc")]["metrics"]["final_gold"]
    assert g["mean"] == approx(1.4 / 3)
    assert g["half_width"] == approx(T2 * math.sqrt(0.07 / 3) / math.sqrt(3))
    # Paired by seed: differences [0.2, 0.3, 0.3]: mean 0.26667, deviations -1/15, 1/30, 1/30,
    # squares sum 1/150, /2 -> var 1/300, sd 0.057735; half-width T2 * 0.057735 / sqrt(3) = 0.14342,
    # so the interval [0.123, 0.410] excludes zero.
    d = rows[("keywords / tiny_gpt2", "datc")]["vs_baseline"]["final_gold"]
    assert d["mean"] == approx(0.8 / 3) and d["seeds"] == [0, 1, 2]
    assert d["half_width"] == approx(T2 * math.sqrt(1 / 300) / math.sqrt(3))
    assert d["significant"] is True
    # Arithmetic: differences [0.0-0.1, 0.3-0.2, 0.2-0.3] = [-0.1, 0.1, -0.1]: mean -1/30,
    # deviations -1/15, 2/15, -1/15, squares sum 6/225, /2 -> var 1/75, sd 0.11547;
    # half-width 0.28684, so the interval includes 0.
    d = rows[("arithmetic / tiny_llama", "datc")]["vs_baseline"]["final_gold"]
    assert d["mean"] == approx(-1 / 30)
    assert d["half_width"] == approx(T2 * math.sqrt(1 / 75) / math.sqrt(3))
    assert d["significant"] is False
    # Gold AUC, keywords: differences [0.1, 0.1, 0.15]: mean 0.11667, deviations -1/60, -1/60, 1/30,
    # squares sum 1/600, /2 -> var 1/1200, sd 0.028868; half-width 0.07171 (excludes 0).
    # Arithmetic: differences [0.0, 0.1, -0.1]: mean 0, sd 0.1, half-width 0.24841 (includes 0).
    d = rows[("keywords / tiny_gpt2", "datc")]["vs_baseline"]["gold_auc"]
    assert (d["mean"], d["half_width"]) == approx(
        (0.35 / 3, T2 * math.sqrt(1 / 1200) / math.sqrt(3))
    )
    d = rows[("arithmetic / tiny_llama", "datc")]["vs_baseline"]["gold_auc"]
    assert (d["mean"], d["half_width"]) == approx((0.0, T2 * 0.1 / math.sqrt(3)))
    # Credit accuracy of keywords DATC [0.2, 0.3, 0.4]: mean 0.3, sd 0.1, half-width 0.24841.
    a = rows[("keywords / tiny_gpt2", "datc")]["metrics"]["credit_accuracy"]
    assert (a["mean"], a["half_width"]) == approx((0.3, T2 * 0.1 / math.sqrt(3)))
    assert rows[("keywords / tiny_gpt2", "grpo")]["vs_baseline"] == {}

    # The same numbers, rounded to 3 decimals, in the Markdown table; bold exactly where
    # significant.
    kd = table_row(table, "keywords / tiny_gpt2", "datc")
    assert kd[GOLD_COL] == "0.467 ± 0.379"
    assert kd[DGOLD_COL] == "**+0.267 ± 0.143**"
    assert kd[AUC_COL] == "0.217 ± 0.190"  # [0.15, 0.2, 0.3]: sd sqrt(0.035 / 6) = 0.076376
    assert kd[DAUC_COL] == "**+0.117 ± 0.072**"
    assert kd[RM_COL] == "0.567 ± 0.379"  # gold + 0.1: same spread
    assert kd[KL_COL] == "0.500 ± 0.000"  # constant 0.5: sd 0
    assert kd[ACC_COL] == "0.300 ± 0.248"
    assert kd[STEP_COL] == "0.200 ± 0.248"
    assert kd[N_COL] == "3"
    ad = table_row(table, "arithmetic / tiny_llama", "datc")
    assert ad[DGOLD_COL] == "-0.033 ± 0.287"
    assert ad[DAUC_COL] == "+0.000 ± 0.248"
    assert "**" not in " ".join(ad)
    kg = table_row(table, "keywords / tiny_gpt2", "grpo")
    assert kg[GOLD_COL] == "0.200 ± 0.248"
    assert kg[DGOLD_COL] == "(baseline)"
    assert kg[ACC_COL] == "n/a"  # GRPO logged 0.0 on one seed: undefined all the same
    assert table.count("**") == 4  # two bold cells, both in the keywords DATC row

    tex = (out / "table.tex").read_text()
    assert r"\textbf{+0.267 $\pm$ 0.143}" in tex and r"\textbf{+0.117 $\pm$ 0.072}" in tex
    assert tex.count(r"\textbf") == 2
    assert r"keywords / tiny\_gpt2 & datc & 0.467 $\pm$ 0.379" in tex


def test_summary_says_beat_only_where_the_interval_excludes_zero(runs_root, tmp_path):
    report = build_report(load_run_dirs([runs_root]).runs, "grpo")
    write_outputs(report, tmp_path / "out")
    text = (tmp_path / "out" / "summary.md").read_text()
    sentences = {ln.split(",")[0]: ln for ln in text.splitlines() if ln.startswith("- On ")}
    assert sentences["- On keywords / tiny_gpt2"] == (
        "- On keywords / tiny_gpt2, DATC beat GRPO on final held-out gold: "
        "paired difference +0.267 ± 0.143 "
        "(95% t-interval over 3 shared seeds; it excludes zero)."
    )
    assert sentences["- On arithmetic / tiny_llama"] == (
        "- On arithmetic / tiny_llama, the difference between DATC and GRPO on final held-out gold is not resolved: "
        "paired difference -0.033 ± 0.287 "
        "(95% t-interval over 3 shared seeds; the interval does not exclude zero)."
    )
    for png in PLOTS:
        assert f"]({png})" in text


def test_single_seed_missing_scheme_and_unshared_seeds(tmp_path):
    root = tmp_path / "runs"
    write_summary(root, summary("keywords", "tiny_llama", "datc", 0, 0.4))  # no GRPO here
    write_summary(root, summary("arithmetic", "tiny_gpt2", "grpo", 0, 0.1))  # no DATC here
    write_summary(root, summary("keywords", "tiny_gpt2", "grpo", 0, 0.1))  # seeds not shared
    write_summary(root, summary("keywords", "tiny_gpt2", "datc", 1, 0.2))
    report = build_report(load_run_dirs([root]).runs, "grpo")
    out = tmp_path / "out"
    write_outputs(report, out)
    table = (out / "table.md").read_text()
    row = table_row(table, "keywords / tiny_llama", "datc")
    assert row[GOLD_COL] == "0.400 (n=1)"  # n = 1: the mean and its n only
    assert row[DGOLD_COL] == "n/a (no grpo run)"
    assert table_row(table, "keywords / tiny_gpt2", "datc")[DGOLD_COL] == "n/a (no shared seed)"
    text = (out / "summary.md").read_text()
    assert "On keywords / tiny_llama, GRPO is missing" in text
    assert "On arithmetic / tiny_gpt2, DATC is missing" in text
    assert "On keywords / tiny_gpt2, DATC and GRPO share no seed" in text
    for png in PLOTS:
        assert (out / png).stat().st_size > 0


def test_missing_keys_and_bad_files_do_not_crash(tmp_path):
    root = tmp_path / "runs"
    write_summary(root, {}, "empty")
    write_summary(root, {"credit": "datc", "eval": None, "train_mean": None, "seed": None}, "nulls")
    write_summary(
        root,
        {
            "credit": "datc",
            "data": "keywords",
            "policy": "tiny_gpt2",
            "seed": "x",
            "eval": {
                "final": {"eval/gold": "inf", "eval/kl": None},
                "curve": [{"step": None, "gold": 1}, {"step": 5}, "junk"],
            },
            "train_mean": {"credit/accuracy": "nan"},
        },
        "strings",
    )
    (root / "torn").mkdir()
    (root / "torn" / "summary.json").write_text('{"run_name": ')
    loaded = load_run_dirs([root, tmp_path / "absent"])
    assert len(loaded.runs) == 3
    assert any("torn" in w and "unreadable" in w for w in loaded.warnings)
    assert any("absent" in w for w in loaded.warnings)
    by_name = {r.run_name: r for r in loaded.runs}
    assert by_name["empty"].credit == "unknown" and by_name["empty"].final_gold is None
    s = by_name["strings"]
    assert (s.final_gold, s.seed, s.credit_accuracy, s.curve) == (None, None, None, ())
    out = tmp_path / "out"
    written = write_outputs(build_report(deduplicate(loaded.runs).runs, "grpo"), out)
    assert sorted(p.name for p in written) == sorted(OUTPUTS)
    assert "| unknown / unknown | unknown | n/a |" in (out / "table.md").read_text()
    for png in PLOTS:
        assert (out / png).read_bytes().startswith(b"\x89PNG")


def test_duplicates_keep_the_newest_and_warn(tmp_path):
    old = write_summary(tmp_path / "a", summary("keywords", "tiny_gpt2", "datc", 0, 0.1))
    new = write_summary(tmp_path / "b", summary("keywords", "tiny_gpt2", "datc", 0, 0.9))
    os.utime(old, (1_000_000, 1_000_000))
    os.utime(new, (2_000_000, 2_000_000))
    # Overlapping roots find the same files again: read once, not reported as duplicates.
    loaded = load_run_dirs([tmp_path / "b", tmp_path / "a", tmp_path])
    assert len(loaded.runs) == 2
    assert all(Path(r.source).is_absolute() for r in loaded.runs)  # outside the working directory: as given
    unique = deduplicate(loaded.runs)
    assert [r.final_gold for r in unique.runs] == [0.9]
    assert (
        len(unique.warnings) == 1
        and "duplicate" in unique.warnings[0]
        and str(old) in unique.warnings[0]
    )


def test_curve_band_and_gold_auc():
    a = run_from_summary(summary("keywords", "tiny_gpt2", "datc", 0, 0.2), "a", 0.0, "a")
    b = run_from_summary(summary("keywords", "tiny_gpt2", "datc", 1, 0.4), "b", 0.0, "b")
    band = curve_band([a, b])
    # Step 50: golds 0.1 and 0.2: mean 0.15, var (0.05^2 * 2) / 1 = 0.005, sd 0.070711,
    # half-width T1 * 0.070711 / sqrt(2) = 0.63531.
    assert band.steps.tolist() == [0, 50, 100] and band.n.tolist() == [2, 2, 2]
    assert band.mean[1] == approx(0.15)
    assert band.half_width[1] == approx(T1 * math.sqrt(0.005) / math.sqrt(2))
    # Trapezoids: 50 * (0 + 0.1) / 2 + 50 * (0.1 + 0.1) / 2 = 2.5 + 5 = 7.5, over a span of
    # 100 steps.
    assert gold_auc([(0, 0.0), (50, 0.1), (100, 0.1)]) == approx(0.075)
    assert gold_auc([(0, 0.3)]) is None


def test_wandb_mapping():
    fake = SimpleNamespace(
        name="keywords-tiny_gpt2-datc-s3",
        id="w1",
        config={
            "seed": 3,
            "credit": {"name": "datc", "gamma": 1.0},
            "data": {"name": "keywords"},
            "policy": {"name": "tiny_gpt2"},
            "trainer": {"steps": 200},
        },
        summary={
            "eval/gold": 0.12,
            "eval/rm_score": 0.1,
            "eval/kl": 0.8,
            "credit/accuracy": 0.21,
            "perf/step_s": 0.1,
            "loss/policy": 0.5,
            "_runtime": 81.2,
            "_timestamp": 1.7e9,
        },
    )
    history = [
        {"_step": 50, "eval/gold": 0.1, "eval/rm_score": 0.1},
        {"_step": 0, "eval/gold": 0.0, "eval/rm_score": 0.0},
        {"_step": 10, "loss/policy": 0.3},
    ]  # a training row: not on the eval curve
    s = summary_from_wandb(fake, history)
    assert (s["run_name"], s["run_id"], s["seed"], s["steps"]) == (
        "keywords-tiny_gpt2-datc-s3",
        "w1",
        3,
        200,
    )
    assert (s["credit"], s["data"], s["policy"]) == ("datc", "keywords", "tiny_gpt2")
    assert s["eval"]["final"] == {"eval/gold": 0.12, "eval/rm_score": 0.1, "eval/kl": 0.8}
    assert s["train_mean"] == {"credit/accuracy": 0.21, "perf/step_s": 0.1}
    assert [p["step"] for p in s["eval"]["curve"]] == [0, 50]
    assert s["eval"]["gold_auc"] == approx(0.05)  # one trapezoid: (0 + 0.1) / 2
    run = run_from_summary(s, "wandb:e/p/w1", 1.7e9, "w1")
    assert (run.setting, run.credit, run.seed, run.final_gold, run.credit_accuracy, run.step_s) == (
        "keywords / tiny_gpt2",
        "datc",
        3,
        0.12,
        0.21,
        0.1,
    )
    # A run with no config or summary at all maps to an all-missing summary, not an error.
    empty = run_from_summary(
        summary_from_wandb(SimpleNamespace(name=None, id="w2", config={}, summary={})),
        "wandb:e/p/w2",
        0.0,
        "w2",
    )
    assert (empty.run_name, empty.credit, empty.final_gold, empty.gold_auc) == (
        "w2",
        "unknown",
        None,
        None,
    )


def test_cli(runs_root, tmp_path):
    out = tmp_path / "results" / "four_settings"
    proc = subprocess.run(
        [sys.executable, "-m", "datc.compare", str(runs_root), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(Path(p).name for p in proc.stdout.split()) == sorted(OUTPUTS)
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS)  # no temp files left behind
    for png in PLOTS:
        assert (out / png).stat().st_size > 0
    lines = (out / "runs.csv").read_text().splitlines()
    assert len(lines) == 13 and lines[0].startswith("run_name,run_id,data,policy,credit,seed")
    empty = subprocess.run(
        [sys.executable, "-m", "datc.compare", str(tmp_path / "none"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert empty.returncode != 0 and "no runs found" in empty.stderr


def test_unfinished_runs_and_non_object_summaries_are_warned_and_skipped(tmp_path):
    root = tmp_path / "runs"
    write_summary(root, summary("keywords", "tiny_gpt2", "grpo", 0, 0.3))
    half = root / "half-finished"  # a run killed before its end: run.json and metrics, no summary
    half.mkdir()
    (half / "run.json").write_text('{"run_id": "x", "identity": {}}')
    (half / "metrics.jsonl").write_text('{"step": 1}\n')
    write_summary(root, [1, 2, 3], "a-list")
    loaded = load_run_dirs([root])
    assert [r.credit for r in loaded.runs] == ["grpo"]  # the list is not an "unknown" run
    assert any("half-finished" in w and "unfinished" in w for w in loaded.warnings)
    assert any("a-list" in w and "not a run summary" in w for w in loaded.warnings)


def test_out_under_a_file_is_one_line_exit_2(runs_root, tmp_path, capsys):
    from datc.compare import main

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        main([str(runs_root), "--out", str(blocker / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("datc-compare: --out") and "Traceback" not in "".join(err)


def test_every_scheme_has_its_own_style_and_the_baseline_stands_out(tmp_path):
    from datc.credit.configs import credit_labels
    from datc.report.plots import _styles

    schemes = credit_labels()  # every credit config and registered scheme: a new one needs no edit here
    root = tmp_path / "runs"
    for s in schemes:
        write_summary(root, summary("keywords", "tiny_gpt2", s, 0, 0.3))
    report = build_report(load_run_dirs([root]).runs, "grpo")
    styles = _styles(report)
    assert styles["grpo"]["color"] == "black" and styles["grpo"]["linewidth"] > max(
        st["linewidth"] for s, st in styles.items() if s != "grpo")
    others = [(tuple(st["color"]), st["marker"], st["linestyle"]) for s, st in styles.items() if s != "grpo"]
    assert len(set(others)) == len(others)  # no two schemes drawn alike
    assert len({c for c, _, _ in others}) == min(len(others), 18)  # a colour of its own for each of the first 18


def test_any_number_of_schemes_is_drawn_without_two_alike():
    from datc.report.plots import scheme_style

    for n in (17, 40, 300, 1080):
        styles = [scheme_style(i) for i in range(n)]
        assert len(set(styles)) == n, n
    assert len({c for c, _, _ in (scheme_style(i) for i in range(18))}) == 18


def test_sources_below_the_working_directory_are_named_relative_to_it(tmp_path, monkeypatch):
    path = write_summary(tmp_path / "runs", summary("keywords", "tiny_gpt2", "datc", 0, 0.1))
    monkeypatch.chdir(tmp_path)
    loaded = load_run_dirs([tmp_path / "runs"])  # an absolute root
    assert [r.source for r in loaded.runs] == [str(path.relative_to(tmp_path))]
    assert loaded.runs[0].source.startswith("runs")


# ---- runs of different configs; two comparisons on one --out --------------------------------------


def _with_run_json(summary_path: Path, steps: int, lr: float = 1e-3, seed: int = 0, credit: str = "grpo") -> Path:
    ident = {"seed": seed, "credit": {"name": credit}, "data": {"name": "keywords"}, "policy": {"name": "tiny_gpt2"},
             "trainer": {"steps": steps, "lr": lr}}
    (summary_path.parent / "run.json").write_text(json.dumps({"run_id": "x", "identity": ident}))
    return summary_path


def test_runs_whose_configs_differ_beyond_scheme_and_seed_are_split_and_said(tmp_path, capsys):
    from datc.compare import main

    root = tmp_path / "runs"
    for seed in (0, 1, 2):
        for credit in ("grpo", "datc"):
            s = summary("keywords", "tiny_gpt2", credit, seed, 0.1 + 0.1 * seed + (credit == "datc") * 0.05)
            _with_run_json(write_summary(root, s), 3, seed=seed, credit=credit)
    long = summary("keywords", "tiny_gpt2", "datc", 0, 0.9)  # 300 steps: not a fourth seed, not a duplicate
    long["run_name"] = "long"
    _with_run_json(write_summary(root, long), 300, credit="datc")
    out = tmp_path / "out"
    main([str(root), "--out", str(out)])
    err = capsys.readouterr().err
    assert ("keywords / tiny_gpt2: runs whose configs differ in more than the scheme and the seed (at trainer.steps) "
            "are split into 2 settings: [trainer.steps=3] 6 run(s); [trainer.steps=300] 1 run(s)") in err
    assert "duplicate" not in err
    assert ("compared keywords / tiny_gpt2 [trainer.steps=300]: datc (seeds 0); keywords / tiny_gpt2 [trainer.steps=3]: "
            "datc (seeds 0, 1, 2), grpo (seeds 0, 1, 2)") in err
    rows = {(r["setting"], r["scheme"]): r for r in json.loads((out / "report.json").read_text())["rows"]}
    assert rows[("keywords / tiny_gpt2 [trainer.steps=3]", "datc")]["n_runs"] == 3
    assert rows[("keywords / tiny_gpt2 [trainer.steps=300]", "datc")]["n_runs"] == 1
    assert ("keywords / tiny_gpt2", "datc") not in rows


def test_two_comparisons_on_one_out_leave_one_whole(runs_root, tmp_path, monkeypatch):
    # Writer A pauses half-way through its files; writer B runs meanwhile. Without the lock and
    # the one-rename swap, table.md came from B and runs.csv from A.
    import threading

    import datc.report.cli as cli

    other = tmp_path / "other"
    write_summary(other, summary("reviews", "smollm2", "grpo", 0, 0.5))
    reports = {"A": build_report(load_run_dirs([runs_root]).runs), "B": build_report(load_run_dirs([other]).runs)}
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("kept\n")  # a file of the user's in --out survives
    paused, go = threading.Event(), threading.Event()
    real = cli.write_atomic

    def slow(path, data):
        if threading.current_thread().name == "A" and path.name == "runs.csv":
            paused.set()
            go.wait(10)
        real(path, data)

    monkeypatch.setattr(cli, "write_atomic", slow)
    a = threading.Thread(target=write_outputs, args=(reports["A"], out), name="A")
    b = threading.Thread(target=write_outputs, args=(reports["B"], out), name="B")
    a.start()
    assert paused.wait(10)
    b.start()
    b.join(1.0)  # B waits for A's lock (before: it wrote all eight files now)
    go.set()
    a.join(20)
    b.join(20)
    table, csv = (out / "table.md").read_text(), (out / "runs.csv").read_text()
    assert ("reviews" in table) == ("reviews" in csv), "table.md and runs.csv come from different comparisons"
    assert "reviews" in table and "keywords" not in csv  # B, the later one, whole
    assert (out / "README.md").read_text() == "kept\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")) == []  # the lock file goes with the last writer


def test_a_comparison_that_fails_half_way_leaves_the_old_outputs(runs_root, tmp_path, monkeypatch):
    import datc.report.cli as cli

    out = tmp_path / "out"
    write_outputs(build_report(load_run_dirs([runs_root]).runs), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    other = tmp_path / "other"
    write_summary(other, summary("reviews", "smollm2", "grpo", 0, 0.5))
    real = cli.write_atomic

    def full_disk(path, data):
        if path.name == "report.json":
            raise OSError(28, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(cli, "write_atomic", full_disk)
    with pytest.raises(OSError):
        write_outputs(build_report(load_run_dirs([other]).runs), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.") and p.name != ".out.lock"] == []


def test_plot_titles_fit_their_figures():
    from matplotlib.figure import Figure

    from datc.report.plots import wrapped

    for width in (4.0, 6.0, 12.0):
        fig = Figure(figsize=(width, 3), layout="constrained")
        fig.subplots()
        title = fig.suptitle(wrapped("Credit accuracy: mean over seeds ± 95% t-interval (grpo, something: undefined)", fig))
        fig.canvas.draw()
        box, frame = title.get_window_extent(), fig.bbox
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1, (width, box, frame)


def test_runs_of_a_runs_csv_pool_with_run_directories_over_asset_draws(tmp_path, capsys):
    """--runs-csv reads the runs of a table whose directories are gone (they take the config
    their setting's directories share); --pool prepare_seed pools the draws into one setting."""
    import shutil

    from datc.compare import main

    def draw(root: Path, p: int) -> None:  # seeds 3p..3p+2, as the pooled sweeps give them
        for seed in range(3 * p, 3 * p + 3):
            for credit in ("grpo", "datc"):
                s = summary("keywords", "tiny_gpt2", credit, seed, 0.1 * p + 0.01 * seed + (credit == "datc") * 0.05)
                path = _with_run_json(write_summary(root, s), 3, seed=seed, credit=credit)
                run = json.loads(path.parent.joinpath("run.json").read_text())
                run["identity"]["prepare_seed"] = p
                path.parent.joinpath("run.json").write_text(json.dumps(run))

    draw(tmp_path / "old", 0)
    main([str(tmp_path / "old"), "--out", str(tmp_path / "old_table")])
    shutil.rmtree(tmp_path / "old")  # only the table of draw 0 is left
    for p in (1, 2):
        draw(tmp_path / "new", p)
    capsys.readouterr()
    main([str(tmp_path / "new"), "--out", str(tmp_path / "split")])  # without --pool: one setting per draw
    assert "are split into 2 settings: [prepare_seed=1] 6 run(s); [prepare_seed=2] 6 run(s)" in capsys.readouterr().err
    out = tmp_path / "pooled"
    main([str(tmp_path / "new"), "--runs-csv", str(tmp_path / "old_table" / "runs.csv"), "--pool", "prepare_seed",
          "--out", str(out)])
    err = capsys.readouterr().err
    assert "6 run(s) read from a runs.csv were given the config of the run directories" in err
    assert "split" not in err
    report = json.loads((out / "report.json").read_text())
    rows = {(r["setting"], r["scheme"]): r for r in report["rows"]}
    assert rows[("keywords / tiny_gpt2", "datc")]["n_runs"] == 9
    assert len((out / "runs.csv").read_text().splitlines()) == 1 + 18
    # paired by seed over the 9 seeds: datc is grpo + 0.05 in every pair
    assert "+0.050 ± 0.000" in table_row((out / "table.md").read_text(), "keywords / tiny_gpt2", "datc")[DGOLD_COL]
    # a table alone (no directories): compared by data, policy and steps
    main(["--runs-csv", str(tmp_path / "old_table" / "runs.csv"), "--out", str(tmp_path / "alone")])
    assert "matched no single config" in capsys.readouterr().err


def test_a_verdict_says_beat_or_lost_to_only_where_its_interval_excludes_zero():
    from datc.report.statistics import Interval, PairedDifference, Verdict

    def verdict(mean, hw, n):
        return Verdict("keywords / tiny_gpt2", "datc", "grpo", True, True, PairedDifference(Interval(mean, hw, n), tuple(range(n))))

    assert "DATC beat GRPO" not in verdict(0.0004, 0.012, 6).sentence  # the +0.000 ± 0.012 that was called a win
    assert "is not resolved" in verdict(0.0004, 0.012, 6).sentence and "over 6 shared seeds" in verdict(0.0004, 0.012, 6).sentence
    assert "DATC lost to GRPO" in verdict(-0.2, 0.1, 4).sentence
    assert "DATC beat GRPO" in verdict(0.2, 0.1, 4).sentence
    one = verdict(0.3, None, 1).sentence
    assert "is not resolved" in one and "one pair gives no interval" in one


def test_a_cell_of_fewer_than_three_values_shows_its_mean_and_n_not_an_interval():
    from datc.report.statistics import Interval
    from datc.report.tables import _interval_text

    assert _interval_text(Interval(2.670, 15.225, 2), 2) == "2.670 (n=2)"  # the step time that read 2.670 ± 15.225
    assert _interval_text(Interval(2.670, 0.5, 3), 3) == "2.670 ± 0.500"
    assert _interval_text(Interval(0.1, 0.05, 3), 4, signed=True) == "+0.100 ± 0.050 (n=3)"


# ---- --out spelled as a link or as the working directory; a full disk; Ctrl-C -------------------


def _outputs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.name.startswith(".")}


def _leftovers(*dirs: Path) -> list[str]:
    """Temporary or lock files a comparison left in ``dirs`` (the beside-lock ``.<name>.lock`` of a
    swapped folder excepted)."""
    return sorted(p.name for d in dirs for p in d.iterdir()
                  if p.name.startswith(".") and (p.name.endswith((".tmp", ".old")) or p.name == "..lock"))


def test_out_a_symlink_is_written_through_and_the_link_stays(runs_root, tmp_path, capsys):
    # Before: the swap replaced the user's link with a local folder and ended in an OSError; the
    # next comparison then wrote locally without a word.
    from datc.compare import main

    real = tmp_path / "elsewhere" / "compare"
    real.mkdir(parents=True)
    (real / "README.md").write_text("kept\n")
    link = tmp_path / "link"
    link.symlink_to(real)
    for _ in range(2):
        main([str(runs_root), "--out", str(link)])
        assert link.is_symlink() and os.readlink(link) == str(real)
        assert set(OUTPUTS) <= set(_outputs(real)) and (real / "README.md").read_text() == "kept\n"
    assert str(link / "table.md") in capsys.readouterr().out  # the paths as the user gave them
    assert _leftovers(tmp_path, real.parent, real) == []
    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "nowhere" / "x")
    with pytest.raises(SystemExit) as e:
        main([str(runs_root), "--out", str(broken)])
    assert e.value.code == 2 and "a broken symbolic link" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()


def test_out_the_working_directory_is_written_in_place(runs_root, tmp_path, monkeypatch):
    # Before: `--out .` ended in OSError EBUSY (a rename of ".") and left a "..lock" file.
    from datc.compare import main

    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine\n")
    monkeypatch.chdir(here)
    inode = os.stat(".").st_ino
    main([str(runs_root), "--out", "."])
    assert set(OUTPUTS) <= set(_outputs(here)) and (here / "notes.txt").read_text() == "mine\n"
    assert os.stat(".").st_ino == inode and Path.cwd() == here  # the shell's folder is not swapped away
    assert _leftovers(tmp_path, here) == [] and not (tmp_path / "..lock").exists()
    sub = here / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    main([str(runs_root), "--out", ".."])  # a folder above the working directory: in place too
    assert os.stat(".").st_ino == os.stat(sub).st_ino and sub.exists()


@pytest.mark.parametrize("where", ["beside", "in place"])
def test_a_full_disk_is_one_line_and_keeps_the_earlier_outputs(runs_root, tmp_path, monkeypatch, capsys, where):
    # Before: an OSError traceback (its temporary folder was removed).
    import errno

    import datc.report.cli as cli
    from datc.compare import main

    out = tmp_path / "out"
    main([str(runs_root), "--out", str(out)])
    if where == "in place":
        monkeypatch.chdir(out)
    before = _outputs(out)
    other = tmp_path / "other"
    write_summary(other, summary("reviews", "smollm2", "grpo", 0, 0.5))

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cli, "write_atomic", full_disk)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(other), "--out", "." if where == "in place" else str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "Traceback" not in "".join(err)
    assert err[-1].startswith("datc-compare: --out ") and "no space left on device" in err[-1], err
    assert _outputs(out) == before
    assert _leftovers(tmp_path, out) == [] and not [p for p in out.iterdir() if p.is_dir()]


def test_ctrl_c_is_one_line_exit_130_and_the_outputs_stay_whole(runs_root, tmp_path, monkeypatch, capsys):
    # Before: a bare KeyboardInterrupt traceback.
    import signal

    import datc.report.cli as cli
    from datc.compare import main

    handler = signal.getsignal(signal.SIGINT)  # the default, or SIG_IGN where the suite runs in a background job
    out = tmp_path / "out"
    main([str(runs_root), "--out", str(out)])
    before = _outputs(out)
    other = tmp_path / "other"
    write_summary(other, summary("reviews", "smollm2", "grpo", 0, 0.5))
    real_write, real_exchange = cli.write_atomic, cli._exchange

    def ctrl_c_half_way(path, data):
        if path.name == "runs.csv":
            raise KeyboardInterrupt
        real_write(path, data)

    monkeypatch.setattr(cli, "write_atomic", ctrl_c_half_way)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(other), "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("datc-compare: interrupted (SIGINT); nothing was written "
                                            "(what --out held is as it was)")
    assert _outputs(out) == before and _leftovers(tmp_path, out) == []

    def ctrl_c_in_the_swap(a, b):  # SIGINT arrives while the new outputs are being put in place
        os.kill(os.getpid(), signal.SIGINT)
        return real_exchange(a, b)

    monkeypatch.setattr(cli, "write_atomic", real_write)
    monkeypatch.setattr(cli, "_exchange", ctrl_c_in_the_swap)
    with pytest.raises(SystemExit) as e:
        main([str(other), "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "the outputs had just been written, whole" in err
    assert "reviews" in (out / "table.md").read_text() and "reviews" in (out / "runs.csv").read_text()
    assert set(OUTPUTS) <= set(_outputs(out)) and _leftovers(tmp_path, out) == []
    assert signal.getsignal(signal.SIGINT) == handler  # restored


def _with_cadence(summary_path: Path, seed: int, credit: str, **trainer) -> Path:
    path = _with_run_json(summary_path, 100, seed=seed, credit=credit)
    run = json.loads(path.parent.joinpath("run.json").read_text())
    run["identity"]["trainer"].update(trainer)
    path.parent.joinpath("run.json").write_text(json.dumps(run))
    return path


def test_checkpoint_and_eval_cadence_do_not_split_a_setting(tmp_path, capsys):
    # Before: runs differing only in trainer.checkpoint_every or trainer.eval_every were split
    # into settings of their own, so identical training never paired.
    from datc.compare import main

    root = tmp_path / "runs"
    for seed in (0, 1, 2):
        g = summary("keywords", "tiny_gpt2", "grpo", seed, 0.1 + 0.1 * seed)
        _with_cadence(write_summary(root, g), seed, "grpo", checkpoint_every=20, eval_every=50, keep_checkpoints=2)
        d = summary("keywords", "tiny_gpt2", "datc", seed, 0.2 + 0.1 * seed)
        d["eval"]["curve"] = [{"step": s, "gold": 0.0 if s < 100 else 0.2 + 0.1 * seed, "rm_score": 0.0}
                              for s in (0, 25, 50, 75, 100)]  # evaluated twice as often
        _with_cadence(write_summary(root, d), seed, "datc", checkpoint_every=5, eval_every=25, keep_checkpoints=9)
    out = tmp_path / "out"
    main([str(root), "--out", str(out)])
    err = capsys.readouterr().err
    assert "split" not in err
    assert "compared keywords / tiny_gpt2: datc (seeds 0, 1, 2), grpo (seeds 0, 1, 2)" in err
    assert ("keywords / tiny_gpt2: runs evaluated at different steps (another trainer.eval_every): gold AUC and the "
            "curves are taken over the 3 step(s) all of them evaluated (0, 50, 100)") in err
    rows = {r["scheme"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    assert rows["datc"]["n_runs"] == 3 and rows["grpo"]["n_runs"] == 3
    row = table_row((out / "table.md").read_text(), "keywords / tiny_gpt2", "datc")
    assert "+0.100 ± 0.000" in row[DGOLD_COL]  # paired by seed: datc is grpo + 0.1 on each
    # over the shared steps 0, 50, 100: datc's AUC is (0 + 0 + 0 + g) / 4 = g / 4 with its own 25-step
    # points left out; grpo's curve rises linearly to g, AUC g / 2
    datc_auc = [(0.2 + 0.1 * s) / 4 for s in (0, 1, 2)]
    assert row[AUC_COL].strip("*").startswith(f"{sum(datc_auc) / 3:.3f} ± ")


def test_a_scheme_added_in_code_gets_its_sentence_style_and_curves(tmp_path):
    # The scheme guide's promise (one .py + one .yaml + one test): a scheme registered in-process,
    # beside every built-in one, runs through the report and its plots with no other edit.
    from datc.credit import CREDIT_SCHEMES, credit_scheme
    from datc.credit.configs import credit_labels
    from datc.report.plots import _styles

    new = "zz_added_in_code"
    CREDIT_SCHEMES.register(new)(credit_scheme(new)(lambda batch, params: batch.response_mask.float()))
    try:
        labels = credit_labels()
        assert new in labels and len(labels) >= 17
        root = tmp_path / "runs"
        for i, s in enumerate(labels):
            for seed in range(3):
                write_summary(root, summary("keywords", "tiny_gpt2", s, seed, 0.1 + 0.01 * seed + (0.3 if s == new else 0.001 * i)))
        out = tmp_path / "out"
        report = build_report(load_run_dirs([root]).runs, "grpo")
        write_outputs(report, out)
        text = (out / "summary.md").read_text()
        assert f"{new.upper()} beat GRPO" in text and "cannot be compared" not in text
        assert sum(ln.startswith("- On keywords / tiny_gpt2") for ln in text.splitlines()) == len(labels) - 1
        styles = {s: (tuple(st["color"]), st["marker"], st["linestyle"]) for s, st in _styles(report).items()}
        assert len(set(styles.values())) == len(labels)
        for name in PLOTS:
            assert (out / name).stat().st_size > 1000
    finally:
        CREDIT_SCHEMES._items.pop(new, None)
