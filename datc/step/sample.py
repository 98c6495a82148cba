"""The rollout phase: G responses to each prompt, sampled by the session's sampler."""

from __future__ import annotations

from datc.rollout import Rollout, cat_rollouts
from datc.step.plan import StepPlan


def rollout(s, examples: list[dict], plan: StepPlan | None = None, keep_logits: bool | None = None) -> Rollout:
    """``num_generations`` responses to each example, sampled in calls of
    ``generation_batch_size`` responses and joined (groups contiguous). The sampler's logits
    (B, T, V) are kept in ``ro.logits`` when the plan reuses them for the credit
    (``keep_logits`` overrides it)."""
    c, t, m = s.c, s.c.trainer, s.m
    plan = plan or s.plan
    keep = plan.reuse if keep_logits is None else keep_logits
    per_call = (t.generation_batch_size or len(examples) * t.num_generations) // t.num_generations  # prompts
    with s.optim.generation(plan.gather_generation):  # ZeRO-3: parameters gathered once, or per module
        ro = cat_rollouts([s.ops.sample(m.policy, m.tok, examples[i : i + per_call], t.num_generations, t.max_new_tokens,
                                        t.temperature, t.top_p, c.data.prompt_field, keep_logits=keep,
                                        synced_gpus=plan.sample_synced, encoder=m.encoder,
                                        share_prompts=plan.share_prompts, decode=plan.decode,
                                        sync_every=t.decode_sync_every)
                           for i in range(0, len(examples), per_call)], m.tok.pad_token_id)
    s.ops.observe("rollout", ro)
    return ro
