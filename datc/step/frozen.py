"""The frozen models' passes: the reference's log-probs and the reward model's scores (and its
input-embedding gradient) for one rollout batch, behind one call with one named result.

When the reward model shares its lower blocks with the reference (``plan.trunk``,
:mod:`datc.forward.trunk`), one reference pass gives both; otherwise the reward model scores the
responses (:func:`datc.rewards.model.score`, through the session's ``ops.score``) and the
reference makes its own no-grad pass. With the zero-advantage skip (``plan.skip_zero``), the
groups whose responses are all the same token ids (identical inputs: equal rewards, ``A = 0``)
get no backward (``grad_rows``); :func:`rm_grad_rows` fills in any response that still gets
``A != 0`` (a reward model that is not batch-invariant).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.batch import Rollout
from datc.forward.trunk import reference_and_score
from datc.step.plan import StepPlan


@dataclass
class Frozen:
    """The frozen models' outputs for B responses, as they computed them (may hold NaN/inf)."""

    scores: Tensor  # (B,) the reward model's scores
    rm_grad: Tensor | None  # (B, T, d) its input-embedding gradient at each response token; None unless planned
    grad_rows: Tensor | None  # (B,) bool, the responses that got a backward (None: all of them)
    ref_logps: Tensor | None  # (B, T) the reference's log-probs of the sampled ids; None without a reference


def identical_groups(ro: Rollout, num_generations: int) -> Tensor:
    """(B,) bool: True for the responses of each group whose responses are all the same token ids."""
    ids = torch.where(ro.response_mask, ro.response_ids, -1).view(-1, num_generations, ro.response_ids.shape[1])
    same = (ids == ids[:, :1]).all(-1).all(-1)  # (groups,)
    return same.repeat_interleave(num_generations)


def frozen_passes(s, ro: Rollout, plan: StepPlan) -> Frozen:
    """The reference's and the reward model's passes over ``ro``, as the plan says."""
    m, p = s.m, plan.passes
    grad_rows = ~identical_groups(ro, s.c.trainer.num_generations) if plan.skip_zero and plan.rm_grad else None
    if plan.trunk and plan.with_ref and ro.prompt_ids.shape[1] > 1:
        ref_logps, out = reference_and_score(m.ref, m.rm, plan.trunk, ro, p.temperature, p.micro,
                                             with_grad=plan.rm_grad, grad_rows=grad_rows)
        return Frozen(out.scores, out.grad, grad_rows, ref_logps)
    out = s.ops.score(m.rm, m.score_inputs(ro), ro.response_mask, with_grad=plan.rm_grad, batch_size=p.micro,
                      grad_rows=grad_rows, share=p.share)
    ref_logps = p.rollout_pass(m.ref, ro, with_entropy=False).logps if plan.with_ref else None
    return Frozen(out.scores, out.grad, grad_rows, ref_logps)


def rm_grad_rows(s, ro: Rollout, rows: Tensor | None, plan: StepPlan) -> Tensor:
    """(k, T, d) the reward model's input-embedding gradient for responses ``rows`` (k,) long
    (None: every response, (B, T, d))."""
    m, p = s.m, plan.passes
    inputs, mask = (m.score_inputs(ro), ro.response_mask) if rows is None else (
        m.score_inputs(ro).select(rows), ro.response_mask[rows])
    return s.ops.score(m.rm, inputs, mask, with_grad=True, batch_size=p.micro, share=p.share).grad
