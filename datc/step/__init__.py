"""The training step, top to bottom: rollout → frozen passes → reward → credit → loss and update
→ metrics. Each phase is one module with a named result; :func:`train_step` calls them in the
order of the spine. Every special case of the step was decided once, in the session's
:class:`datc.step.plan.StepPlan`, which each phase reads.

Shapes: B responses on this rank (whole groups of G, contiguous), T response positions
(right-padded), V vocabulary, d the reward model's hidden size.

| phase | module | result |
|---|---|---|
| rollout | :mod:`datc.step.sample` (when, and with which weights: :mod:`datc.step.stream`) | :class:`datc.batch.Rollout` |
| frozen passes | :mod:`datc.step.frozen` | :class:`datc.step.frozen.Frozen` (reference log-probs, RM scores and gradient) |
| reward | :mod:`datc.step.reward` | :class:`datc.step.reward.Rewarded` (rewards, advantages, loss mask) |
| credit | :mod:`datc.step.credit` | :class:`datc.step.credit.Credited` (weights, ``Â = A · w``) |
| loss and update | :mod:`datc.step.update` | the ``loss/`` figures |
| metrics | :mod:`datc.step.metrics` | the step's metrics |
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from datc.batch import Rollout
from datc.math.numerics import NonFiniteReport
from datc.run.completions import completions_of
from datc.step.credit import assign_credit
from datc.step.frozen import frozen_passes
from datc.step.metrics import step_metrics
from datc.step.reward import reward
from datc.step.update import LossInputs, update


@dataclass
class StepResult:
    """What one step hands back to the loop."""

    metrics: dict[str, float]  # reward/, rollout/, credit/, loss/, nonfinite/ and perf/ figures (over ranks)
    nonfinite: NonFiniteReport  # this rank's non-finite hits (the loop merges them over ranks)
    completions: Any = None  # datc.run.completions.Completions for the eval's completions table, on the step before an eval


def train_step(s, it: int) -> StepResult:
    """One iteration of the spine on this rank's share of the step's prompts (whole groups)."""
    with s.autocast():
        t0 = time.perf_counter()
        ro = s.stream.take(s, it)  # sampled now, or ahead by the engine (rollout.max_staleness, datc.step.stream)
        return learn(s, it, ro, t0)


def learn(s, it: int, ro: Rollout, t0: float) -> StepResult:
    """Everything after the rollout: frozen passes → reward → credit → update → metrics.
    ``t0``: when the step began (``perf/`` times). A rollout that kept the sampler's logits
    (``ro.logits``) gives the credit its rollout distribution without another pass."""
    t = s.c.trainer
    plan = s.plan.given(ro.logits is not None)
    t1 = time.perf_counter()
    fz = frozen_passes(s, ro, plan)  # the frozen models, once
    rw = reward(s, ro, fz, plan)
    t2 = time.perf_counter()
    cr = assign_credit(s, it, ro, rw, plan)
    completions = None
    if plan.completions_at(it + 1, t.eval_every, t.steps):
        completions = completions_of(s.m.tok, [s.m.encoder.text(ex) for ex in ro.examples], ro.response_ids, rw.mask,
                                     rw.rewards, rw.advantages, cr.credit.weights, s.c.logger.log_samples)
    # The credit inputs are spent: free generate's (B, T, V) logits and the RM gradients before
    # the update's own activations (at a real vocabulary they are the step's largest tensors).
    ro.logits = rw.rm_grad = fz.rm_grad = None
    t3 = time.perf_counter()
    stats = update(s, LossInputs(ro, rw.mask, cr.token_adv, cr.old_logps, fz.ref_logps, rw.nonfinite), plan)
    t4 = time.perf_counter()
    return StepResult(step_metrics(s, ro, rw, cr, stats, (t0, t1, t2, t3, t4)), rw.nonfinite, completions)
