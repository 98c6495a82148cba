"""The built-in sampler on its own copy of the policy's weights: the engine of ``rollout=torch``
when ``rollout.max_staleness > 0`` (:mod:`datc.step.stream`), so that it can sample the next
batches on another thread while the trainer updates the policy.

It samples as the built-in engine does (:func:`datc.engines.generate.sample_groups`, the
dynamic-cache decode: the static decode's CUDA graph draws from torch's global stream), with
two differences that make it an engine with its own weights, as vLLM is:

- **Weights.** A deep copy of the policy, frozen; :meth:`OwnCopyEngine.snapshot` copies the
  policy's state dict (the trainer waits for that copy only), :meth:`OwnCopyEngine.load` copies
  it into the engine's model on the engine's thread.
- **Random numbers.** Each call draws from its own ``torch.Generator`` seeded by the call's
  per-prompt seeds (:func:`datc.engines.base.prompt_seeds`), never from torch's global stream,
  which the trainer's thread uses (mini-batch order, the evaluation's forked stream): a batch's
  responses are a function of (its seeds, the weights it was sampled with), whatever the
  threads' timing; under ``trainer.deterministic`` each response draws from its own generator
  seeded by its prompt's seed (:func:`datc.engines.sampling.row_uniforms`), as the built-in engine does.
- **Log-probs.** Each sampled token's log-prob under the distribution it was drawn from,
  ``log softmax(z / temperature)`` of the engine's own logits (``Rollout.sampler_logps``), which
  the sampler/trainer correction (:mod:`datc.math.correction`) compares with the trained
  policy's. Its logits are not kept for the credit: they are a past policy's, and the credit is
  computed on the trained policy's distribution (the step plan recomputes it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from datc.batch import Rollout
from datc.engines.base import RolloutEngine, SamplingArgs
from datc.engines.generate import sample_groups
from datc.engines.sampling import row_uniforms
from datc.math.logprobs import selective_log_softmax


class OwnCopyEngine(RolloutEngine):
    name = "torch"
    keeps_logits = False
    own_weights = True
    loads_on_its_thread = True

    def __init__(self, policy) -> None:
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.pushes = 0

    @classmethod
    def build(cls, c, m, device, dist) -> OwnCopyEngine:
        return cls(m.policy)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "weights": "own copy (rollout.max_staleness > 0)", "decode": "dynamic"}

    def snapshot(self, policy) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in policy.state_dict().items()}

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            own = self.model.state_dict()
            if own.keys() != weights.keys():
                raise ValueError("the engine's copy and the pushed weights have other parameter names")
            for k, v in weights.items():
                own[k].copy_(v)
        self.pushes += 1

    def sync(self, policy) -> None:
        self.load(policy.state_dict())

    def sample(self, policy, tok, examples: list[dict[str, Any]], args: SamplingArgs, *, keep_logits: bool = False,
               encoder=None, seeds: list[int] | None = None, ops=None) -> Rollout:
        if keep_logits:
            raise ValueError("the own-copy engine's logits are a past policy's; the step plan recomputes them")
        seeds = seeds if seeds is not None else list(range(len(examples)))
        device = next(self.model.parameters()).device
        if args.row_draws:  # trainer.deterministic: each response's draws from its prompt's seed, not the call's
            draws = {"uniforms": row_uniforms(seeds, args.num_generations, args.max_new_tokens)}
        else:
            draws = {"generator": torch.Generator(device).manual_seed(call_seed(seeds))}
        ro = sample_groups(self.model, tok, examples, args.num_generations, args.max_new_tokens, args.temperature,
                           args.top_p, args.prompt_field, keep_logits=True, encoder=encoder,
                           share_prompts=args.share_prompts, decode="dynamic", **draws)
        logits = ro.logits if args.temperature == 1.0 else ro.logits / args.temperature
        ro.sampler_logps = selective_log_softmax(logits, ro.response_ids) * ro.response_mask
        ro.logits = None
        return ro


def call_seed(seeds: list[int]) -> int:
    """One 63-bit seed from a call's per-prompt seeds (order matters)."""
    h = 0
    for s in seeds:
        h = (h * 1_000_003 + int(s)) % (2**63 - 25)
    return h
