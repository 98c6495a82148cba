"""Two attribution inputs of credit schemes, computed from the models: the reward model's scores
of edited responses (``RM_EDIT_SCORES``) and the rollout policy's grad × input
(``POLICY_GRAD_X_INPUT``). Shapes: B responses, T response positions (right-padded), P prompt
width, d the policy's hidden size, N edits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import DynamicCache

from datc.batch import Rollout, position_ids
from datc.engines.fast_decode import lean_rm_continuation
from datc.math.logprobs import selective_log_softmax
from datc.models.build import cache_kwarg
from datc.models.rm_inputs import RMInputs
from datc.models.shared_prompt import forward_after_prefix_cache
from datc.rewards.model import as_score, score


def rm_edit_scorer(score_fn: Callable, rm, inputs: RMInputs, response_mask: Tensor, batch_size: int,
                   share: bool = True) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The ``RM_EDIT_SCORES`` input: a function from N edits ``(rows, positions, ids)`` (each
    (N,) long) to the reward model's scores (N,) float32 of the edited responses, response
    ``rows[n]`` with its token at response position ``positions[n]`` set to ``ids[n]``.

    Each edit is the response's own row with one column changed at ``inputs.response_pos`` (the
    sampled ids are never re-tokenized). Batching, decided here once:

    - ``share`` with the stock scorer (:func:`datc.rewards.model.score`): **prefix-cached**
      (:func:`score_edits_after_prefixes`). An edit at column ``c`` leaves columns ``< c`` as
      they were, and a causal reward model's keys and values there do not depend on what
      follows: one cached no-grad forward of the edited responses' own rows, then each edit
      forwards only columns ``c ..`` against that cache, ``rows_per_forward`` edits per forward
      (``batch_size`` when the caller gives none), sorted by column. An edit at response
      position ``t`` of a T-token response costs ``T - t`` token forwards instead of the whole
      response: about half, for edits at every position.
    - otherwise each edited row is scored whole by ``score_fn`` (the session's seam, a test's
      replacement included), ``batch_size`` rows per no-grad forward, each distinct prompt prefix
      of a forward computed once when ``share``.
    """
    cached = share and score_fn is score

    def edit_scores(rows: Tensor, positions: Tensor, ids: Tensor, rows_per_forward: int | None = None) -> Tensor:
        if rows.numel() == 0:
            return torch.zeros(0, dtype=torch.float32, device=response_mask.device)
        rows, positions, ids = (x.to(inputs.input_ids.device) for x in (rows, positions, ids))
        if cached:
            return score_edits_after_prefixes(rm, inputs, rows, positions, ids, rows_per_forward or batch_size)
        edited = inputs.select(rows)
        col = inputs.response_pos[rows, positions]
        edited.input_ids = edited.input_ids.clone()
        edited.input_ids[torch.arange(len(rows), device=col.device), col] = ids
        with torch.no_grad():
            return score_fn(rm, edited, response_mask[rows], with_grad=False, batch_size=rows_per_forward or batch_size,
                            share=share).scores

    return edit_scores


@torch.no_grad()
def score_edits_after_prefixes(rm, inputs: RMInputs, rows: Tensor, positions: Tensor, ids: Tensor,
                               batch_size: int) -> Tensor:
    """(N,) float32: the reward model's scores of N single-token edits (``rows``, ``positions``,
    ``ids``, each (N,) long), the unchanged columns before each edit taken from one cached
    forward of the edited responses' own rows (:func:`datc.models.shared_prompt.forward_after_prefix_cache`).

    Cost: one forward of the distinct rows (L columns each), then the edits sorted by their
    column, ``batch_size`` per forward, each forward from the first column any of its edits
    changes (``cut``) to the read-out: an edit at column ``c`` costs ``L - cut`` token
    forwards, ``L - c`` when many edits share each forward's span of columns (K draws at each of
    a batch's positions: N/``batch_size`` forwards over about L columns). The cache is
    (distinct rows × layers × 2 × L × the key/value width): a few MB per row at a 135M model's
    scale. Equal to scoring each edited row whole, up to float rounding (tested)."""
    emb = rm.get_input_embeddings()
    lean = lean_rm_continuation(rm)  # the testbed's GPT-2: its last block at the read-out only
    uniq, local = torch.unique(rows, return_inverse=True)
    ids_u, mask_u = inputs.input_ids[uniq], inputs.attention_mask[uniq]
    cache = DynamicCache()
    rm(inputs_embeds=emb(ids_u), attention_mask=mask_u.long(), position_ids=position_ids(mask_u), use_cache=True,
       **{cache_kwarg(rm): cache})
    keys_values = [(layer.keys, layer.values) for layer in cache.layers]
    col = inputs.response_pos[rows, positions]
    out = torch.empty(len(rows), dtype=torch.float32, device=rows.device)
    order = torch.argsort(col, stable=True)
    for i in range(0, len(order), batch_size):
        e = order[i : i + batch_size]  # edits of neighbouring columns: the cut is the first's
        cut = int(col[e[0]])
        cont = ids_u[local[e], cut:].clone()
        cont[torch.arange(len(e), device=cont.device), col[e] - cut] = ids[e]
        res = forward_after_prefix_cache(rm, keys_values, local[e], cut, mask_u[local[e]], emb(cont), cont_forward=lean)
        out[e] = as_score(res if lean is not None else res.logits).float()
    return out


def policy_grad_x_input(model, ro: Rollout, temperature: float, micro: int) -> Tensor:
    """(B, T, d) float32: the ``POLICY_GRAD_X_INPUT`` input, ``e ⊙ ∂L/∂e`` with
    ``L = -Σ_t log π(y_t)`` the response's negative log-likelihood at the sampling temperature
    and ``e`` the policy's input embedding at the position that predicts ``y_t`` (column
    ``P - 1 + t`` of ``prompt + response``, as GRAIL's code slices it), 0 at padding.

    One forward and one backward to the input embeddings per ``micro`` rows (no parameter
    gradients: ``torch.autograd.grad`` to the embeddings alone). Each response's loss only reads
    its own row, so the gradient of the batch's summed loss is each row's own."""
    P, T = ro.prompt_ids.shape[1], ro.response_ids.shape[1]
    emb = model.get_input_embeddings()
    out = []
    for i in range(0, ro.response_ids.shape[0], micro):
        ids, am = ro.input_ids[i : i + micro], ro.attention_mask[i : i + micro]
        y, mask = ro.response_ids[i : i + micro], ro.response_mask[i : i + micro]
        with torch.enable_grad():
            e = emb(ids).detach().requires_grad_(True)  # (b, P+T, d) a fresh leaf
            logits = model(inputs_embeds=e, attention_mask=am.long(), position_ids=position_ids(am),
                           logits_to_keep=T + 1).logits[:, :-1].float() / temperature  # (b, T, V)
            nll = -(selective_log_softmax(logits, y) * mask).sum()
            (g,) = torch.autograd.grad(nll, e)
        gx = (g * e.detach())[:, P - 1 : P + T - 1].float()  # (b, T, d) at the positions predicting y_t
        out.append(gx * mask[:, :, None])
    return torch.cat(out)
