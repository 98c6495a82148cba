"""Non-finite numbers (NaN, +inf, -inf), caught where they arise in the training spine.

Each helper is a pure tensor function returning the repaired value and a ``(B,)`` bool mask of
the responses it repaired. The trainer collects those masks in a :class:`NonFiniteReport`,
logs its fractions each step and stops the run with :class:`NonFiniteError` when too many
responses of one step were hit (``trainer.max_nonfinite_frac``).

What each stage does with a response hit by a non-finite value:

- ``reward``: its reward-model score or its total reward (after rules) is non-finite. The
  response is dropped from the loss (its mask row is set to False) and the other responses'
  advantages are computed as if it were not in its group: its reward is replaced by the mean
  of its group's finite rewards (so the group mean is unchanged) before
  :func:`datc.math.advantages.group_advantages`, then its own advantage is set to 0. The group std
  still divides by ``G - 1`` (the filled value adds no spread), a slight underestimate of the
  finite rewards' std that keeps ``group_advantages`` untouched. A group with no finite reward
  gets ``A = 0`` everywhere.
- ``advantage``: a non-finite advantage is set to 0 (the response keeps its KL term).
- ``rm_grad``: a response whose reward-model input gradient has a non-finite entry gets a zero
  gradient row (so the credit scheme never sees it) and, after the scheme, ``w = 1``.
- ``weight``: a response with a non-finite credit weight on a valid token gets ``w = 1``.
- ``loss``: a non-finite micro-batch loss is not backpropagated; its responses count as hit.
  (The optimizer separately never steps on a non-finite gradient norm.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# Stages in the order of the spine; a report names the first one that was hit.
SOURCES = ("reward", "advantage", "rm_grad", "weight", "loss")


class NonFiniteError(RuntimeError):
    """Too many responses of one step were hit by NaN or inf; the message names the stage
    where it started, the step and the limit (``trainer.max_nonfinite_frac``)."""


def nonfinite_rows(x: Tensor) -> Tensor:
    """(B,) bool: True where row ``i`` of ``x`` (B, ...) holds a NaN or an inf."""
    return ~torch.isfinite(x).reshape(x.shape[0], -1).all(-1)


def drop_nonfinite_rewards(
    rewards: Tensor, mask: Tensor, num_generations: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Replace each non-finite reward by its group's finite mean and drop it from the loss.

    rewards: (B,) float, groups of ``num_generations`` contiguous responses.
    mask: (B, T) bool response mask used by the loss and the credit.
    Returns ``(filled (B,), mask (B, T) with the bad rows False, bad (B,) bool)``. Pass
    ``bad`` to :func:`zero_nonfinite_advantages` so the dropped responses get ``A = 0``.
    """
    bad = ~torch.isfinite(rewards)  # (B,)
    if not bad.any():
        return rewards, mask, bad
    grouped = rewards.view(-1, num_generations)  # (groups, G)
    ok = ~bad.view(-1, num_generations)
    n_ok = ok.sum(1, keepdim=True)  # (groups, 1)
    # (groups, 1) mean of the finite rewards; 0 for a group with none
    mean = torch.where(ok, grouped, 0.0).sum(1, keepdim=True) / n_ok.clamp(min=1)
    filled = torch.where(ok, grouped, mean.expand_as(grouped)).view(-1)  # (B,)
    return filled, mask & ~bad[:, None], bad


