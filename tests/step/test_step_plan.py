"""The step plan: every special case of the step decided once, from the config, the scheme's
declarations and the placed models; one table over the combinations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from datc.backends.base import Declares
from datc.credit import CREDIT_SCHEMES
from datc.step.plan import REUSE_LOGITS_MAX_ELEMENTS, build_plan


def _t(**kw):
    base = dict(epochs=1, batch_size=8, mini_batch_size=8, micro_batch_size=2, max_new_tokens=4, temperature=0.7,
                reuse_rollout_logits="auto", skip_zero_advantage=True, decode="auto", device="cpu",
                share_prompts=True, share_trunk=True)
    return SimpleNamespace(**{**base, **kw})


V = 100  # vocabulary: 8 x 4 x 100 logits, far below the reuse threshold
BIG_V = REUSE_LOGITS_MAX_ELEMENTS // (8 * 4) + 1  # just above it
MODELS = dict(with_ref=True, trunk=0)
SYNCED = Declares(synced_ranks=True, share_prompts=False)  # ZeRO-3 or FSDP2 over ranks: collective forwards

# (scheme, trainer settings, models, vocabulary) -> the decisions that follow
CASES = [
    # uniform credit reads nothing: no pass, no reuse, the skip applies (row-separable)
    ("grpo", {}, {}, V, dict(on_policy=True, wants_dist=False, reuse=False, chunk_rows=None, skip_zero=True,
                             rm_grad=False, credit_entropy=False)),
    # DATC on-policy: the sampler's logits are reused, one chunk, the RM gradient is made
    ("datc", {}, {}, V, dict(on_policy=True, wants_dist=True, reuse=True, chunk_rows=None, skip_zero=True,
                             rm_grad=True, credit_entropy=False)),
    # ... at a large vocabulary: recomputed in micro-batch chunks
    ("datc", {}, {}, BIG_V, dict(reuse=False, chunk_rows=2)),
    ("datc", {"reuse_rollout_logits": "never"}, {}, V, dict(reuse=False, chunk_rows=2)),
    ("datc", {"reuse_rollout_logits": "always"}, {}, BIG_V, dict(reuse=True, chunk_rows=None)),
    # off-policy (two epochs or several mini-batches): a pass for the old log-probs, entropies made
    ("datc", {"epochs": 2}, {}, V, dict(on_policy=False, reuse=False, chunk_rows=2, credit_entropy=True)),
    ("grpo", {"mini_batch_size": 4}, {}, V, dict(on_policy=False, wants_dist=False, reuse=False,
                                                 credit_entropy=True)),
    # the skip: off by the switch, for schemes comparing responses, and under synced ZeRO-3 ranks
    ("datc", {"skip_zero_advantage": False}, {}, V, dict(skip_zero=False)),
    ("delta", {}, {}, V, dict(skip_zero=False, chunk_rows=None)),
    ("entropy_top", {}, {}, V, dict(skip_zero=False, credit_entropy=True)),
    ("datc_shuffled", {}, {}, V, dict(skip_zero=False)),
    ("datc", {}, {"backend": SYNCED}, V, dict(skip_zero=False, synced_gpus=True, share_prompts=False)),
    # ... which also forward whole prompts, so the trunk (shared-prompt layout) is off; shared prompts by the switch
    ("datc", {}, {"backend": SYNCED, "trunk": 3}, V, dict(trunk=0, share_prompts=False)),
    ("datc", {"share_prompts": False}, {"trunk": 3}, V, dict(trunk=0, share_prompts=False, skip_zero=True)),
    ("datc", {"share_trunk": False}, {"trunk": 3}, V, dict(trunk=0, share_prompts=True)),
    ("datc", {}, {"backend": Declares(frozen_partitioned=True), "trunk": 3}, V, dict(trunk=0, share_prompts=True)),
    # FSDP2 on one rank: prompts shared in the no-grad passes, not in the update (its backward would
    # reach a resharded block through the KV cache), and the passes given to the update say so
    ("datc", {}, {"backend": Declares(share_update_prompts=False)}, V,
     dict(share_prompts=True, share_update_prompts=False)),
    ("datc", {}, {"grad_checkpoint": True}, V, dict(share_prompts=True, share_update_prompts=False)),
    ("datc", {"share_prompts": False}, {}, V, dict(share_prompts=False, share_update_prompts=False)),
    # the decode loop: auto is dynamic on CPU (measured faster there); static unless ranks are synced
    ("grpo", {}, {}, V, dict(decode="dynamic")),
    ("grpo", {"decode": "static"}, {}, V, dict(decode="static")),
    ("grpo", {"decode": "static"}, {"backend": SYNCED}, V, dict(decode="dynamic")),
    ("grpo", {"decode": "static"}, {"backend": Declares(synced_ranks=True, gather_generation=True)}, V,
     dict(decode="static", gather_generation=True, sample_synced=False)),
    # the trunk the models share is used where prompts are shared and a reference runs
    ("datc", {}, {"trunk": 3}, V, dict(trunk=3, with_ref=True)),
    ("grpo", {}, {"with_ref": False, "trunk": 3}, V, dict(with_ref=False, trunk=0)),
]


@pytest.mark.parametrize(("name", "t", "models", "vocab", "expected"), CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in {**c[1], **c[2]}.items() if k != 'backend') or 'default'}"
                              f"{'-' + ''.join(k[0] for k, v in vars(c[2]['backend']).items() if v is True) if 'backend' in c[2] else ''}"
                              f"-V{c[3]}-{i}"
                              for i, c in enumerate(CASES)])
def test_the_plan_follows_config_scheme_and_models(name, t, models, vocab, expected):
    plan = build_plan(_t(**t), CREDIT_SCHEMES.get(name), vocab, **{**MODELS, **models})
    got = {k: getattr(plan, k) for k in expected}
    assert got == expected
    assert plan.passes.temperature == 0.7 and plan.passes.micro == 2 and plan.passes.share == plan.share_prompts
    assert plan.update_passes.share == plan.share_update_prompts


def test_a_rollout_without_kept_logits_gets_the_recomputing_plan():
    plan = build_plan(_t(), CREDIT_SCHEMES.get("datc"), V, **MODELS)
    assert plan.reuse and plan.given(True) is plan
    given = plan.given(False)
    assert not given.reuse and given.chunk_rows == 2 and given.given(False) is given
    assert build_plan(_t(), CREDIT_SCHEMES.get("grpo"), V, **MODELS).given(False).reuse is False


def test_completions_are_kept_only_before_an_eval_and_only_when_asked():
    plan = build_plan(_t(), CREDIT_SCHEMES.get("grpo"), V, **MODELS, keep_completions=True)
    assert [s for s in range(1, 11) if plan.completions_at(s, eval_every=4, steps=10)] == [4, 8, 10]
    off = build_plan(_t(), CREDIT_SCHEMES.get("grpo"), V, **MODELS)
    assert not any(off.completions_at(s, 4, 10) for s in range(1, 11))


def test_the_analysis_plan_makes_every_input_and_skips_nothing():
    plan = build_plan(_t(epochs=2), CREDIT_SCHEMES.get("grpo"), V, **{**MODELS, "trunk": 2}).for_analysis()
    assert plan.on_policy and plan.wants_dist and plan.rm_grad and plan.credit_entropy
    assert not (plan.reuse or plan.skip_zero or plan.with_ref or plan.trunk or plan.chunk_rows)


def test_the_plan_describes_itself_in_plain_values():
    import json

    d = build_plan(_t(), CREDIT_SCHEMES.get("datc"), V, **MODELS).describe()
    assert json.loads(json.dumps(d)) == d and d["passes"] == {"temperature": 0.7, "micro": 2, "share": True}
    assert "_chunked" not in d and d["reuse"] is True


def test_partitioned_sampling_gathers_or_syncs_as_the_backend_declares():
    gathered = build_plan(_t(), CREDIT_SCHEMES.get("datc"), V, **MODELS,
                          backend=Declares(synced_ranks=True, share_prompts=False, gather_generation=True))
    assert gathered.gather_generation and not gathered.sample_synced and gathered.synced_gpus
    assert not gathered.skip_zero  # the other passes are still partitioned: every rank makes the same forwards
    synced = build_plan(_t(), CREDIT_SCHEMES.get("datc"), V, **MODELS, backend=SYNCED)
    assert not synced.gather_generation and synced.sample_synced
    alone = build_plan(_t(), CREDIT_SCHEMES.get("datc"), V, **MODELS, backend=Declares(gather_generation=True))
    assert not alone.gather_generation and not alone.sample_synced  # nothing partitioned: nothing to gather


def test_auto_gathers_where_the_parameters_fit():
    import torch

    from datc.backends.deepspeed import gather_generation_for

    policy = torch.nn.Linear(1000, 1000)  # 4 MB of float32 parameters
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gather_generation_for("auto", policy, False, cpu)[0] is False
    assert gather_generation_for("auto", policy, True, cpu)[0] is True
    assert gather_generation_for("auto", policy, True, cuda, free_bytes=9 * 2**20)[0] is True
    fits, why = gather_generation_for("auto", policy, True, cuda, free_bytes=7 * 2**20)
    assert fits is False and "GiB free" in why
    assert gather_generation_for("synced", policy, True, cpu)[0] is False
    assert gather_generation_for("gather", policy, True, cuda, free_bytes=0)[0] is True
