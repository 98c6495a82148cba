"""The step plan: every special case of the training step, decided once when the session is built.

A step makes a fixed set of passes over its rollout batch, and which ones depends on the config,
the credit scheme's declarations and how the models were placed, never on the data. The
:class:`StepPlan` holds those decisions; the phases read them and never re-derive them. The run
writes the plan once into its directory (``step_plan.json``, :meth:`StepPlan.describe`), so a reader sees which paths a run took.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from datc.backends.base import Declares
from datc.backends.plugins import partitioned
from datc.credit.base import ENTROPY, OLD_LOGPS, POLICY_HIDDEN, POLICY_LOGITS, RM_GRAD
from datc.engines.static_decode import decode_mode
from datc.forward.passes import Passes

# Largest B·T·V for which generate's logits are kept for credit (``reuse_rollout_logits: auto``):
# 2^28 float32 values = 1 GiB. Real vocabularies at real batch sizes recompute them in chunks.
REUSE_LOGITS_MAX_ELEMENTS = 2**28


def is_on_policy(t) -> bool:
    """One epoch, one mini-batch (trainer settings ``t``): the loss's old log-probs are the current ones."""
    return t.epochs == 1 and t.mini_batch_size == t.batch_size


def wants_dist(needs: frozenset[str]) -> bool:
    """Whether a credit scheme with declared inputs ``needs`` reads the rollout policy's distribution."""
    return bool(needs & {POLICY_LOGITS, ENTROPY, OLD_LOGPS, POLICY_HIDDEN})


