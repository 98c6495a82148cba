"""The credit phase: the scheme's token weights ``w`` and the loss's per-token advantages
``Â = A · w`` (METHOD §1), with the inputs the scheme declares and nothing else.

The rollout policy's distribution comes from the sampler's kept logits when the plan reuses
them, else from one no-grad pass of the policy (:class:`datc.forward.passes.Passes`), which also gives
the loss its old log-probs off-policy. A row-local scheme recomputing the logits works one
micro-batch of rows at a time (``plan.chunk_rows``), so the (B, T, V) logits are never all held.
With the zero-advantage skip only the responses with ``A != 0`` are computed
(:func:`datc.step.rows.on_rows`); the others get ``w = 1``, moot since ``A = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.batch import Rollout
from datc.credit import CreditOutput
from datc.credit.base import (
    GOLD_CONTRIB,
    LOGPS_UNDER,
    OLD_LOGPS,
    POLICY_GRAD_X_INPUT,
    POLICY_HIDDEN,
    POLICY_LOGITS,
    PROMPTS,
    RM_EDIT_SCORES,
    RM_SCORES,
    CreditBatch,
    end_of_text,
)
from datc.forward.attribution import policy_grad_x_input, rm_edit_scorer
from datc.forward.passes import scaled
from datc.math.logprobs import entropy_from_logits, selective_log_softmax
from datc.math.numerics import uniform_nonfinite_weights
from datc.step.plan import StepPlan
from datc.step.reward import Rewarded
from datc.step.rows import on_rows


@dataclass
class CreditChunk:
    """The credit inputs of some rows of a rollout (b of them), and what the same policy pass
    gives the loss and the metrics."""

    rows: slice  # which rows of the rollout
    batch: CreditBatch  # the scheme's inputs: exactly the fields it declares (b rows)
    old_logps: Tensor | None  # (b, T) the rollout policy's log-probs, for the loss's ratio; None on-policy without a pass
    entropy: Tensor | None  # (b, T) its entropies (nats), for rollout/entropy; None without a pass


@dataclass
class Credited:
    """The credit phase's result for B responses."""

    credit: CreditOutput  # weights (B, T), scores (B, T) or None, fallback (B,) bool; non-finite weights repaired
    token_adv: Tensor  # (B, T) Â = A · w, the loss's per-token advantages
    old_logps: Tensor | None  # (B, T) the rollout policy's log-probs when the loss needs them (off-policy), else None
    entropy: Tensor | None  # (B, T) its entropies (nats) when a pass made them, else None


def credit_row_slices(plan: StepPlan, B: int) -> list[slice]:
    """The row chunks a step computes credit in (``plan.chunk_rows`` rows each, or all)."""
    rows = plan.chunk_rows or max(B, 1)
    return [slice(i, i + rows) for i in range(0, B, rows)]


def credit_inputs(s, ro: Rollout, rw: Rewarded, rows: slice, plan: StepPlan, generator: torch.Generator | None,
                  needs: frozenset[str] | None = None) -> CreditChunk:
    """The :class:`CreditBatch` for rows ``rows`` of ``ro``: the inputs the scheme declares
    (``needs``, default the session scheme's) and nothing else."""
    m, p = s.m, plan.passes
    needs = s.scheme.needs if needs is None else needs
    B = ro.response_ids.shape[0]
    sub = ro if rows.start in (None, 0) and (rows.stop is None or rows.stop >= B) else ro.select(rows)
    old_logps = entropy = logits = credit_old_logps = hidden = None
    if plan.reuse:  # the rollout distribution as generate computed it: no second forward pass
        logits = scaled(sub.logits, p.temperature)
        entropy = entropy_from_logits(logits) if plan.credit_entropy else None
        credit_old_logps = selective_log_softmax(logits, sub.response_ids) if OLD_LOGPS in needs else None
    elif not plan.on_policy or plan.wants_dist:
        pol = p.rollout_pass(m.policy, sub, POLICY_LOGITS in needs, POLICY_HIDDEN in needs,
                             with_entropy=plan.credit_entropy)
        old_logps, entropy, logits, hidden = pol
        credit_old_logps = old_logps
    prompts = [m.encoder.text(ex) for ex in sub.examples] if PROMPTS in needs else None
    logps_under = p.logps_under(m.policy, m.tok, sub, m.encoder) if LOGPS_UNDER in needs else None
    mask = rw.mask[rows]
    edit_scores = (rm_edit_scorer(s.ops.score, m.rm, m.score_inputs(sub), mask, p.micro, p.share)
                   if RM_EDIT_SCORES in needs else None)
    gold_contrib = rw.gold_contrib[rows].to(mask.device) if GOLD_CONTRIB in needs and rw.gold_contrib is not None else None
    batch = CreditBatch(
        response_ids=sub.response_ids, response_mask=mask, advantages=rw.advantages[rows],
        rm_grad=rw.rm_grad[rows] if rw.rm_grad is not None else None, rm_embedding=s.rm_embedding,
        policy_logits=logits, entropy=entropy, old_logps=credit_old_logps, prompts=prompts,
        logps_under=logps_under, policy_hidden=hidden, gold_contrib=gold_contrib,
        rm_scores=rw.scores[rows] if RM_SCORES in needs else None, rm_edit_scores=edit_scores,
        policy_grad_x_input=(policy_grad_x_input(m.policy, sub, p.temperature, p.micro)
                             if POLICY_GRAD_X_INPUT in needs else None),
        response_end=end_of_text(mask, sub.truncated), generator=generator,
        all_sum=s.dist.tensor_sum if s.dist.world_size > 1 else None,  # "global" = the global batch
        all_cat=s.dist.tensor_cat if s.dist.world_size > 1 else None,
    )
    chunk = CreditChunk(rows, batch, old_logps, entropy)
    s.ops.observe("credit_inputs", chunk)
    return chunk


