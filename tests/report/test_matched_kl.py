"""METHOD §6's matched-KL control as the fixed-grid protocol read it (datc/study/matched.py): the
rate search's proposals on hand-computed points, the report's reading, and the refusal of a
matched run on a selection seed. The bracketing protocol's search: tests/study/."""

from __future__ import annotations

import json
import math

import pytest

from datc.compare import main as compare
from datc.study.matched import MATCHED_DIR, matched_lr, propose_lr
from datc.study.reading import MANIFEST
from tests.helpers.tuning import LR, sweep, write_run


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
    """The sweep of tests/report/test_tuning.py with KLs: grpo's selection points 0.1, 0.2, 0.4 at x0.5, x1,
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


def test_a_matched_run_on_a_selection_seed_is_refused(tmp_path, capsys):
    folder = matched_sweep(tmp_path / "runs")
    write_run(folder / MATCHED_DIR, "grpo", 100, 4 * LR, 0.3)
    with pytest.raises(SystemExit) as e:
        compare(["--tuned", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "matched-KL evaluation run on selection seed 100" in err


