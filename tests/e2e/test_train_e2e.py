"""End-to-end runs on the tiny testbed: training changes every parameter, writes its files,
resumes after a kill exactly, and refuses to overwrite another run."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from datc.checks import validate
from datc.config import ConfigError
from datc.models.build import load_pretrained
from datc.prepare.assets import ensure_assets
from datc.run.checkpoint import latest_checkpoint, load_checkpoint
from datc.training.trainer import train
from tests.helpers import cli
from tests.helpers.runs import comparable, kill_at_checkpoint, metric_rows
from tests.helpers.testbed import cfg_for, train_cmd

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow




@pytest.mark.parametrize("policy", ["tiny_gpt2", "tiny_llama"])
def test_training_changes_every_parameter_and_writes_its_files(cache_dir, tmp_path, policy):
    run_dir = tmp_path / "run"
    cfg = cfg_for(cache_dir, run_dir, f"policy={policy}", "credit=datc")
    summary = train(cfg)
    # Every trainable parameter moved away from the warm start (the run's own: the session's cache
    # holds other configs' draws too).
    warm = load_pretrained("causal_lm", ensure_assets(validate(cfg)).policy_path, "policy.path")
    final = load_checkpoint(latest_checkpoint(run_dir))["policy"]
    unchanged = [n for n, p in warm.named_parameters() if p.requires_grad and torch.equal(p, final[n])]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    for name in ("metrics.jsonl", "summary.json", "config.yaml", "run.json"):
        assert (run_dir / name).exists(), name
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows if "eval/gold" in r] == [0, 2, 3]
    assert all(math.isfinite(r["eval/gold"]) for r in rows if "eval/gold" in r)
    assert math.isfinite(summary["eval"]["final"]["eval/gold"])
    assert all(k.split("/")[0] in {"reward", "rollout", "loss", "credit", "perf", "eval", "step"} for r in rows for k in r)


def test_same_command_gives_same_metrics(tmp_path):
    # The first run fills an empty cache (the prepare step draws random numbers), the second
    # finds it full: the runs must still be identical.
    a = train(cfg_for(tmp_path / "cache", tmp_path / "a"))
    b = train(cfg_for(tmp_path / "cache", tmp_path / "b"))
    assert comparable(metric_rows(tmp_path / "a")) == comparable(metric_rows(tmp_path / "b"))
    assert a["eval"]["final"] == b["eval"]["final"]
    # The cold run is the numerics' fingerprint (scripts/results/numerics_fingerprint.py): the code under
    # test computes what the code of the committed demo figure computed, or the figure is stale.
    from scripts.results.numerics_fingerprint import differences, fingerprint

    made = json.loads((ROOT / "results" / "demo" / "numerics.json").read_text())
    diff = differences(fingerprint(tmp_path / "a" / "metrics.jsonl"), made["fingerprint"])
    assert not diff, (f"the numerics changed since the demo figure in results/demo/ was made (commit {made['commit'][:7]}): "
                      f"run `make demo-results` and commit its figures, README lines included; {diff[:4]}")


def test_a_finished_run_leaves_none_of_its_models_behind(cache_dir, tmp_path, monkeypatch):
    # A sweep's jobs run one after another in one process (datc-train -m): every model of a run
    # must be gone when it returns, or each job adds its models to the next one's memory.
    import weakref

    import datc.training.trainer as trainer

    made, build = [], trainer.build_session

    def spy(*args, **kwargs):
        s = build(*args, **kwargs)
        made.extend((name, weakref.ref(x)) for name, x in
                    [("session", s), ("policy", s.m.policy), ("ref", s.m.ref), ("reward model", s.m.rm), ("engine", s.engine)])
        return s

    monkeypatch.setattr(trainer, "build_session", spy)
    train(cfg_for(cache_dir, tmp_path / "run", "trainer.steps=2"))
    assert len(made) == 5 and [name for name, r in made if r() is not None] == []


def test_killed_run_resumes_to_the_same_metrics(cache_dir, tmp_path):
    # 6 training prompts, 2 per step: the prompt data's epoch ends every 3 steps, so the resumed
    # part (steps 3 to 6) crosses an epoch boundary; an eval (step 4) falls between checkpoints.
    overrides = ["trainer.steps=6", "trainer.checkpoint_every=2", "trainer.eval_every=4", "data.train_size=6"]
    train(cfg_for(cache_dir, tmp_path / "full", *overrides))

    killed = tmp_path / "killed"
    kill_at_checkpoint(train_cmd(cache_dir, killed, *overrides), killed, 2)

    train(cfg_for(cache_dir, killed, *overrides))  # trainer.resume=auto is the default
    assert comparable(metric_rows(killed)) == comparable(metric_rows(tmp_path / "full"))
    steps = [r["step"] for r in metric_rows(killed) if "loss/total" in r]
    assert steps == list(range(1, 7))  # no step redone or skipped


def test_a_directory_holding_another_run_is_refused(cache_dir, tmp_path):
    train(cfg_for(cache_dir, tmp_path / "r"))
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="holds another run"):
        train(cfg_for(cache_dir, tmp_path / "r", "trainer.lr=1e-3"))
    with pytest.raises(ConfigError, match="already holds this run"):
        train(cfg_for(cache_dir, tmp_path / "r", "trainer.resume=never"))
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


def test_resume_must_without_a_run_is_an_error(cache_dir, tmp_path):
    with pytest.raises(ConfigError, match="resume=must"):
        train(cfg_for(cache_dir, tmp_path / "none", "trainer.resume=must"))


@pytest.mark.parametrize("override,field", [("data.max_prompt_tokens=4", "data.max_prompt_tokens"),
                                            ("trainer.max_new_tokens=40", "trainer.max_new_tokens")])
def test_length_errors_come_before_any_training_and_free_the_run_name(cache_dir, tmp_path, override, field):
    with pytest.raises(ConfigError, match=field):
        train(cfg_for(tmp_path / "fresh_cache", tmp_path / "r", override))
    assert not (tmp_path / "fresh_cache" / "policy").exists()  # nothing was warm-started
    train(cfg_for(cache_dir, tmp_path / "r"))  # the corrected command may use the same run directory


def test_cache_is_hit_through_another_spelling_of_its_path(tmp_path, monkeypatch):
    from datc.checks import validate
    from datc.prepare.assets import ensure_assets

    a = ensure_assets(validate(cfg_for(str(tmp_path / "cache"), tmp_path / "r")))
    monkeypatch.chdir(tmp_path)
    b = ensure_assets(validate(cfg_for("cache", tmp_path / "r")))  # relative spelling, same directory
    assert os.path.samefile(a.policy_path, b.policy_path) and os.path.samefile(a.reward_path, b.reward_path)


def test_a_half_written_checkpoint_is_never_loaded(tmp_path):
    from datc.run.checkpoint import save_checkpoint

    save_checkpoint(tmp_path, 2, {"x": torch.ones(1)}, keep=3)
    # What a kill during the next write can leave: the temporary directory, or (never renamed
    # before complete, but suppose a crash mid-copy by hand) a step directory without its file.
    (tmp_path / "checkpoints" / ".step_0000004.abc.tmp").mkdir()
    (tmp_path / "checkpoints" / ".step_0000004.abc.tmp" / "state.pt").write_bytes(b"torn")
    (tmp_path / "checkpoints" / "step_0000006").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_0000002"
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 2
    save_checkpoint(tmp_path, 8, {"x": torch.ones(1)}, keep=3)  # the next write cleans the leftovers
    assert not list((tmp_path / "checkpoints").glob(".step_*.tmp"))


def test_an_interrupted_sweep_reruns_only_what_is_missing(finished_sweep, tmp_path):
    # a copy of the session's finished sweep (tests/conftest.py), its command run again on the copy
    shutil.copytree(finished_sweep.dir, tmp_path / "sweep")
    cmd, env = [*finished_sweep.cmd, f"hydra.sweep.dir={tmp_path}/sweep"], finished_sweep.env
    [done] = (tmp_path / "sweep").glob("keywords-tiny_gpt2-grpo-s0-*")
    [lost] = (tmp_path / "sweep").glob("keywords-tiny_gpt2-grpo-s1-*")
    kept_mtime = (done / "metrics.jsonl").stat().st_mtime_ns
    # Simulate a sweep killed during its second job, after the first checkpoint.
    (lost / "summary.json").unlink()
    for ckpt in sorted((lost / "checkpoints").iterdir())[1:]:
        shutil.rmtree(ckpt)
    assert cli.run(cmd, timeout=900, env=env).returncode == 0
    assert (done / "metrics.jsonl").stat().st_mtime_ns == kept_mtime  # the finished job was not redone
    assert (lost / "summary.json").exists()
    steps = [r["step"] for r in metric_rows(lost) if "loss/total" in r]
    assert steps == [1, 2, 3]


def test_a_directory_with_foreign_files_is_refused_and_left_alone(cache_dir, tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="files that are not a datc run \\(notes.txt\\)"):
        train(cfg_for(cache_dir, tmp_path / "r"))
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["notes.txt"]


def test_prepare_seed_draws_another_warm_start_and_reward_model(cache_dir):
    from datc.checks import validate
    from datc.prepare.assets import ensure_assets

    a = ensure_assets(validate(cfg_for(cache_dir, "unused")))
    b = ensure_assets(validate(cfg_for(cache_dir, "unused", "prepare_seed=1")))
    again = ensure_assets(validate(cfg_for(cache_dir, "unused")))
    assert (again.policy_path, again.reward_path) == (a.policy_path, a.reward_path)  # the default draw is cached
    assert a.policy_path != b.policy_path and a.reward_path != b.reward_path
    pa, pb = (load_pretrained("causal_lm", x.policy_path, "policy.path") for x in (a, b))
    assert any(not torch.equal(x, y) for x, y in zip(pa.parameters(), pb.parameters(), strict=True))
