"""The FSDP2 backend (``backend=fsdp2``, :mod:`datc.backends.fsdp2`) on CPU (gloo): two processes
compute the same losses and end with the same policy as one plain process on the same global
batch (``grpo`` and ``datc``, both testbed families, fp32 and bf16, LoRA); a run checkpointed
through ``torch.distributed.checkpoint`` and resumed equals an uninterrupted one, and
``datc-export`` reads its shards; ``datc-launch`` starts it with torchrun. And the checks that
keep one backend per run, said before any model loads."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from datc.commands.launch import build
from tests.helpers.distributed.resume import warm_policy
from tests.helpers.distributed.same_batch import CASES as SAME_BATCH_CASES
from tests.helpers.distributed.same_batch import env, overrides
from tests.helpers.runs import assert_same_metrics

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "distributed" / "same_batch_worker.py"
# The two processes reduce sums (losses, gradients) in another order than one: fp32 rounding. The
# largest gaps measured (3 steps, lr 5e-4): metrics 2.6e-5 relative (datc, tiny_llama), parameters
# 4e-7 (grpo, tiny_gpt2); the tolerances are DeepSpeed's (tests/e2e/test_distributed.py).
LOSS_RTOL, PARAM_ATOL = 1e-4, 1e-5
# bf16 autocast over fp32 master weights: the products are rounded to bf16 alike on both sides,
# then reduced in another order; measured largest parameter gap 7.5e-9. DeepSpeed's bf16
# tolerance (4e-5, under 3% of the steps' 1.5e-3 movement) holds it with room.
PARAM_ATOL_BF16 = 4e-5
CASES = [n for n in SAME_BATCH_CASES if SAME_BATCH_CASES[n][0] == "fsdp2"]  # run in the same-batch launch


@pytest.fixture(scope="module")
def one_rank(prepared_cache, tmp_path_factory):
    """A one-rank FSDP2 run of ``fsdp2-datc-llama-fp32`` at the default ``share_prompts``, in its own
    interpreter (FSDP2 joins a process group, which the test process must not keep)."""
    out = tmp_path_factory.mktemp("fsdp2") / "one_rank.pt"
    spec = out.with_suffix(".json")
    spec.write_text(json.dumps({"one-rank": overrides("fsdp2-datc-llama-fp32", prepared_cache, 2)}))  # backend=fsdp2
    proc = subprocess.run([sys.executable, str(WORKER), str(out), str(spec)], env=env(prepared_cache),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)["one-rank"]


@pytest.mark.slow
def test_one_fsdp2_rank_shares_prompts_outside_the_update_and_matches_one_plain_process(same_batch_runs, one_rank):
    """One FSDP2 rank forwards each prompt once in its no-grad passes but not in the update: the
    update's gradient through a shared prompt's KV cache reached a resharded block ("setStorage:
    ... storage of size 0", on tiny Llama and Qwen3 both) before the backend declared it."""
    plain, fsdp2 = same_batch_runs.one("fsdp2-datc-llama-fp32"), one_rank
    assert (fsdp2["backend"], fsdp2["world_size"], fsdp2["synced"]) == ("fsdp2", 1, False)
    assert fsdp2["share_prompts"] and not fsdp2["share_update_prompts"]
    for a, b in zip(plain["steps"], fsdp2["steps"], strict=True):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=LOSS_RTOL, abs=1e-7), (k, a, b)
    for n, p in plain["params"].items():
        torch.testing.assert_close(fsdp2["params"][n], p, atol=PARAM_ATOL, rtol=0, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_two_fsdp2_processes_match_one_on_the_same_global_batch(same_batch_runs, name):
    one, two = same_batch_runs.one(name), same_batch_runs.two(name)
    assert (one["backend"], one["world_size"], two["backend"], two["world_size"]) == ("plain", 1, "fsdp2", 2)
    # the plan the backend declared: collective forwards, whole prompts, parameters unsharded once per sampling call
    assert two["synced"] and two["gather_generation"] and not two["share_prompts"] and not one["share_prompts"]
    for a, b in zip(one["steps"], two["steps"], strict=True):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=LOSS_RTOL, abs=1e-7), (k, a, b)
    assert one["params"].keys() == two["params"].keys()
    atol = PARAM_ATOL_BF16 if "bf16" in name else PARAM_ATOL
    for n, p in one["params"].items():
        torch.testing.assert_close(two["params"][n], p, atol=atol, rtol=0, msg=n)
    assert any(s["loss/grad_norm"] > 0 for s in one["steps"])
    if "lora" in name:
        assert any("lora_" in n for n in one["params"])


