"""The rollout phase: G responses to each prompt, sampled by the session's rollout engine
(:mod:`datc.engines`)."""

from __future__ import annotations

from datc.batch import Rollout, cat_rollouts
from datc.engines import SamplingArgs
from datc.step.plan import StepPlan


def sampling_args(s, plan: StepPlan) -> SamplingArgs:
    """How the run's rollouts sample (the trainer's settings and the plan's decode)."""
    c, t = s.c, s.c.trainer
    return SamplingArgs(t.num_generations, t.max_new_tokens, t.temperature, t.top_p, c.data.prompt_field,
                        synced_gpus=plan.sample_synced, share_prompts=plan.share_prompts, decode=plan.decode,
                        sync_every=t.decode_sync_every, row_draws=t.deterministic)


def sample_calls(s, engine, examples: list[dict], args: SamplingArgs, keep: bool, seeds: list[int]) -> Rollout:
    """``engine``'s responses to ``examples`` in calls of ``generation_batch_size`` responses,
    joined (groups contiguous)."""
    t, m = s.c.trainer, s.m
    per_call = (t.generation_batch_size or len(examples) * t.num_generations) // t.num_generations  # prompts
    return cat_rollouts([engine.sample(m.policy, m.tok, examples[i : i + per_call], args, keep_logits=keep,
                                       encoder=m.encoder, seeds=seeds[i : i + per_call], ops=s.ops)
                         for i in range(0, len(examples), per_call)], m.tok.pad_token_id)


def rollout(s, examples: list[dict], plan: StepPlan | None = None, keep_logits: bool | None = None,
            seeds: list[int] | None = None) -> Rollout:
    """``num_generations`` responses to each example with the policy as it is now, sampled in
    calls of ``generation_batch_size`` responses and joined (groups contiguous). The sampler's
    logits (B, T, V) are kept in ``ro.logits`` when the plan reuses them for the credit
    (``keep_logits`` overrides it). An engine with its own weights gets the policy's first
    (``plan.sync_engine``); ``seeds``: one per example for an engine with its own random
    streams (:func:`datc.engines.prompt_seeds`)."""
    plan = plan or s.plan
    keep = plan.reuse if keep_logits is None else keep_logits
    args = sampling_args(s, plan)
    seeds = seeds if seeds is not None else list(range(len(examples)))
    if plan.sync_engine:  # (ZeRO-3: the engine gathers the parameters for the push itself)
        s.engine.sync(s.m.policy)
    with s.optim.generation(plan.gather_generation):  # ZeRO-3: parameters gathered once, or per module
        ro = sample_calls(s, s.engine, examples, args, keep, seeds)
    if plan.sync_engine:
        s.engine.sleep()  # GPUs: its weights and KV cache released while the update runs
    s.ops.observe("rollout", ro)
    return ro
