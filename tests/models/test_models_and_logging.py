"""Real-model code paths on local copies, offline behaviour, W&B offline and W&B failures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from datc.models.build import ModelLoadError, build_causal_lm, build_reward_model, load_pretrained
from datc.training.trainer import train
from tests.helpers.testbed import ARCHS, cfg_for


def test_hub_id_offline_fails_fast_and_says_how_to_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(ModelLoadError) as e:
        load_pretrained("causal_lm", "no-such-org/no-such-model", "policy.path")
    assert time.time() - t0 < 30
    msg = str(e.value)
    assert "policy.path" in msg and "local" in msg and "no-such-org/no-such-model" in msg


def test_reward_model_with_two_outputs_is_refused(tmp_path, tok):
    from transformers import AutoModelForSequenceClassification

    from datc.models.build import _model_config

    rm = AutoModelForSequenceClassification.from_config(_model_config(ARCHS["gpt2"], tok, num_labels=2))
    rm.save_pretrained(tmp_path / "rm2")
    with pytest.raises(ModelLoadError, match="exactly one"):
        load_pretrained("reward", str(tmp_path / "rm2"), "reward.path")


@pytest.mark.slow
def test_pretrained_paths_train_through_the_same_code(tmp_path, tok):
    # Local copies of a policy and a reward model, loaded by path as a hub model would be.
    pol, rm = build_causal_lm(ARCHS["llama"], tok, 0), build_reward_model(ARCHS["llama"], tok, 1)
    for model, name in ((pol, "policy"), (rm, "reward")):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    summary = train(cfg_for(tmp_path / "cache", tmp_path / "run", "policy=pretrained", f"policy.path={tmp_path}/policy",
                            "reward=pretrained", f"reward.path={tmp_path}/reward", "credit=datc"))
    assert summary["eval"]["final"]["eval/rm_score"] is not None
    assert not (tmp_path / "cache" / "policy").exists()  # nothing was warm-started: the given model was used
    # datc-export of the last checkpoint, from the given model's own architecture and tokenizer (no cache)
    import torch
    from transformers import AutoModelForCausalLM

    from datc.commands.export import export_checkpoint

    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(tmp_path / "run")).eval()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").eval()
    ids = torch.randint(4, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, final(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_mismatched_tokenizers_are_refused(tmp_path, tok):
    from transformers import AutoTokenizer

    pol = build_causal_lm(ARCHS["gpt2"], tok, 0)
    pol.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    rm = build_reward_model(ARCHS["gpt2"], tok, 0)
    rm.save_pretrained(tmp_path / "reward")
    other = AutoTokenizer.from_pretrained(tmp_path / "policy")
    other.add_tokens(["brand_new_token"])
    other.save_pretrained(tmp_path / "reward")
    from datc.config import ConfigError

    with pytest.raises(ConfigError, match="different token ids"):
        train(cfg_for(tmp_path / "cache", tmp_path / "run", "policy=pretrained", f"policy.path={tmp_path}/policy",
                      "reward=pretrained", f"reward.path={tmp_path}/reward"))


@pytest.mark.slow
def test_wandb_offline_run_writes_locally(cache_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    run = tmp_path / "run"
    train(cfg_for(cache_dir, run, "logger=wandb"))
    assert list((run / "wandb").glob("offline-run-*")), "no offline W&B run was written"
    assert (run / "summary.json").exists()


@pytest.mark.slow
def test_an_unreachable_wandb_server_is_one_line_and_the_run_logs_offline(cache_dir, tmp_path, monkeypatch, capsys):
    # A key, mode=online, and a server address nothing listens on (the real wandb.init: it
    # retries until init_timeout, then raises CommError): the run goes on offline under its own
    # run id, so `wandb sync` uploads it later; the start waits about the timeout, not W&B's 90 s.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    run = tmp_path / "run"
    start = time.monotonic()
    train(cfg_for(cache_dir, run, "logger=wandb", "logger.mode=online", "logger.init_timeout_s=1"))
    took = time.monotonic() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("W&B")]
    assert len(lines) == 1 and "the server did not answer within 1 s" in lines[0] and "logging offline" in lines[0], err[-2000:]
    assert "W&B logging failed" not in err
    run_id = json.loads((run / "run.json").read_text())["wandb_id"]
    assert list((run / "wandb").glob(f"offline-run-*-{run_id}")), sorted(p.name for p in (run / "wandb").iterdir())
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl") if "loss/total" in x] == [1, 2, 3]
    assert took < 80, took  # W&B's default init_timeout alone is 90 s


@pytest.mark.slow
def test_wandb_failure_mid_run_is_reported_once_and_training_goes_on(cache_dir, tmp_path, monkeypatch, capsys):
    import wandb

    monkeypatch.setenv("HOME", str(tmp_path))
    real_init = wandb.init

    def flaky_init(*args, **kwargs):
        run = real_init(*args, **{**kwargs, "mode": "offline"})

        def broken_log(*a, **k):
            raise ConnectionError("W&B is down")

        run.log = broken_log
        return run

    monkeypatch.setattr(wandb, "init", flaky_init)
    run = tmp_path / "run"
    summary = train(cfg_for(cache_dir, run, "logger=wandb"))
    err = capsys.readouterr().err
    assert err.count("W&B logging failed") == 1
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss/total" in r] == [1, 2, 3]  # every step still logged locally
    assert summary["eval"]["final"]


@pytest.mark.slow
def test_multirun_sweep_writes_one_directory_per_job(finished_sweep):
    # the session's sweep (tests/conftest.py): `datc-train -m seed=0,1 credit=grpo,datc`
    done = sorted(p.parent.name for p in finished_sweep.dir.glob("*/summary.json"))
    # readable parts, then the config hash (datc.run.naming): one per job, as the jobs' configs differ
    assert [n.rsplit("-", 1)[0] for n in done] == ["keywords-tiny_gpt2-datc-s0", "keywords-tiny_gpt2-datc-s1",
                                                   "keywords-tiny_gpt2-grpo-s0", "keywords-tiny_gpt2-grpo-s1"]
    assert len({n.rsplit("-", 1)[1] for n in done}) == 4


@pytest.mark.slow
def test_datc_prepare_fills_the_cache_without_training(tmp_path):
    import shutil

    exe = shutil.which("datc-prepare", path=os.path.dirname(sys.executable))
    assert exe, "the datc-prepare console script is not installed"
    r = subprocess.run([exe, "debug=fast", "trainer.progress=true", f"cache_dir={tmp_path}/cache"], capture_output=True,
                       text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    # Progress of the long steps: a bar each, with steps done, loss and time left (tqdm).
    for bar, steps in (("prepare: warm start", 20), ("prepare: reward model", 20)):
        assert re.search(rf"{bar}: 100%\S* {steps}/{steps} \[\d\d:\d\d<00:00, .*loss=\d", r.stderr), (bar, r.stderr[-1500:])
    assert "prepare: reward-model samples: 100%" in r.stderr
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert os.path.isdir(out["policy"]) and os.path.isdir(out["reward"])
    assert "heldout_within_group_corr" in out["rm_report"]
    assert not (tmp_path / "runs").exists()  # nothing was trained


@pytest.mark.parametrize("content,field", [("", "data.path"), ('{"prompt": "write about food :"}\n{bad json\n', "data.path"),
                                           ('{"text": "write about food :"}\n', "data.prompt_field")])
def test_empty_or_malformed_data_files_are_clear_config_errors(tmp_path, content, field):
    from datc.config import ConfigError, DataConfig
    from datc.data.prompts import load_prompts

    f = tmp_path / "prompts.jsonl"
    f.write_text(content)
    with pytest.raises(ConfigError) as e:
        load_prompts(DataConfig(task=None, path=str(f), eval_split="train"), str(tmp_path / "cache"))
    assert str(e.value).startswith(field)


@pytest.mark.slow
def test_wandb_unavailable_at_start_is_reported_once_and_training_goes_on(cache_dir, tmp_path, monkeypatch, capsys):
    import wandb

    def refuse(*args, **kwargs):
        raise ConnectionError("W&B is unreachable")

    monkeypatch.setattr(wandb, "init", refuse)
    run = tmp_path / "run"
    train(cfg_for(cache_dir, run, "logger=wandb"))
    assert capsys.readouterr().err.count("W&B logging failed") == 1
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl") if "loss/total" in x] == [1, 2, 3]


def test_the_trained_policy_is_float32_from_a_bf16_checkpoint(tmp_path, tok):
    # transformers >= 5 loads a checkpoint in its stored dtype when none is given: the hub's 1-2B
    # checkpoints are bf16, and a bf16 policy's AdamW steps at lr 1e-6 round away. The trainer
    # asks for float32 master weights (autocast computes in bf16 on GPUs).
    import torch

    from datc.checks import validate
    from datc.prepare.assets import ensure_assets
    from datc.training.model_set import load_models

    for model, name in ((build_causal_lm(ARCHS["llama"], tok, 0), "policy"), (build_reward_model(ARCHS["llama"], tok, 1), "reward")):
        model.to(torch.bfloat16).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    c = validate(cfg_for(tmp_path / "cache", tmp_path / "run", "policy=pretrained", f"policy.path={tmp_path}/policy",
                         "reward=pretrained", f"reward.path={tmp_path}/reward"))
    m = load_models(c, ensure_assets(c), torch.device("cpu"))
    assert {p.dtype for p in m.policy.parameters()} == {torch.float32}


def test_a_prepare_says_why_no_cached_warm_start_serves_the_run(tmp_path):
    # said up front: a setting the cache was not made with (policy.arch.n_head=2 for vLLM's CPU
    # attention) starts a whole new prepare
    from datc.prepare.assets import not_cached_because

    folder = tmp_path / "cache" / "policy"
    key = {"v": 2, "arch": {"n_head": 4, "n_layer": 2}, "ws": {"steps": 600}, "T": 16}
    assert not_cached_because(folder, "tiny_gpt2-keywords-", key) == f"no warm start of tiny_gpt2-keywords is cached in {folder.parent} yet"
    made = folder / "tiny_gpt2-keywords-abc"
    made.mkdir(parents=True)
    (made / "warm_start.json").write_text(json.dumps({"key": {**key, "arch": {"n_head": 2, "n_layer": 2}}}))
    (folder / "tiny_llama-keywords-def").mkdir()  # another policy's: not compared
    assert not_cached_because(folder, "tiny_gpt2-keywords-", key) == (
        "the cached warm start of tiny_gpt2-keywords was made with other settings (policy.arch.n_head differs)")
    assert not_cached_because(folder, "tiny_gpt2-keywords-", {**key, "T": 8}).endswith(
        "(trainer.max_new_tokens, policy.arch.n_head differ)")