def _launch(*overrides, nproc=2):
    return build(Namespace(nproc=nproc, hostfile=None, num_nodes=None, master_addr=None, master_port=29655, threads=None,
                           dry_run=False, overrides=list(overrides)), cpu_count=2, environ={}, cuda=False)


@pytest.mark.slow
def test_an_fsdp2_run_resumes_as_uninterrupted_and_exports_its_shards(resume_runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from datc.commands.export import export_checkpoint

    full = resume_runs.full("fsdp2")
    ckpt = full / "checkpoints" / "step_0000002"
    assert (ckpt / "dcp" / ".metadata").is_file() and {p.name for p in ckpt.glob("rank_*.pt")} == {"rank_00000.pt",
                                                                                                   "rank_00001.pt"}
    # the trained policy: gathered from the shards at the end (final/) and read from the last
    # checkpoint's torch.distributed.checkpoint files in one process by datc-export
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(full, 4, tmp_path / "exported")).eval()
    final = AutoModelForCausalLM.from_pretrained(full / "final").eval()

    # the warm start, found through the cache's own index (it may hold other draws)
    warm = AutoModelForCausalLM.from_pretrained(warm_policy(resume_runs.cache_dir)).eval()
    ids = torch.randint(4, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, final(input_ids=ids).logits, rtol=0, atol=0)
        assert not torch.equal(warm(input_ids=ids).logits, final(input_ids=ids).logits)  # it trained

    resumed = resume_runs.resumed("fsdp2")  # as a kill -9 after the step-2 checkpoint would have left it
    assert f"resumed {resumed} from its checkpoint of step 2 of 4" in resume_runs.resume_log
    assert_same_metrics(full, resumed)

    # one process cannot resume it, nor DeepSpeed: one line, before anything loads into the model
    from datc.config import ConfigError
    from datc.run.checkpoint import load_engine_checkpoint, load_sharded_checkpoint

    last = full / "checkpoints" / "step_0000004"
    with pytest.raises(ConfigError, match="^backend: .* written by 2 processes, this run has 1"):
        load_sharded_checkpoint(last, 0, 1, "fsdp2")
    with pytest.raises(ConfigError, match="^backend: .* written by FSDP2; resume it with the backend that wrote it"):
        load_engine_checkpoint(last, engine=None, rank=0, world_size=2)


@pytest.mark.slow
def test_a_lora_run_under_fsdp2_saves_adapters_and_resumes_as_uninterrupted(resume_runs, tmp_path):
    from peft import PeftModel
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from datc.commands.export import export_checkpoint

    full = resume_runs.full("lora-fsdp2")
    saved = FileSystemReader(str(full / "checkpoints" / "step_0000002" / "dcp")).read_metadata().state_dict_metadata
    model = [k for k in saved if k.startswith("model.")]
    assert model and all("lora_" in k for k in model), model[:4]  # the adapters' shards, not the frozen base
    base = warm_policy(resume_runs.cache_dir)
    ids = torch.randint(4, 100, (2, 10), generator=torch.Generator().manual_seed(0))

    def logits(path):
        with torch.no_grad():
            return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path).eval()(input_ids=ids).logits

    final = logits(full / "final")  # the adapter gathered from the shards at the end of the run
    torch.testing.assert_close(logits(export_checkpoint(full, 4, tmp_path / "exported")), final, rtol=0, atol=1e-6)
    with torch.no_grad():
        assert not torch.equal(AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits, final)  # it trained
    resumed = resume_runs.resumed("lora-fsdp2")  # "killed" after its step-2 checkpoint, then resumed
    assert f"resumed {resumed} from its checkpoint of step 2 of 4" in resume_runs.resume_log
    assert_same_metrics(full, resumed)


