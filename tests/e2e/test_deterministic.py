"""``trainer.deterministic``: each response's draws come from its prompt's seed (not the rank, the
batch or torch's global stream), two identical runs are equal bit for bit, a run's step-1
responses are the same on one process and on two, and the mode's settings are the process's
only while a run lasts. The default (off) is today's run bit for bit: tests/math/test_numerics.py's
fingerprint and every equality test run with it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from datc.engines import SamplingArgs
from datc.engines.builtin import TorchEngine
from datc.engines.own_copy import OwnCopyEngine
from datc.engines.sampling import row_uniforms
from tests.helpers.distributed.same_batch import env, free_port
from tests.helpers.runs import comparable, metric_rows
from tests.helpers.testbed import cfg_for

ROWS = [{"prompt": "write about music :"}, {"prompt": "write about the ocean and the city :"},
        {"prompt": "a short note on rain"}]
SEEDS = [11, 2_000_000_017, 5]


def _args(**kw) -> SamplingArgs:
    return SamplingArgs(num_generations=4, max_new_tokens=8, temperature=1.0, top_p=1.0, **kw)


def test_row_uniforms_depend_on_the_prompt_seed_and_the_index_only():
    u = row_uniforms(SEEDS, 4, 8)
    assert u.shape == (12, 8) and u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
    torch.testing.assert_close(row_uniforms(SEEDS[1:], 4, 8), u[4:], rtol=0, atol=0)  # another batch, the same rows
    assert len({tuple(r) for r in u.tolist()}) == 12  # every response its own stream


@pytest.mark.parametrize("engine", ["builtin", "own_copy"])
def test_a_responses_draws_do_not_depend_on_its_batch_or_the_global_stream(policy, tok, engine):
    """The same prompt and seed sampled alone or beside others, after other draws from torch's global
    stream, gives the same responses (the ranks of a run hold other batches)."""
    eng = TorchEngine() if engine == "builtin" else OwnCopyEngine(policy)
    args = _args(row_draws=True)
    torch.manual_seed(0)
    together = eng.sample(policy, tok, ROWS, args, seeds=SEEDS)
    torch.manual_seed(123)
    alone = eng.sample(policy, tok, ROWS[1:2], args, seeds=SEEDS[1:2])
    rows = slice(4, 8)
    assert torch.equal(together.response_ids[rows][together.response_mask[rows]], alone.response_ids[alone.response_mask])
    assert together.response_mask.sum() > 12  # the responses are not all empty
    # by default the draws are torch's global stream (the built-in engine) or the call's seeds (its own copy)
    torch.manual_seed(0)
    default = eng.sample(policy, tok, ROWS, _args(), seeds=SEEDS)
    assert not torch.equal(default.response_ids, together.response_ids)


def test_the_mode_samples_with_the_dynamic_decode_loop(monkeypatch):
    """The static decode (a CUDA graph on CUDA) draws from torch's global stream: off in the mode."""
    from dataclasses import replace

    from datc.config import TrainerConfig
    from datc.credit import CREDIT_SCHEMES
    from datc.step.plan import build_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU, where auto means static
    for decode in ("auto", "static"):
        t = replace(TrainerConfig(), decode=decode, device="cuda")
        assert build_plan(t, CREDIT_SCHEMES.get("grpo"), 512, with_ref=True).decode == "static"
        assert build_plan(replace(t, deterministic=True), CREDIT_SCHEMES.get("grpo"), 512, with_ref=True).decode == "dynamic"


def test_two_identical_runs_under_the_mode_are_equal_bit_for_bit(prepared_cache, tmp_path):
    from datc.training.trainer import train

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    for name in ("a", "b"):
        train(cfg_for(prepared_cache, tmp_path / name, "trainer.deterministic=true", "trainer.steps=3"))
        # the mode's settings last as long as the run
        assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                torch.backends.cudnn.benchmark) == before
    a, b = comparable(metric_rows(tmp_path / "a")), comparable(metric_rows(tmp_path / "b"))
    assert a == b and len([r for r in a if "loss/total" in r]) == 3
    wa, wb = load_file(tmp_path / "a" / "final" / "model.safetensors"), load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    plan = json.loads((tmp_path / "a" / "step_plan.json").read_text())
    assert "dynamic" in json.dumps(plan)


def _one_process(cache, tmp_path, name, *overrides) -> list[dict]:
    from datc.step.ops import StepOps
    from datc.training.trainer import train
    from tests.helpers.distributed.responses_worker import recorder

    steps: list[dict] = []
    train(cfg_for(cache, tmp_path / name, *overrides), ops=StepOps(observe=recorder(steps)))
    return steps


def _two_processes(cache, tmp_path, spec: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Each run of ``spec`` on two gloo ranks (one torchrun launch); every step's responses of both
    ranks, merged by prompt."""
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).resolve().parents[1] / "helpers" / "distributed" / "responses_worker.py"
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(worker), str(tmp_path / "spec.json"), str(out)]
    proc = subprocess.run(cmd, env=env(cache), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    merged = {}
    for name in spec:
        merged[name] = []
        for per_rank in zip(ranks[0][name], ranks[1][name], strict=True):
            assert not set(per_rank[0]) & set(per_rank[1])  # each rank samples its own prompts
            merged[name].append({**per_rank[0], **per_rank[1]})
    return merged


@pytest.mark.slow
def test_one_and_two_processes_sample_the_same_step_one_responses_under_the_mode(prepared_cache, tmp_path):
    """datc-launch --nproc 2 backend=fsdp2 and one process, the same seed: with trainer.deterministic
    each response draws from its prompt's seed, so step 1's responses are the same (by default
    each rank draws from its own stream, seeded by the rank, and they differ)."""
    common = ["debug=fast", f"cache_dir={prepared_cache}", "trainer.steps=2", "trainer.eval_every=2",
              "trainer.checkpoint_every=2"]
    spec = {mode: [*common, f"run_dir={tmp_path / ('two_' + mode)}", "backend=fsdp2", f"trainer.deterministic={flag}"]
            for mode, flag in (("on", "true"), ("off", "false"))}
    two = _two_processes(prepared_cache, tmp_path, spec)
    one_on = _one_process(prepared_cache, tmp_path, "one_on", "trainer.steps=2", "trainer.deterministic=true")
    one_off = _one_process(prepared_cache, tmp_path, "one_off", "trainer.steps=2")
    assert len(one_on) == len(two["on"]) == 2
    assert set(one_on[0]) == set(two["on"][0]) and len(one_on[0]) == 2  # the step's prompts, split over the ranks
    assert one_on[0] == two["on"][0]
    assert one_off[0] != two["off"][0]  # without the mode, the responses follow the process count


def test_the_mode_names_its_runs_and_off_keeps_every_earlier_name(tmp_path):
    """Off, a run keeps the name (and the identity a resume checks) it had before the field existed."""
    from datc.run.naming import config_id

    base = config_id(cfg_for(tmp_path, tmp_path / "r"))
    assert config_id(cfg_for(tmp_path, tmp_path / "r", "trainer.deterministic=false")) == base
    assert config_id(cfg_for(tmp_path, tmp_path / "r", "trainer.deterministic=true")) != base
