"""The credit-scheme interface: what a scheme receives, declares and returns.

A credit scheme is exactly the function that produces the token weights ``w`` in
``Â_{i,t} = A_i · w_{i,t}`` (METHOD §1). Every scheme has one signature::

    fn(batch: CreditBatch, params) -> Tensor  # (B, T) scores or weights, no gradient

and declares (``needs``) which optional fields of :class:`CreditBatch` it reads. The trainer
fills exactly those fields and never branches on a scheme's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

# ---- the optional inputs a scheme may declare ------------------------------------------------
RM_GRAD = "rm_grad"  # (B, T, d_rm) dR/dh_t: reward-model input-embedding gradient per response token
RM_EMBEDDING = "rm_embedding"  # (V, d_rm) the reward model's input-embedding matrix E
POLICY_LOGITS = "policy_logits"  # (B, T, V) rollout-policy logits z_t (already divided by temperature)
ENTROPY = "entropy"  # (B, T) entropy of the rollout policy at each response position, nats
OLD_LOGPS = "old_logps"  # (B, T) log pi_old(y_t)
PROMPTS = "prompts"  # list of B prompt texts, the one each response was sampled for
# callable: prompts (B texts) -> (B, T) log pi_old(y_t | x', y_<t), the sampled ids under other
# prompts (one no-grad rollout-policy pass per call; same temperature as OLD_LOGPS)
LOGPS_UNDER = "logps_under"
# (B, T, d_policy) the rollout policy's LM-head input h_t at the position that predicts y_t
# (last hidden state, after the final norm; logits z_t = lm_head(h_t) / temperature)
POLICY_HIDDEN = "policy_hidden"
# (B, T) the task's per-token gold contribution c_t (testbed tasks and reviews; 0 on padding).
# A run whose task has none (a real dataset) is refused before any model loads.
GOLD_CONTRIB = "gold_contrib"
RM_SCORES = "rm_scores"  # (B,) the reward model's score R(x, y) of each response, as sampled
# callable: (rows (N,) long, positions (N,) long, ids (N,) long) -> (N,) float32, the reward
# model's scores of N edited responses, edit n being response rows[n] with its token at response
# position positions[n] replaced by ids[n] (no-grad forwards, batched; see datc.forward.attribution)
RM_EDIT_SCORES = "rm_edit_scores"
# (B, T, d_policy) grad x input of the rollout policy: e ⊙ ∂(-Σ_t log π(y_t))/∂e, at the input
# embedding e of the position that predicts y_t (the prompt's last token for t = 0, else y_{t-1})
POLICY_GRAD_X_INPUT = "policy_grad_x_input"
NEEDS = frozenset({RM_GRAD, RM_EMBEDDING, POLICY_LOGITS, ENTROPY, OLD_LOGPS, PROMPTS, LOGPS_UNDER,
                   POLICY_HIDDEN, GOLD_CONTRIB, RM_SCORES, RM_EDIT_SCORES, POLICY_GRAD_X_INPUT})

Output = Literal["scores", "weights"]
Normalization = Literal["per_response", "global", "none"]


@dataclass
class CreditBatch:
    """One rollout batch's tensors, as a credit scheme sees them. Shapes: B responses, T
    response positions (right-padded), V vocabulary, d reward-model hidden size."""

    response_ids: Tensor  # (B, T) long, sampled token ids y_t
    response_mask: Tensor  # (B, T) bool, True on valid (unpadded) response tokens
    advantages: Tensor  # (B,) float, group advantages A_i
    rm_grad: Tensor | None = None  # (B, T, d), see RM_GRAD
    rm_embedding: Tensor | None = None  # (V, d), see RM_EMBEDDING
    policy_logits: Tensor | None = None  # (B, T, V), see POLICY_LOGITS
    entropy: Tensor | None = None  # (B, T), see ENTROPY
    old_logps: Tensor | None = None  # (B, T), see OLD_LOGPS
    prompts: list[str] | None = None  # B texts, see PROMPTS
    logps_under: Callable[[list[str]], Tensor] | None = None  # see LOGPS_UNDER
    policy_hidden: Tensor | None = None  # (B, T, d_policy), see POLICY_HIDDEN
    gold_contrib: Tensor | None = None  # (B, T), see GOLD_CONTRIB
    rm_scores: Tensor | None = None  # (B,), see RM_SCORES
    rm_edit_scores: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None  # see RM_EDIT_SCORES
    policy_grad_x_input: Tensor | None = None  # (B, T, d_policy), see POLICY_GRAD_X_INPUT
    # (B, T) bool: each response's end-of-text token (its last valid token, where it ended within its
    # budget; none in a truncated response). Always filled by the trainer: the weight step's
    # ``end_token`` option reads it (datc.credit.weights).
    response_end: Tensor | None = None
    generator: torch.Generator | None = None  # for schemes that draw random numbers
    # Data-parallel runs (several processes, each with its share of the batch): the sum of a
    # tensor over the processes, and the concatenation of 1-D tensors over them. None with one
    # process. Schemes with a "global" normalization reduce through rank_sum / rank_cat, so their
    # batch is the global one; every process must then make the same calls.
    all_sum: Callable[[Tensor], Tensor] | None = None
    all_cat: Callable[[Tensor], Tensor] | None = None

    def rank_sum(self, x: Tensor) -> Tensor:
        """``x`` summed over the data-parallel processes (``x`` itself with one process)."""
        return x if self.all_sum is None else self.all_sum(x)

    def rank_cat(self, x: Tensor) -> Tensor:
        """1-D ``x`` of every process, concatenated in rank order (``x`` with one process)."""
        return x if self.all_cat is None else self.all_cat(x)


def end_of_text(mask: Tensor, truncated: Tensor) -> Tensor:
    """(B, T) bool: the last valid token of each response that did not run out of budget
    (``truncated`` (B,) bool), which is its end-of-text token; False everywhere else."""
    m = mask.bool()
    last = m.long().cumsum(-1) == m.sum(-1, keepdim=True)
    return m & last & ~truncated.bool().to(m.device)[:, None]


@dataclass
class CreditOutput:
    """What the trainer gets back from :func:`datc.credit.compute_credit`."""

    weights: Tensor  # (B, T) float, 0 on masked positions; Â = A · w
    scores: Tensor | None  # (B, T) raw scores s_t for score-based schemes (diagnostics), else None
    fallback: Tensor  # (B,) bool, True where a response fell back to w = 1
    normalization: Normalization  # how the weights are normalized (per_response, global, none)


@dataclass
class NoParams:
    """A scheme without parameters."""


@dataclass(frozen=True)
class CreditScheme:
    name: str
    fn: Callable[[CreditBatch, Any], Tensor]
    needs: frozenset[str]
    output: Output  # "scores": shared weight step (METHOD §2.5) turns them into weights
    normalization: Normalization  # for output="weights": how the scheme normalizes
    params: type = NoParams  # dataclass of the scheme's config fields (with defaults)
    doc: str = ""
    # True when a response's output depends only on that response's rows of the batch (per-token
    # closed forms, per-response normalization): the trainer may then run the scheme one
    # micro-batch of rows at a time and never hold all (B, T, V) policy logits. Never for schemes
    # that compare responses (global normalization, batch statistics).
    row_local: bool = False
    # True when a response's output is a function of that response's rows alone, random draws
    # included: leaving other responses out of the batch changes it not at all. The trainer then
    # computes credit only for the responses with a non-zero advantage
    # (trainer.skip_zero_advantage; the others get w = 1, moot since A = 0). Implies row_local.
    # False for schemes that compare responses (their batch-wide statistics must see every
    # response, so they are computed in full) and for ones that draw random numbers for the rows
    # in turn (datc_shuffled: a left-out row would shift the others' draws).
    row_separable: bool = False

    def make_params(self, fields: dict[str, Any]) -> Any:
        """Build the params dataclass from config fields; unknown fields are a clear error."""
        valid = {f.name for f in dataclasses.fields(self.params)}
        unknown = sorted(set(fields) - valid)
        if unknown:
            raise ValueError(
                f"credit scheme {self.name!r} has no field(s) {unknown}; "
                f"valid fields: {sorted(valid) or 'none'}"
            )
        return self.params(**fields)
