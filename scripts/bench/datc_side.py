"""This project's side of the benchmark: its session, and its training step.

PORTING NOTE: the only module of scripts/bench that calls into ``datc.trainer`` and
``datc.passes`` (and only here, in :func:`step` and :func:`learn`); the rest of the benchmark runs
this project's trainer through these two functions.
"""

from __future__ import annotations

import time


def datc_session(overrides: list[str], max_new_tokens: int | None = None):
    """This project's session; ``max_new_tokens`` (not None) replaces the response budget after
    the build, so the cache (keyed by the configured budget) is not prepared again."""
    from datc.credit.analysis import session_for

    s = session_for(overrides)
    if max_new_tokens is not None:
        s.c.trainer.max_new_tokens = max_new_tokens
    return s


def step(s, it: int, min_new_tokens: int = 0) -> dict[str, float]:
    """One training step, ``datc.trainer.train_step(s, it)``; with ``min_new_tokens`` its
    rollout forbids EOS before that many tokens. The step is then ``train_step``'s own, with
    ``datc.trainer.rollout``'s sampling calls given ``min_new_tokens``: the same prompts, plan,
    sampling calls and ``learn``, timed from the same point (``perf/`` times)."""
    import datc.trainer as tr
    from datc.passes import pass_plan
    from datc.rollout import cat_rollouts, sample_groups

    if not min_new_tokens:
        return tr.train_step(s, it)
    c, t, m = s.c, s.c.trainer, s.m
    with s.autocast():
        t0 = time.perf_counter()
        indices = s.sampler.indices(it)
        examples = [s.assets.train[i] for i in indices[s.dist.shard(len(indices))]]  # whole groups per rank
        reuse = pass_plan(t, s.scheme.needs, m.vocab_size).reuse
        per_call = (t.generation_batch_size or len(examples) * t.num_generations) // t.num_generations  # prompts
        ro = cat_rollouts([sample_groups(m.policy, m.tok, examples[i : i + per_call], t.num_generations, t.max_new_tokens,
                                         t.temperature, t.top_p, c.data.prompt_field, keep_logits=reuse,
                                         synced_gpus=m.synced_gpus, encoder=m.encoder, share_prompts=m.share_prompts,
                                         min_new_tokens=min_new_tokens)
                           for i in range(0, len(examples), per_call)], m.tok.pad_token_id)
        return tr.learn(s, it, ro, t0)


def learn(s, it: int, ro) -> dict[str, float]:
    """Step ``it`` on a given rollout ``ro`` (everything after the rollout: reward, credit,
    update), ``datc.trainer.learn`` under the session's autocast, as ``train_step`` runs it."""
    import datc.trainer as tr

    with s.autocast():
        return tr.learn(s, it, ro, time.perf_counter())
