"""The step plan: every special case of the training step, decided once when the session is built.

A step makes a fixed set of passes over its rollout batch, and which ones depends on the config,
the credit scheme's declarations and how the models were placed, never on the data. The
:class:`StepPlan` holds those decisions; the phases read them and never re-derive them. The run
logs the plan once (:meth:`StepPlan.describe`), so a reader sees which paths a run took.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from datc.credit.base import ENTROPY, POLICY_LOGITS, RM_GRAD
from datc.passes import Passes, pass_plan


@dataclass(frozen=True)
class StepPlan:
    """Which passes one training step makes, and how."""

    on_policy: bool  # one epoch, one mini-batch: the loss's old log-probs are the current ones
    wants_dist: bool  # the credit scheme reads the rollout policy's distribution
    reuse: bool  # ... and takes it from the sampler's kept logits (no second forward pass)
    chunk_rows: int | None  # rows per credit chunk (a row-local scheme recomputing logits); None: the whole batch
    skip_zero: bool  # credit, credit inputs and (identical groups') RM backward only for responses with A != 0
    rm_grad: bool  # the reward model's input-embedding gradient is made (the scheme declares it)
    credit_entropy: bool  # the credit pass makes entropies (read by the scheme, or rollout/entropy off-policy)
    with_ref: bool  # a frozen reference (KL term, beta > 0)
    ref_is_policy: bool  # ... which is the policy with its LoRA adapters disabled, no second model (datc.lora)
    trunk: int  # blocks the reward model shares with the reference: one pass gives both (datc.trunk); 0 off
    share_prompts: bool  # forwards compute each distinct prompt once (datc.shared_prompt)
    synced_gpus: bool  # sampling keeps every rank forwarding (ZeRO-3 with several ranks)
    keep_completions: bool  # the step before an eval keeps its completions (for the W&B table)
    passes: Passes  # the policy-side passes with (temperature, micro-batch, shared prompts) bound

    def given(self, has_logits: bool) -> StepPlan:
        """The plan for a rollout that did (or did not) keep the sampler's logits: a rollout made
        elsewhere (the credit analysis, a benchmark, the two-process test) may not have them."""
        if has_logits == self.reuse:
            return self
        reuse = has_logits and self.wants_dist and self.on_policy
        return dataclasses.replace(self, reuse=reuse, chunk_rows=self.passes.micro if self._chunked and not reuse else None)

    def for_analysis(self) -> StepPlan:
        """The credit analysis's plan (:mod:`datc.analysis.inputs`): every input any scheme may
        declare from one pass over the whole batch, the reward model's gradient for every
        response, no reference and no skip."""
        return dataclasses.replace(self, on_policy=True, wants_dist=True, reuse=False, chunk_rows=None, skip_zero=False,
                                   rm_grad=True, credit_entropy=True, with_ref=False, ref_is_policy=False, trunk=0)

    _chunked: bool = False  # a row-local scheme that reads the policy's logits (chunked when they are recomputed)

    def completions_at(self, step: int, eval_every: int, steps: int) -> bool:
        """Whether step ``step`` (1-based) keeps its completions: the step an eval follows."""
        return self.keep_completions and (step % eval_every == 0 or step == steps)

    def describe(self) -> dict[str, Any]:
        """The plan as plain values, for the run's log."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        out["passes"] = dataclasses.asdict(self.passes)
        return out


def build_plan(t, scheme, vocab_size: int, *, with_ref: bool, trunk: int, ref_is_policy: bool = False, share_prompts: bool, synced_gpus: bool,
               keep_completions: bool = False) -> StepPlan:
    """The plan for trainer settings ``t`` (``c.trainer``), a credit scheme and the placed models."""
    needs = scheme.needs
    pp = pass_plan(t, needs, vocab_size)
    chunked = scheme.row_local and POLICY_LOGITS in needs
    return StepPlan(
        on_policy=pp.on_policy, wants_dist=pp.wants_dist, reuse=pp.reuse,
        chunk_rows=t.micro_batch_size if chunked and not pp.reuse else None,
        # Off under ZeRO-3 with several ranks, where every rank must run as many forwards as the others.
        skip_zero=t.skip_zero_advantage and scheme.row_separable and not synced_gpus,
        rm_grad=RM_GRAD in needs,
        # On-policy the update's forward is the rollout policy's, and rollout/entropy comes from it.
        credit_entropy=ENTROPY in needs or not pp.on_policy,
        with_ref=with_ref, ref_is_policy=with_ref and ref_is_policy, trunk=trunk, share_prompts=share_prompts, synced_gpus=synced_gpus,
        keep_completions=keep_completions,
        passes=Passes(t.temperature, t.micro_batch_size, share_prompts),
        _chunked=chunked,
    )
