"""LoRA policies under DeepSpeed on CPU (gloo), as the full-policy tests of
tests/e2e/test_distributed.py: 2-process ZeRO-2 and ZeRO-3 runs compute the same losses and end
with the same adapters as one plain process on the same global batch; a run saved and resumed
equals an uninterrupted one, its checkpoints hold the adapters (not the frozen base), and the
adapter exported from DeepSpeed's shards is the one ``final/`` holds."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed.resume import warm_policy
from tests.helpers.distributed.same_batch import assert_two_match_one
from tests.helpers.runs import assert_same_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_two_lora_processes_match_one_on_the_same_global_batch(same_batch_runs, stage):
    one, two = same_batch_runs.one(f"lora-{stage}"), same_batch_runs.two(f"lora-{stage}")
    assert [n for n in one["params"] if "lora_" in n]  # the adapters are compared
    assert_two_match_one(one, two)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_lora_run_under_deepspeed_saves_adapters_and_resumes_as_uninterrupted(resume_runs, tmp_path, stage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from datc.commands.export import export_checkpoint

    full = resume_runs.full(f"lora-{stage}")
    ckpt = full / "checkpoints" / "step_0000002"
    files = sorted(ckpt.glob("*model_states.pt"))
    assert files
    for f in files:
        module = torch.load(f, map_location="cpu", weights_only=False)["module"] or {}
        assert all("lora_" in k for k in module), sorted(module)[:4]  # the adapters, not the frozen base
        assert module or stage == "zero3", f.name  # ZeRO-3's live in its optimizer's fp32 partitions

    base = warm_policy(resume_runs.cache_dir)
    ids = torch.randint(4, 100, (2, 10), generator=torch.Generator().manual_seed(0))

    def logits(path):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path).eval()
        with torch.no_grad():
            return model(input_ids=ids).logits

    final = logits(full / "final")
    torch.testing.assert_close(logits(export_checkpoint(full, 4, tmp_path / "exported")), final, rtol=0, atol=1e-6)
    with torch.no_grad():
        assert not torch.equal(AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits, final)

    resumed = resume_runs.resumed(f"lora-{stage}")  # "killed" after its step-2 checkpoint, then resumed
    assert f"resumed {resumed} from its checkpoint of step 2 of 4" in resume_runs.resume_log
    assert_same_metrics(full, resumed)