def zero_nonfinite_advantages(
    advantages: Tensor, dropped: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Set non-finite advantages (and those of ``dropped`` responses) to 0.

    advantages: (B,); dropped: (B,) bool or None. Returns ``(advantages (B,), bad (B,) bool)``
    where ``bad`` marks only the non-finite advantages (the dropped ones are counted as rewards).
    """
    bad = ~torch.isfinite(advantages)  # (B,)
    zero = bad if dropped is None else bad | dropped
    return torch.where(zero, 0.0, advantages), bad


def zero_nonfinite_rm_grad(rm_grad: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Zero the rows of the reward-model input gradient (B, T, d) that hold a NaN or inf.

    Returns ``(rm_grad, bad (B,) bool)``, or ``(None, None)`` when there is no gradient (the
    scheme does not declare it). Give ``bad`` to :func:`uniform_nonfinite_weights` so those
    responses get ``w = 1`` whatever the scheme made of the zero row.
    """
    if rm_grad is None:
        return None, None
    bad = nonfinite_rows(rm_grad)  # (B,)
    if not bad.any():
        return rm_grad, bad
    return torch.where(bad[:, None, None], 0.0, rm_grad), bad


def uniform_nonfinite_weights(
    weights: Tensor, fallback: Tensor, mask: Tensor, forced: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``w = 1`` on the valid tokens of each response with a non-finite weight there, or marked
    in ``forced`` (B,) bool; those responses are marked as fallbacks.

    weights: (B, T); fallback: (B,) bool; mask: (B, T) bool. Returns ``(weights, fallback, bad
    (B,) bool)`` where ``bad`` marks only the responses whose weights were non-finite.
    """
    w = weights
    bad = ~(torch.isfinite(w) | ~mask).all(-1)  # (B,) non-finite on a valid token
    reset = bad if forced is None else bad | forced
    if not reset.any():
        return weights, fallback, bad
    uniform = mask.to(w.dtype)  # (B, T): 1 on valid tokens, 0 where masked
    w = torch.where(reset[:, None], uniform, torch.where(mask, w, 0.0))
    return w, fallback | reset, bad


def loss_is_finite(loss: Tensor) -> bool:
    """Whether a scalar micro-batch loss may be backpropagated."""
    return bool(torch.isfinite(loss))


@dataclass
class NonFiniteReport:
    """The responses of one step hit by a non-finite value, per stage: (B,) bool each."""

    batch_size: int
    hits: dict[str, Tensor] = field(default_factory=dict)
    nonfinite_micro_batches: int = 0

    def add(self, source: str, bad: Tensor | None) -> None:
        """Record the (B,) bool mask of responses hit at ``source`` (one of :data:`SOURCES`)."""
        if source not in SOURCES:
            raise ValueError(f"unknown non-finite source {source!r}; one of {SOURCES}")
        if bad is not None:
            prev = self.hits.get(source)
            bad = bad.detach().bool().cpu()
            self.hits[source] = bad if prev is None else prev | bad

    def frac(self, source: str) -> float:
        """Fraction of the step's responses hit at ``source``."""
        bad = self.hits.get(source)
        return float(bad.float().mean()) if bad is not None and bad.numel() else 0.0

    def any_frac(self) -> float:
        """Fraction of the step's responses hit at any stage."""
        if not self.hits:
            return 0.0
        return float(torch.stack(list(self.hits.values())).any(0).float().mean())

    def metrics(self) -> dict[str, float]:
        """The step's counters, in the trainer's metric namespaces."""
        return {
            "reward/nonfinite_frac": self.frac("reward"),
            "reward/nonfinite_adv_frac": self.frac("advantage"),
            "credit/nonfinite_rm_grad_frac": self.frac("rm_grad"),
            "credit/nonfinite_weight_frac": self.frac("weight"),
            "loss/nonfinite_micro_batches": float(self.nonfinite_micro_batches),
        }

    def check(self, max_frac: float, step: int) -> None:
        """Raise :class:`NonFiniteError` if more than ``max_frac`` of the responses were hit."""
        frac = self.any_frac()
        if frac <= max_frac:
            return
        first = next(src for src in SOURCES if self.frac(src) > 0)
        counts = ", ".join(f"{src} {self.frac(src):.0%}" for src in SOURCES if self.frac(src) > 0)
        raise NonFiniteError(
            f"non-finite values (NaN/inf) starting at the {first} stage at training step {step}: "
            f"{frac:.0%} of the step's {self.batch_size} responses were hit ({counts}), more than "
            f"trainer.max_nonfinite_frac={max_frac}; the run stopped (its metrics up to this step "
            "are logged, its last checkpoint is before it). Check the reward model and rules "
            f"(reward), the learning rate and precision (advantage, loss), or raise the limit"
        )
