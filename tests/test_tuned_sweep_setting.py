"""scripts/tuned_sweep.py sets the setting's policy and data as the experiment allows: through the
experiment's own sweep lists where it has them (four_settings), by plain overrides where it has
none (real_smollm2, whose ``hydra.sweeper.params`` is empty: setting a key below it failed in
Hydra's override step before any run started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from datc.paths import CONFIG_DIR
from datc.report.tuning import MANIFEST
from scripts.tuned_sweep import _base, swept_groups


@pytest.mark.parametrize("experiment, policy, data, swept", [
    ("four_settings", "tiny_llama", "arithmetic", True),
    ("real_smollm2", "smollm2_135m_instruct", "reviews", False),
])
def test_the_setting_composes_with_hydra(experiment, policy, data, swept, tmp_path):
    assert bool(swept_groups(experiment)) is swept
    m = {"setting": {"policy": policy, "data": data}, "experiment": experiment, "overrides": ["trainer.threads=1"]}
    overrides = [o for o in _base(m, tmp_path, "select") if not o.startswith("run_name=")]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*overrides, "credit=grpo"], return_hydra_config=True)
        if swept:  # the experiment's lists replaced by the setting's one value
            assert dict(cfg.hydra.sweeper.params) == {"policy": policy, "data": data}
        else:
            assert (cfg.policy.name, cfg.data.name) == ("smollm2_135m", "reviews")
            with pytest.raises(Exception, match="Unexpected type for root"):  # what the old overrides hit
                compose(config_name="train", overrides=[f"experiment={experiment}", f"hydra.sweeper.params.policy={policy}"],
                        return_hydra_config=True)
    assert Path(cfg.hydra.sweep.dir) == tmp_path / "select"


def test_the_evaluation_runs_seed_by_seed_so_a_cut_batch_leaves_whole_pairs(tmp_path):
    # tests/test_tuning.py's hand-made sweep: grpo chose its default, datc x2 with tau 0.5
    from scripts.tuned_sweep import stage_commands
    from tests.test_tuning import EVAL, sweep

    folder = sweep(tmp_path / "runs")
    m = {**json.loads((folder / MANIFEST).read_text()), "experiment": "four_settings", "overrides": []}
    cmds = stage_commands("eval", m, folder, ["grpo", "datc"])
    at = [[o for o in c if o.startswith(("seed=", "prepare_seed=", "credit="))] for c in cmds]
    expected = []
    for draw, seeds in EVAL.items():
        for s in seeds:  # every scheme at a seed (the defaults, then datc's tuned one) before the next seed
            expected += [["credit=grpo,datc", f"prepare_seed={draw}", f"seed={s}"], ["credit=datc", f"prepare_seed={draw}", f"seed={s}"]]
    assert at == expected