def _cat(parts: list[Tensor | None]) -> Tensor | None:
    return torch.cat(parts) if parts and parts[0] is not None else None


def _computed(s, it: int, ro: Rollout, rw: Rewarded, plan: StepPlan, rows: Tensor | None) -> dict[str, Tensor | None]:
    """The scheme's credit for responses ``rows`` (None: all), chunk by chunk, with the old
    log-probs and entropies of the same policy pass. Random schemes draw from a generator
    seeded by (seed, step)."""
    generator = torch.Generator().manual_seed(s.c.seed * 1_000_003 + it)
    ro_c, rw_c = (ro, rw) if rows is None else (ro.select(rows), rw.select(rows))
    weights, scores, fallback, old, ent = [], [], [], [], []
    for sl in credit_row_slices(plan, ro_c.response_ids.shape[0]):
        chunk = credit_inputs(s, ro_c, rw_c, sl, plan, generator)
        out = s.ops.credit(s.scheme, chunk.batch, s.credit_params)
        weights.append(out.weights), scores.append(out.scores), fallback.append(out.fallback)
        old.append(chunk.old_logps), ent.append(chunk.entropy)
        chunk = None  # this chunk's credit inputs (its (b, T, V) logits) are spent
    return {"weights": torch.cat(weights), "scores": _cat(scores), "fallback": torch.cat(fallback),
            "normalization": out.normalization, "old_logps": _cat(old), "entropy": _cat(ent)}


def _left_out_pass(s, ro: Rollout, plan: StepPlan, rows: Tensor | None) -> dict[str, Tensor | None]:
    """The old log-probs and entropies of responses ``rows`` (None: all), one no-grad pass."""
    pol = plan.passes.rollout_pass(s.m.policy, ro if rows is None else ro.select(rows))
    return {"old_logps": pol.logps, "entropy": pol.entropy}


def assign_credit(s, it: int, ro: Rollout, rw: Rewarded, plan: StepPlan) -> Credited:
    """The scheme's token weights for the responses ``rw.credited`` (every response unless the
    zero-advantage skip applies); a response left out gets ``w = 1`` on its valid tokens and
    score 0, marked as a fallback, as DATC itself treats a zero advantage. Then the ``weight``
    stage's guard: a response with a non-finite weight (or a zeroed rm_grad row) gets ``w = 1``.

    With rows left out, on-policy the loss's old log-probs are the current ones for every
    response (ratio 1) and ``rollout/entropy`` comes from the update's forward; off-policy one
    no-grad pass over the left-out responses gives their old log-probs and entropies."""
    B, T = rw.mask.shape
    keep = rw.credited.nonzero().squeeze(-1)  # (k,) the responses whose credit is computed
    by_scores = s.scheme.output == "scores"
    rest = {"weights": rw.mask.float(), "fallback": torch.ones(B, dtype=torch.bool, device=rw.mask.device),
            "scores": rw.mask.new_zeros(B, T, dtype=torch.float32) if by_scores else None,
            "normalization": "per_response" if by_scores else s.scheme.normalization}
    if len(keep) < B:  # the left-out rows' old log-probs and entropies (off-policy)
        rest["old_logps"] = rest["entropy"] = None
        if not plan.on_policy:
            rest |= on_rows((~rw.credited).nonzero().squeeze(-1), B, lambda rows: _left_out_pass(s, ro, plan, rows), rest)
    out = on_rows(keep, B, lambda rows: _computed(s, it, ro, rw, plan, rows), rest)
    if len(keep) < B and plan.on_policy:
        out["old_logps"] = out["entropy"] = None
    weights, fallback, bad_weight = uniform_nonfinite_weights(out["weights"], out["fallback"], rw.mask,
                                                              forced=rw.bad_rm_grad)
    rw.nonfinite.add("weight", bad_weight)
    credit = CreditOutput(weights, out["scores"], fallback, out["normalization"])
    cr = Credited(credit, rw.advantages[:, None] * weights, out["old_logps"], out["entropy"])
    s.ops.observe("credit", cr)
    return cr