def test_a_non_strict_load_still_needs_every_trainable_parameter(tmp_path):
    from datc.backends.fsdp2 import check_loaded

    lora = {"h.0.attn.lora_A.weight", "h.0.attn.lora_B.weight"}
    check_loaded(tmp_path, lora, ["wte.weight", "h.0.attn.base_layer.weight"], [])  # the frozen base: reloaded, fine
    with pytest.raises(RuntimeError, match=r"trainable parameters missing: \['h.0.attn.lora_B.weight'\], unexpected: \[\]"):
        check_loaded(tmp_path, lora, ["wte.weight", "h.0.attn.lora_B.weight"], [])
    with pytest.raises(RuntimeError, match=r"unexpected: \['h.9.mlp.weight'\]"):
        check_loaded(tmp_path, lora, [], ["h.9.mlp.weight"])


def test_a_checkpoint_of_another_backend_is_refused_by_the_plain_one(tmp_path):
    from datc.backends.plain import TorchOptimizer
    from datc.config import ConfigError

    opt = TorchOptimizer(torch.nn.Linear(2, 2), None, None, 1.0)
    for kind, said in (("fsdp2", "FSDP2"), ("deepspeed", "DeepSpeed")):
        with pytest.raises(ConfigError, match=f"^backend: .* written under {said} \\(2 processes\\)"):
            opt.load(tmp_path, {kind: True, "world_size": 2})


def _cfg(*overrides):
    from hydra import compose, initialize_config_dir

    from datc.checks import validate
    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return validate(compose(config_name="train", overrides=["debug=fast", *overrides]))


def test_one_backend_per_run_said_before_any_model_loads():
    from datc.backends.checks import backend_name
    from datc.backends.distributed import check_world
    from datc.config import ConfigError

    assert backend_name(_cfg()) == "plain" and backend_name(_cfg("deepspeed=zero2")) == "deepspeed"
    assert backend_name(_cfg("backend=deepspeed", "deepspeed=zero3")) == "deepspeed"
    assert backend_name(_cfg("backend=fsdp2")) == "fsdp2"
    with pytest.raises(ConfigError, match="^backend=deepspeed needs a DeepSpeed stage"):
        _cfg("backend=deepspeed")
    with pytest.raises(ConfigError, match="^backend=fsdp2 with deepspeed.stage=2: a run has one backend"):
        _cfg("backend=fsdp2", "deepspeed=zero2")
    with pytest.raises(ConfigError, match="^backend.name: 'fsdp' is not valid; choose one of auto, plain, deepspeed, fsdp2"):
        _cfg("backend.name=fsdp")
    with pytest.raises(ConfigError, match="^backend: 2 processes were started but the plain backend runs one"):
        check_world(_cfg(), 2)
    check_world(_cfg("backend=fsdp2", "trainer.batch_size=8", "trainer.mini_batch_size=8"), 2)


def test_the_run_name_tells_fsdp2_apart_and_keeps_the_others_as_they_were():
    names = {o: _cfg(*o.split()).run_name.rsplit("-", 1)[1] for o in
             ("", "backend=plain", "backend=auto", "backend=fsdp2", "backend=fsdp2 backend.timeout_s=60",
              "backend=fsdp2 backend.reshard_after_forward=false", "deepspeed=zero2", "deepspeed=zero2 backend=deepspeed")}
    assert names[""] == names["backend=plain"] == names["backend=auto"]
    assert names["deepspeed=zero2"] == names["deepspeed=zero2 backend=deepspeed"] != names[""]
    # fsdp2's own settings change memory and waiting, not the numbers
    assert names["backend=fsdp2"] == names["backend=fsdp2 backend.timeout_s=60"] == \
        names["backend=fsdp2 backend.reshard_after_forward=false"] not in (names[""], names["deepspeed=zero2"])


def test_launch_starts_fsdp2_with_torchrun_and_refuses_a_hostfile():
    two = _launch("backend=fsdp2", "credit=datc")
    assert two.argv[1:] == ["-m", "datc.commands.torchrun", "--nnodes", "1", "--nproc-per-node", "2", "--master-port",
                            "29655", "-m", "datc.train", "backend=fsdp2", "credit=datc", "trainer.threads=1"]
    assert two.env == {"OMP_NUM_THREADS": "1"}
    with pytest.raises(SystemExit, match="for FSDP2 on several nodes start torchrun on each node"):
        build(Namespace(nproc=2, hostfile="hosts", num_nodes=None, master_addr=None, master_port=1, threads=None,
                        dry_run=False, overrides=["backend=fsdp2"]), cpu_count=2, environ={}, cuda=False)
    with pytest.raises(SystemExit, match="or backend=fsdp2"):
        _launch("credit=datc")