def reuses_rollout_logits(t, needs: frozenset[str], vocab_size: int) -> bool:
    """Whether the step takes the rollout policy's distribution from the sampler's kept logits (no
    second forward pass): on-policy, for a scheme that reads it and no hidden state (the sampler
    keeps none), under ``trainer.reuse_rollout_logits``. Read by
    :func:`build_plan`."""
    return is_on_policy(t) and wants_dist(needs) and POLICY_HIDDEN not in needs and (
        t.reuse_rollout_logits == "always"
        or (t.reuse_rollout_logits == "auto" and t.batch_size * t.max_new_tokens * vocab_size <= REUSE_LOGITS_MAX_ELEMENTS))


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
    trunk: int  # blocks the reward model shares with the reference: one pass gives both (datc.forward.trunk); 0 off
    share_prompts: bool  # forwards compute each distinct prompt once (datc.models.shared_prompt)
    share_update_prompts: bool  # ... in the update too: not under activation checkpointing or where the backend says no
    synced_gpus: bool  # the policy's forwards are collective (ZeRO-3, FSDP2 over ranks): every rank makes as many
    gather_generation: bool  # sampling with the policy's parameters gathered once per call (ZeRO-3, FSDP2)
    sample_synced: bool  # sampling keeps every rank forwarding until all are done (synced, not gathered)
    decode: str  # the sampler's decode loop: static (cache and graph, datc.engines.static_decode) or dynamic
    keep_completions: bool  # the step before an eval keeps its completions (for the tracker's table)
    head_chunk: int | None  # the update's LM head this many positions at a time (no (rows, T, V) logits); None: whole
    grad_checkpoint: bool  # the update recomputes the decoder blocks' activations in the backward
    engine: str  # the rollout engine (datc.engines): torch samples with the policy, vllm with its own copy
    sync_engine: bool  # the policy's weights are pushed to the engine before each rollout (an engine with its own)
    correction: str  # importance-sampling correction of the sampler/trainer mismatch (datc.math.correction), or none
    correction_cap: float  # its C
    staleness: int  # rollout.max_staleness: batches sampled up to this many versions ahead on the engine's thread (datc.step.stream)
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
                                   rm_grad=True, credit_entropy=True, with_ref=False, trunk=0)

    @property
    def update_passes(self) -> Passes:
        """The update's passes: the run's, without shared prompts where ``share_update_prompts`` is
        off (activation checkpointing: a block recomputed in the backward must not append to the
        shared prompt's KV cache again; FSDP2: :class:`datc.backends.base.Declares`)."""
        return self.passes if self.share_update_prompts else dataclasses.replace(self.passes, share=False)

    _chunked: bool = False  # a row-local scheme that reads the policy's logits (chunked when they are recomputed)

    def completions_at(self, step: int, eval_every: int, steps: int) -> bool:
        """Whether step ``step`` (1-based) keeps its completions: the step an eval follows."""
        return self.keep_completions and (step % eval_every == 0 or step == steps)

    def describe(self) -> dict[str, Any]:
        """The plan as plain values, for the run's log."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        out["passes"] = dataclasses.asdict(self.passes)
        return out


def build_plan(t, scheme, vocab_size: int, *, with_ref: bool, trunk: int = 0, backend: Declares | None = None,
               keep_completions: bool = False, head_chunk: int | None = None, grad_checkpoint: bool = False,
               engine=None, correction: str = "none", correction_cap: float = 2.0, staleness: int = 0) -> StepPlan:
    """The plan for trainer settings ``t`` (``c.trainer``), a credit scheme and the placed models:
    ``trunk``, the leading blocks the reference and the reward model share (0: none, or another
    reward-model input); ``backend``, what the backend's placement asks
    (:class:`datc.backends.base.Declares`: collective forwards keep every rank's passes matched, so
    no shared prompts, no trunk and no zero-advantage skip there); ``head_chunk``:
    ``trainer.lm_head_chunk`` where the policy allows it (:func:`head_chunk_for`). ``engine``: the
    session's rollout engine (:mod:`datc.engines`; None: the built-in one): one that keeps no
    logits has the credit recompute them, one with its own weights is synced and may be corrected
    for (``correction``, :mod:`datc.math.correction`); ``staleness``: ``rollout.max_staleness``
    (the engine samples ahead with its own weights, :mod:`datc.step.stream`)."""
    needs, backend = scheme.needs, backend or Declares()
    on_policy, reads_dist = is_on_policy(t), wants_dist(needs)
    chunked = scheme.row_local and POLICY_LOGITS in needs
    keeps_logits = engine is None or engine.keeps_logits
    own_weights = engine is not None and engine.own_weights
    reuse = reuses_rollout_logits(t, needs, vocab_size) and keeps_logits
    synced = backend.synced_ranks
    share = t.share_prompts and backend.share_prompts
    # the trunk runs in the reference's shared-prompt layout with whole parameters to compare
    trunk = trunk if with_ref and share and t.share_trunk and not backend.frozen_partitioned else 0
    gather = backend.gather_generation and synced
    return StepPlan(
        on_policy=on_policy, wants_dist=reads_dist, reuse=reuse,
        chunk_rows=t.micro_batch_size if chunked and not reuse else None,
        skip_zero=t.skip_zero_advantage and scheme.row_separable and not synced,
        rm_grad=RM_GRAD in needs,
        # On-policy the update's forward is the rollout policy's, and rollout/entropy comes from it.
        credit_entropy=ENTROPY in needs or not on_policy,
        with_ref=with_ref, trunk=trunk, share_prompts=share,
        share_update_prompts=share and not grad_checkpoint and backend.share_update_prompts, synced_gpus=synced,
        gather_generation=gather, sample_synced=synced and not gather,
        # trainer.deterministic: the dynamic loop, whose draws can come from each response's own generator
        decode="dynamic" if getattr(t, "deterministic", False) else decode_mode(t.decode, t.device != "cpu" and torch.cuda.is_available(),
                                                             synced and not gather),
        keep_completions=keep_completions, head_chunk=head_chunk, grad_checkpoint=grad_checkpoint,
        engine="torch" if engine is None else engine.name, sync_engine=own_weights,
        correction=correction if own_weights else "none", correction_cap=correction_cap, staleness=staleness,
        passes=Passes(t.temperature, t.micro_batch_size, share),
        _chunked=chunked,
    )


# Families whose logits are exactly ``lm_head(last hidden state)`` (no soft-capping or scale)
HEAD_CHUNK_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")


def head_chunk_for(chunk: int | None, policy) -> tuple[int | None, str | None]:
    """``trainer.lm_head_chunk`` for this policy: (chunk, None), or (None, why) where the update
    cannot apply the LM head itself: a family outside :data:`HEAD_CHUNK_MODEL_TYPES`, or
    parameters partitioned over ranks (the head's weight is gathered by the model's own forward)."""
    if chunk is None:
        return None, None
    model_type = getattr(getattr(policy, "config", None), "model_type", None)
    if model_type not in HEAD_CHUNK_MODEL_TYPES:
        return None, f"model type {model_type!r} is not one whose logits are lm_head(hidden): {HEAD_CHUNK_MODEL_TYPES}"
    if partitioned(policy):
        return None, "the policy's parameters are partitioned over ranks (ZeRO-3, FSDP2)"
    return chunk, None
