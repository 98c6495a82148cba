"""The step's seams: the functions its phases call that a test (or a tool) may replace.

A session holds one :class:`StepOps`; the phases call these fields, never the module functions
directly, so a test injects a sampler, scorer, advantage function, credit function or loss
through the session (``build_session(c, ops=StepOps(score=...))``) instead of patching module
globals. ``observe`` sees each phase's named result as it is made (``"rollout"``, ``"reward"``,
``"credit_inputs"``, ``"credit"``), before the step drops the tensors it no longer needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from datc.credit import compute_credit
from datc.engines.generate import sample_groups
from datc.math.advantages import group_advantages
from datc.math.losses import clipped_policy_loss
from datc.rewards.model import score


def _ignore(phase: str, result: Any) -> None:
    return None


@dataclass(frozen=True)
class StepOps:
    sample: Callable = sample_groups  # datc.engines.generate.sample_groups: one sampling call -> Rollout
    score: Callable = score  # datc.rewards.model.score: the reward model's scores (and input gradient)
    advantages: Callable = group_advantages  # datc.math.advantages.group_advantages: rewards -> A
    credit: Callable = compute_credit  # datc.credit.compute_credit: (scheme, CreditBatch, params) -> CreditOutput
    loss: Callable = clipped_policy_loss  # datc.math.losses.clipped_policy_loss: per-token clipped loss and KL
    observe: Callable[[str, Any], None] = _ignore  # sees each phase's result (see the module docstring)
