"""``grail``: GRAIL's saliency weights (arXiv 2606.04889; code ``declare-lab/grail``,
``src/train/grail_trainer.py``, ``compute_grail_weights``), multiplied into the token advantages.

Matched to the published code (read at commit 749aa4c):

- the saliency is grad × input of the policy: ``s_t = ‖e ⊙ ∂L/∂e‖₂`` with ``L = -Σ log π(y)``
  the negative log-likelihood of the answer tokens at the sampling temperature and ``e`` the
  policy's input embedding (``grail_leaf_source: embeddings``), read at the input position that
  predicts ``y_t`` (the code's slice ``grads[:, -(T+1):-1]``: the prompt's last token for the
  first response token, else the previous response token); the ``policy_grad_x_input`` input;
- log-z-scoring over each response's valid tokens: ``z = (log(s + 1e-8) - μ) / sqrt(σ² + 1e-8)``
  (population variance), ``w = clamp(mean + z · std, w_min, w_max)``, no renormalization (a
  response's mean weight is not 1), padding 0;
- ``rollout_symmetry``: ``both`` reweights every response, ``correct`` only those with
  ``A > 0``, ``wrong`` only those with ``A <= 0`` (the others get ``w = 1``), as the code's
  fallback does.

Defaults: ``mean 1``, ``w_min 0.1``, ``w_max 5`` (the code's config defaults) and ``std 0.5`` (the
published training config's and its token analysis's; the code has no default), ``symmetry
both`` (the code's default; its training config uses ``wrong``).

What had to differ in this outcome-reward setting: GRAIL's "answer" is the ``\\boxed{}`` span of
a math solution, whose tokens then get ``w_max`` and the span's boundary and later tokens
``mean``; a response here has no marked answer (the reward model scores it whole), so the
answer is the whole response (``L`` sums every valid token's NLL) and no span override
applies. The code computes the weights in every micro-batch from the policy being updated; here
they are computed once per rollout batch from ``π_old`` (METHOD §1; identical on the first
on-policy epoch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from datc.credit import register_credit
from datc.credit.base import POLICY_GRAD_X_INPUT, CreditBatch

SYMMETRIES = ("both", "correct", "wrong")


@dataclass
class GrailParams:
    std: float = 0.5  # spread sigma_w of the weights around mean (grail_std)
    mean: float = 1.0  # weight of a token of average log-saliency (grail_mean)
    w_min: float = 0.1  # lower clamp (grail_w_min)
    w_max: float = 5.0  # upper clamp (grail_w_max)
    rollout_symmetry: str = "both"  # both | correct (A > 0 only) | wrong (A <= 0 only)

    def __post_init__(self) -> None:
        for name in ("std", "mean", "w_min", "w_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not self.w_min <= self.mean <= self.w_max:
            raise ValueError(f"need w_min <= mean <= w_max, got {self.w_min}, {self.mean}, {self.w_max}")
        if self.rollout_symmetry not in SYMMETRIES:
            raise ValueError(f"rollout_symmetry must be one of {SYMMETRIES}, got {self.rollout_symmetry!r}")


def grail_weights(saliency: Tensor, mask: Tensor, advantages: Tensor, p: GrailParams) -> Tensor:
    """(B, T) GRAIL weights from saliencies ``s`` (B, T) >= 0 (the code's formulas; see the
    module docstring), 0 at padding."""
    m = mask.to(saliency.dtype)
    log_s = torch.log(torch.where(mask, saliency, 1.0) + 1e-8)
    n = m.sum(-1, keepdim=True).clamp(min=1.0)
    mu = (log_s * m).sum(-1, keepdim=True) / n
    sd = torch.sqrt((((log_s - mu) ** 2) * m).sum(-1, keepdim=True) / n + 1e-8)
    w = (p.mean + (log_s - mu) / sd * p.std).clamp(p.w_min, p.w_max)
    keep = {"both": torch.ones_like(advantages, dtype=torch.bool), "correct": advantages > 0,
            "wrong": advantages <= 0}[p.rollout_symmetry]
    w = torch.where(keep[:, None], w, torch.ones_like(w))
    return w * m


@register_credit("grail", needs={POLICY_GRAD_X_INPUT}, output="weights", normalization="none", params=GrailParams,
                 row_local=True, row_separable=True)  # per-response weights from each response's own pass
def grail(batch: CreditBatch, params: GrailParams) -> Tensor:
    """Policy grad × input saliency of each token's input, log-z-scored into clamped weights."""
    saliency = batch.policy_grad_x_input.double().norm(dim=-1)  # (B, T)
    return grail_weights(saliency, batch.response_mask, batch.advantages, params).float()
