"""The reference and the reward model's shared frozen trunk: one pass gives both.

A reward model made from the policy and trained in its top blocks only (``reward.init:
policy`` with ``reward.train.trainable_layers``) keeps the policy's input embeddings and lower
blocks as they were, and the frozen reference *is* that policy: over the same token ids (a
reward model scored on the policy's own prompt ids, ``reward.chat_template: false``) the two
models compute the same hidden states up to the first block they do not share. So the
reference's forward (which a KL term needs anyway) is run once, its log-probs taken, and the
reward model's own top blocks are run from the reference's hidden state at that depth: the
reward model's lower blocks are never run (at SmolLM2-135M with 6 of 30 blocks trained, 24/30
of its forward). For DATC's input gradient the reference's continuation is forwarded with a
graph from its input embeddings (the reward model's, equal), and the score's backward goes
through the reward model's top blocks and then the shared trunk.

The sharing is found, not configured: :func:`shared_trunk_depth` compares the two models'
configurations (but for their heads) and parameters block by block; anything unequal ends the
trunk there (0: no sharing, and the trainer's plain passes are used). The results are the
plain passes' up to float rounding (the trunk runs in the reference's layout: the prompt but its
last token shared, :mod:`datc.models.shared_prompt`). ``trainer.share_trunk: false`` turns it off.

Shapes: B rows, P prompt width (left-padded), T response positions (right-padded), d hidden.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from datc.backends.plugins import partitioned
from datc.batch import Rollout
from datc.forward.passes import scaled
from datc.math.logprobs import selective_log_softmax
from datc.models.lora import trunk_tensors
from datc.models.rm_inputs import left_align_index
from datc.models.shared_prompt import forward_after_prompts, prompt_groups
from datc.rewards.model import RMScore, as_score, rows_by_gradient

# Decoder-only families whose base model runs ``inputs_embeds`` through its blocks unchanged
# (no embedding scale, as Gemma has) and selects its blocks from ``base_model.layers``.
TRUNK_MODEL_TYPES = ("llama", "mistral", "qwen2")

# Configuration keys that describe a model's head or bookkeeping, not its trunk.
_HEAD_KEYS = {
    "architectures", "num_labels", "id2label", "label2id", "problem_type", "_name_or_path", "transformers_version",
    "tie_word_embeddings", "num_hidden_layers", "layer_types", "use_cache", "output_hidden_states",
    "output_attentions", "return_dict", "torch_dtype", "dtype", "pad_token_id", "bos_token_id", "eos_token_id",
    "task_specific_params", "finetuning_task", "_commit_hash", "classifier_dropout",
}


def _trunk_config(model) -> dict:
    d = model.config.to_dict()
    d["_attn"] = getattr(model.config, "_attn_implementation", None)
    d["layer_types"] = None  # compared per block below
    return {k: v for k, v in d.items() if k not in _HEAD_KEYS}


def _same(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules hold the same parameters and buffers: names, dtypes, shapes, values.
    A LoRA policy's blocks count by their base weights (the reference is the policy with its
    adapters disabled, :func:`datc.models.lora.trunk_tensors`)."""
    ta, tb = trunk_tensors(a), trunk_tensors(b)
    return ta.keys() == tb.keys() and all(
        ta[n].dtype == tb[n].dtype and ta[n].shape == tb[n].shape and torch.equal(ta[n], tb[n]) for n in ta)


def shared_trunk_depth(ref, rm) -> int:
    """How many leading decoder blocks (the input embeddings first) the reference and the
    reward model share: equal trunk configurations and parameters, block by block, of a family
    in :data:`TRUNK_MODEL_TYPES`. At most the reward model's depth minus one (its own top block
    always runs). 0: nothing shared, and for models whose parameters are partitioned (ZeRO-3:
    each rank holds a shard, the local tensors are empty and prove nothing)."""
    if ref is None or rm is None:
        return 0
    if partitioned(ref) or partitioned(rm):
        return 0
    mt = getattr(ref.config, "model_type", None)
    if mt not in TRUNK_MODEL_TYPES or getattr(rm.config, "model_type", None) != mt:
        return 0
    if _trunk_config(ref) != _trunk_config(rm):
        return 0
    rb, mb = ref.base_model, rm.base_model
    layers_r, layers_m = getattr(rb, "layers", None), getattr(mb, "layers", None)
    if layers_r is None or layers_m is None or not _same(rb.get_input_embeddings(), mb.get_input_embeddings()):
        return 0
    types_r = getattr(ref.config, "layer_types", None) or [None] * len(layers_r)
    types_m = getattr(rm.config, "layer_types", None) or [None] * len(layers_m)
    k = 0
    while k < min(len(layers_r), len(layers_m) - 1) and types_r[k] == types_m[k] and _same(layers_r[k], layers_m[k]):
        k += 1
    return k


