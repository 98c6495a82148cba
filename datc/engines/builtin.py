"""The built-in engine: the trainer's policy samples with the project's own KV-cache loop
(:func:`datc.engines.generate.sample_groups`, the static-cache decode on CUDA). Its logits are the
trainer's, so the credit can reuse them and no correction applies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from datc.batch import Rollout
from datc.engines.base import RolloutEngine, SamplingArgs
from datc.engines.generate import sample_groups
from datc.engines.sampling import row_uniforms


class TorchEngine(RolloutEngine):
    name = "torch"
    keeps_logits = True
    own_weights = False

    @classmethod
    def build(cls, c, m, device, dist) -> RolloutEngine:
        """This engine; with ``rollout.max_staleness > 0`` the same sampler on its own copy of the
        weights, which can sample on another thread while the policy is updated
        (:mod:`datc.engines.own_copy`)."""
        if c.rollout.max_staleness > 0:
            from datc.engines.own_copy import OwnCopyEngine

            return OwnCopyEngine.build(c, m, device, dist)
        return cls()

    @classmethod
    def declared(cls, c) -> type[RolloutEngine]:
        if c.rollout.max_staleness > 0:
            from datc.engines.own_copy import OwnCopyEngine

            return OwnCopyEngine
        return cls

    def sample(self, policy, tok, examples: list[dict[str, Any]], args: SamplingArgs, *, keep_logits: bool = False,
               encoder=None, seeds: list[int] | None = None, ops=None) -> Rollout:
        # The sampling call is the step's seam (datc.step.ops.StepOps.sample, read at each call, so a
        # tool that replaces the session's ops samples through its own); its random numbers are
        # torch's own stream (seeded by the run), not per-prompt seeds, unless args.row_draws
        # (trainer.deterministic): then each response draws from its own generator seeded by its
        # prompt's seed, whichever rank or batch samples it.
        fn: Callable = sample_groups if ops is None else ops.sample
        extra = {}
        if args.row_draws:
            seeds = seeds if seeds is not None else list(range(len(examples)))
            extra["uniforms"] = row_uniforms(seeds, args.num_generations, args.max_new_tokens)
        return fn(policy, tok, examples, args.num_generations, args.max_new_tokens, args.temperature,
                  args.top_p, args.prompt_field, keep_logits=keep_logits, synced_gpus=args.synced_gpus,
                  encoder=encoder, share_prompts=args.share_prompts, decode=args.decode,
                  sync_every=args.sync_every, **extra)
