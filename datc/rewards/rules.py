"""Rule-based rewards, added to the reward model's score with a weight each
(``reward.rules: [{name: length, weight: -0.1}]``). A rule maps the rollout to one float
per response; register a new one with ``@RULES.register("name")``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from datc.registry import Registry


@dataclass
class RuleContext:
    response_mask: torch.Tensor  # (B, T) bool
    truncated: torch.Tensor  # (B,) bool, True where the response hit max_new_tokens without EOS
    gold: torch.Tensor | None  # (B,) gold reward on testbed tasks, else None
    examples: list[dict[str, Any]]  # the prompt rows, one per response


RULES: Registry[Callable[[RuleContext], torch.Tensor]] = Registry("reward rule")


@RULES.register("length")
def length(ctx: RuleContext) -> torch.Tensor:
    """Response length as a fraction of the token budget, in [0, 1]."""
    return ctx.response_mask.float().sum(-1) / ctx.response_mask.shape[-1]


@RULES.register("truncated")
def truncated(ctx: RuleContext) -> torch.Tensor:
    """1 for a response that ran out of budget before EOS (use a negative weight)."""
    return ctx.truncated.float()


@RULES.register("gold")
def gold(ctx: RuleContext) -> torch.Tensor:
    """The testbed's gold reward itself (an oracle, for ablations without reward hacking)."""
    if ctx.gold is None:
        raise ValueError("reward rule 'gold' needs a testbed task (data.task); this dataset has no gold reward")
    return ctx.gold


def check_rules(c) -> None:
    """``reward.rules``: each a registered rule (before any model loads)."""
    from datc.errors import ConfigError

    for i, rule in enumerate(c.reward.rules):
        if rule.name not in RULES:
            raise ConfigError(f"reward.rules[{i}].name: {rule.name!r} is unknown; choose one of {', '.join(RULES.names())}")
