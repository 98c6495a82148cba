"""scripts/tuned_sweep.py sets the setting's policy and data as the experiment allows: through the
experiment's own sweep lists where it has them (four_settings), by plain overrides where it has
none (real_smollm2, whose ``hydra.sweeper.params`` is empty: setting a key below it failed in
Hydra's override step before any run started)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from datc.paths import CONFIG_DIR
from datc.study.reading import MANIFEST
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


def test_the_evaluation_runs_tuned_pairs_seed_by_seed_then_the_defaults_and_lanes_share_the_seeds(tmp_path):
    # tests/test_tuning.py's hand-made sweep: grpo chose its default, datc x2 with tau 0.5
    from scripts.tuned_sweep import lane, stage_commands
    from tests.test_tuning import EVAL, LR, sweep

    folder = sweep(tmp_path / "runs")
    m = {**json.loads((folder / MANIFEST).read_text()), "experiment": "four_settings", "overrides": []}

    def at(cmds):
        return [[o for o in c if o.startswith(("seed=", "prepare_seed=", "credit=", "trainer.lr="))] for c in cmds]

    order = [(d, s) for d, ss in EVAL.items() for s in ss]
    expected = []
    for d, s in order:  # every scheme's chosen configuration at a seed before the next seed
        expected += [["credit=grpo", f"prepare_seed={d}", f"seed={s}"],
                     ["credit=datc", f"trainer.lr={2 * LR!r}", f"prepare_seed={d}", f"seed={s}"]]
    expected += [["credit=datc", f"prepare_seed={d}", f"seed={s}"] for d, s in order]  # datc's default after
    assert at(stage_commands("eval", m, folder, ["grpo", "datc"])) == expected

    lanes = [at(stage_commands("eval", m, folder, ["grpo", "datc"], (k, 2))) for k in (0, 1)]
    assert sorted(map(tuple, lanes[0] + lanes[1])) == sorted(map(tuple, expected))  # the lanes split the runs
    seeds_of = [{c[-1] for c in cmds} for cmds in lanes]
    assert not seeds_of[0] & seeds_of[1] and seeds_of[0] == {f"seed={s}" for _, s in order[0::2]}
    assert lane("1/2") == (1, 2)
    for bad in ("2/2", "x/2", "1"):
        with pytest.raises(argparse.ArgumentTypeError):
            lane(bad)


def test_lanes_are_refused_where_they_would_run_a_run_twice_or_nothing(tmp_path, capsys):
    from scripts.tuned_sweep import main

    base = ["--policy", "tiny_gpt2", "--data", "keywords", "--schemes", "grpo", "--root", str(tmp_path), "--dry-run"]
    assert main([*base, "--stage", "lr", "--lane", "0/2"]) == 2
    assert "it is for --stage eval or kl, not lr" in capsys.readouterr().err
    assert main([*base, "--stage", "all", "--lane", "1/2"]) == 2
    assert main([*base, "--stage", "eval", "--lane", "0/7"]) == 2  # 6 evaluation seeds by default
    assert "more lanes than the 6 evaluation seeds" in capsys.readouterr().err
    assert main([*base, "--stage", "eval", "--lane", "1/2"]) == 0


def test_finished_runs_lose_their_checkpoints_and_unfinished_ones_keep_them(tmp_path):
    from scripts.tuned_sweep import prune_checkpoints

    for stage, name, done in (("select", "a", True), ("eval", "b", True), ("eval", "c", False), ("matched", "d", True)):
        run = tmp_path / stage / name
        (run / "checkpoints" / "step_0000004").mkdir(parents=True)
        (run / "final").mkdir()
        if done:
            (run / "summary.json").write_text("{}")
    assert prune_checkpoints(tmp_path) == 3
    assert [p.parent.name for p in sorted(tmp_path.glob("*/*/checkpoints"))] == ["c"]  # the unfinished run resumes from it
    assert len(list(tmp_path.glob("*/*/final"))) == 4 and prune_checkpoints(tmp_path) == 0


def test_pruning_beside_another_lane_ignores_files_that_lane_removed_first(tmp_path, monkeypatch):
    """Two lanes prune the same folder after their runs: a checkpoint file the other lane removed
    between the listing and the unlink is no error (a lane crashed on it); other errors still raise."""
    import os

    from scripts.tuned_sweep import prune_checkpoints

    run = tmp_path / "eval" / "a"
    (run / "checkpoints" / "step_0000008").mkdir(parents=True)
    (run / "checkpoints" / "step_0000008" / "model.pt").write_text("x")
    (run / "summary.json").write_text("{}")
    real = os.unlink

    def raced(path, *a, **kw):  # the other lane got there first: the file is gone, this unlink fails
        real(path, *a, **kw)
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(os, "unlink", raced)
    assert prune_checkpoints(tmp_path) == 1 and not (run / "checkpoints").exists()

    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "f").write_text("x")
    monkeypatch.setattr(os, "unlink", lambda *a, **kw: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with pytest.raises(PermissionError):
        prune_checkpoints(tmp_path)


def test_a_kl_lane_with_nothing_to_run_waits_and_looks_again(tmp_path, monkeypatch, capsys):
    """--stage kl: a lane whose share of the round is done (or that waits for lane 0's next rate)
    sleeps and asks again, saying once what it waits for; it ends when nothing is left."""
    import scripts.tuned_sweep as ts

    answers = iter([ts.KlRound([], "datc: lane 0's next grpo rate")] * 3 + [ts.KlRound([], None)])
    monkeypatch.setattr(ts, "kl_round", lambda *a, **k: next(answers))
    slept = []
    monkeypatch.setattr(ts.time, "sleep", slept.append)
    base = ["--policy", "tiny_gpt2", "--data", "keywords", "--schemes", "grpo,datc", "--root", str(tmp_path)]
    assert ts.main([*base, "--stage", "kl", "--lane", "1/2"]) == 0
    assert slept == [ts.POLL_S] * 3
    assert capsys.readouterr().out.count("lane 1/2: waiting for datc: lane 0's next grpo rate") == 1


def test_runs_that_sample_with_vllm_each_get_a_process_and_name_the_same_run_directory(tmp_path, capsys):
    # vLLM's engine leaves memory behind in its process at every job (about 0.1 GB at the real
    # scale, measured with every object of the run collected), so where the runs use it each job of
    # a grid runs as a `datc-train -m` of its own: one value per swept key, the rest unchanged.
    from scripts.tuned_sweep import main, split_jobs

    grid = ["experiment=four_settings", "credit=grpo,oracle", "trainer.lr=0.0001,0.0002", "seed=100,101",
            "trainer.adam_betas=[0.9,0.99]", "run_name=${data.name}-s${seed}"]
    jobs = split_jobs(grid)
    assert len(jobs) == 8 and len({tuple(j) for j in jobs}) == 8
    assert {(j[1], j[2], j[3]) for j in jobs} == {(f"credit={c}", f"trainer.lr={lr}", f"seed={s}") for c in ("grpo", "oracle")
                                                  for lr in ("0.0001", "0.0002") for s in ("100", "101")}
    assert all(j[0] == grid[0] and j[4] == grid[4] for j in jobs)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):  # Hydra's escaped interpolation: the same run name
        cfg = compose(config_name="train", overrides=[jobs[0][5], "seed=100"])
    assert cfg.run_name == "keywords-s100"

    base = ["--policy", "tiny_gpt2", "--data", "keywords", "--schemes", "grpo,oracle", "--root", str(tmp_path),
            "--stage", "lr", "--dry-run"]
    for extra, runs in ([[], 1], [["rollout=vllm"], 12], [["--process-per-job", "yes"], 12], [["--process-per-job", "no", "rollout=vllm"], 1]):
        assert main([*base, *extra]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("datc-train -m ")]
        assert len(lines) == runs, (extra, lines)  # 2 schemes x 3 rates x 2 selection seeds, or one grid (the schemes share it)
