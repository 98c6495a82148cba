"""The reward phase: the frozen models' scores plus the rules, turned into group advantages,
with the non-finite guards of :mod:`datc.math.numerics` (reward, advantage and rm_grad stages)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.batch import Rollout
from datc.math.numerics import (
    NonFiniteReport,
    drop_nonfinite_rewards,
    zero_nonfinite_advantages,
    zero_nonfinite_rm_grad,
)
from datc.rewards.rules import RULES, RuleContext
from datc.step.frozen import Frozen, rm_grad_rows
from datc.step.plan import StepPlan
from datc.step.rows import on_rows
from datc.tasks import gold_of


@dataclass
class Rewarded:
    """The reward phase's result for B responses, non-finite values already repaired."""

    scores: Tensor  # (B,) the reward model's scores, as it gave them (may hold NaN/inf)
    rewards: Tensor  # (B,) reward.scale · scores + weighted rules, as computed (may hold NaN/inf)
    advantages: Tensor  # (B,) group advantages, finite: 0 for responses with a non-finite reward or advantage
    mask: Tensor  # (B, T) bool loss mask: the given mask minus responses with a non-finite reward
    rm_grad: Tensor | None  # (B, T, d) the RM's input-embedding gradient, non-finite rows zeroed; None unless planned
    bad_rm_grad: Tensor | None  # (B,) bool, responses whose rm_grad row was zeroed (they get w = 1)
    gold: Tensor | None  # (B,) gold reward on a testbed task (on the CPU), else None
    gold_contrib: Tensor | None  # (B, T) per-token gold contribution, 0 on padding; or None
    rule_metrics: dict[str, float]  # reward/rule_<name>: mean of each rule's term
    nonfinite: NonFiniteReport  # hits at the reward, advantage and rm_grad stages
    credited: Tensor  # (B,) bool, the responses the credit phases work on: all, or those with A != 0 (skip_zero)

    def select(self, rows: Tensor) -> Rewarded:
        """Responses ``rows`` (k,) long; the rule metrics and the non-finite report stay the step's."""
        def pick(x):
            return None if x is None else x[rows.to(x.device)]

        return Rewarded(pick(self.scores), pick(self.rewards), pick(self.advantages), pick(self.mask),
                        pick(self.rm_grad), pick(self.bad_rm_grad), pick(self.gold), pick(self.gold_contrib),
                        self.rule_metrics, self.nonfinite, pick(self.credited))


def loss_mask(t, ro: Rollout) -> Tensor:
    """(B, T) bool: the response tokens the loss may use, before the non-finite guards."""
    mask = ro.response_mask
    if t.mask_truncated:  # TRL's mask_truncated_completions: no loss on unfinished responses
        mask = mask & ~ro.truncated[:, None]
    return mask


def reward(s, ro: Rollout, fz: Frozen, plan: StepPlan, mask: Tensor | None = None, shaped: bool = True) -> Rewarded:
    """Rewards ``reward.scale · score + Σ weight · rule`` of the responses (``shaped=False``: the
    reward model's score alone, as the credit analysis judges credit against the model it
    differentiates), their group advantages and the loss mask (default :func:`loss_mask`).

    With the zero-advantage skip the credit phases work only on the responses with ``A != 0``
    (``credited``); any of them whose group got no backward in the frozen pass (``fz.grad_rows``)
    has its gradient computed now. Other responses with ``A = 0`` (rewards tied by value,
    non-finite rewards) keep theirs, unused."""
    c, t = s.c, s.c.trainer
    mask = loss_mask(t, ro) if mask is None else mask
    gold, gold_contrib = (gold_of(s.assets.task, s.m.tok, ro.examples, ro.response_ids, ro.response_mask)
                          if s.assets.task is not None else (None, None))
    rewards = c.reward.scale * fz.scores if shaped else fz.scores
    rule_metrics = {}
    if shaped and c.reward.rules:
        ctx = RuleContext(ro.response_mask, ro.truncated, gold, ro.examples)
        for rule in c.reward.rules:
            r = RULES.get(rule.name)(ctx).to(rewards)
            rewards = rewards + rule.weight * r
            rule_metrics[f"reward/rule_{rule.name}"] = float(r.mean())
    nf = NonFiniteReport(len(rewards))  # NaN/inf caught per stage (datc.math.numerics)
    finite_rewards, mask, bad_reward = drop_nonfinite_rewards(rewards, mask, t.num_generations)
    nf.add("reward", bad_reward)
    advantages = s.ops.advantages(finite_rewards, t.num_generations, t.scale_rewards)
    advantages, bad_adv = zero_nonfinite_advantages(advantages, dropped=bad_reward)
    nf.add("advantage", bad_adv)
    credited = advantages != 0 if plan.skip_zero else torch.ones_like(advantages, dtype=torch.bool)
    rm_grad = fz.rm_grad
    if fz.grad_rows is not None and (missing := credited & ~fz.grad_rows).any():  # an RM that is not batch-invariant
        rm_grad = on_rows(missing.nonzero().squeeze(-1), len(credited),
                          lambda rows: {"rm_grad": rm_grad_rows(s, ro, rows, plan)}, {"rm_grad": rm_grad})["rm_grad"]
    rm_grad, bad_rm_grad = zero_nonfinite_rm_grad(rm_grad)
    nf.add("rm_grad", bad_rm_grad)
    rw = Rewarded(fz.scores, rewards, advantages, mask, rm_grad, bad_rm_grad, gold, gold_contrib, rule_metrics, nf,
                  credited)
    s.ops.observe("reward", rw)
    return rw