@contextmanager
def _top_blocks(rm, depth: int):
    """The reward model with its first ``depth`` blocks left out (its ``inputs_embeds`` are then
    the hidden state after them), its top blocks numbered from 0 for the KV cache as in a model
    of that depth; restored on exit."""
    base = rm.base_model
    layers = base.layers
    top = layers[depth:]
    idx = [blk.self_attn.layer_idx for blk in top]
    base.layers = top
    try:
        for j, blk in enumerate(top):
            blk.self_attn.layer_idx = j
        yield rm
    finally:
        base.layers = layers
        for blk, i in zip(top, idx, strict=True):
            blk.self_attn.layer_idx = i


def reference_and_score(ref, rm, depth: int, ro: Rollout, temperature: float, micro: int, with_grad: bool = False,
                        grad_rows: Tensor | None = None) -> tuple[Tensor, RMScore]:
    """The reference's log-probs of the sampled ids (B, T) and the reward model's scores (and,
    ``with_grad``, its input-embedding gradient at every response token, for the rows
    ``grad_rows`` (B,) bool or all), from one reference pass and the reward model's blocks above
    the shared ``depth`` (:func:`shared_trunk_depth`), in chunks of ``micro`` rows. The reward
    model's input is the policy's prompt ids and the response ids (``reward.chat_template:
    false``); each distinct prompt but its last token is forwarded once, without a graph."""
    B, T = ro.response_ids.shape
    logps = torch.empty(B, T, dtype=torch.float32, device=ro.response_ids.device)
    scores = torch.empty(B, dtype=torch.float32, device=ro.response_ids.device)
    grad = None
    if with_grad:
        d = rm.get_input_embeddings().weight.shape[-1]
        grad = torch.zeros(B, T, d, dtype=torch.float32, device=ro.response_ids.device)
    for g_on, rows in rows_by_gradient(B, with_grad, grad_rows, ro.response_ids.device):
        for i in range(0, rows.numel(), micro):
            r = rows[i : i + micro]
            lp, s, g = _chunk(ref, rm, depth, ro, r, temperature, g_on)
            logps[r], scores[r] = lp, s
            if g is not None:
                grad[r] = g
    return logps, RMScore(scores, grad)


def _chunk(ref, rm, depth: int, ro: Rollout, rows: Tensor, temperature: float, with_grad: bool):
    pids, pmask = ro.prompt_ids[rows], ro.prompt_mask[rows]
    rids, rmask = ro.response_ids[rows], ro.response_mask[rows]
    T = rids.shape[1]
    # the continuation: the prompt's last token (its logits predict the first response token),
    # then the whole response (the reward model reads its score at the last response token)
    cont_ids = torch.cat([pids[:, -1:], rids], 1)
    cont_mask = torch.cat([pmask[:, -1:], rmask], 1)
    groups = prompt_groups(pids, pmask)
    with torch.no_grad():
        x = ref.get_input_embeddings()(cont_ids)
    x.requires_grad_(with_grad)
    with torch.set_grad_enabled(with_grad):
        pre, out = forward_after_prompts(
            ref, pmask[:, :-1], cont_mask, groups, prompt_ids=pids[:, :-1], cont_embeds=x, prompt_grad=False,
            prompt_kwargs={"logits_to_keep": 1, "output_hidden_states": True},
            logits_to_keep=torch.arange(T, device=x.device), output_hidden_states=True)
        with torch.no_grad():
            logps = selective_log_softmax(scaled(out.logits.detach(), temperature), rids)
        # the reward model's top blocks from the shared depth: each distinct prompt (but its last
        # token) once, then the continuations, left-aligned so their last column is every row's
        # last token, where the score is read (datc.models.rm_inputs.RMInputs)
        hp, hc = pre.hidden_states[depth][groups.inverse], out.hidden_states[depth]
        src, _ = left_align_index(cont_mask)
        hc = hc.gather(1, src[:, :, None].expand(-1, -1, hc.shape[-1]))
        with _top_blocks(rm, depth):
            _, top = forward_after_prompts(rm, pmask[:, :-1], cont_mask.gather(1, src), groups, prompt_embeds=hp,
                                           cont_embeds=hc, prompt_grad=False)
        s = as_score(top.logits)
        g = None
        if with_grad:
            (g,) = torch.autograd.grad(s.sum(), x)  # scores are independent per row
            g = g[:, 1:].float() * rmask[:, :, None]
    return logps, s.detach().float(), g
