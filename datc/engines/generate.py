"""The built-in sampler (group sampling): each prompt is tokenized once, left-padded once, and repeated for its group."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from transformers import DynamicCache

from datc.batch import Rollout, encode_prompts, position_ids, response_mask_from_ids
from datc.engines.fast_decode import lean_decoder
from datc.engines.sampling import sample_categorical, top_p_filter
from datc.engines.static_decode import static_decoder
from datc.models.build import cache_kwarg


def _any_unfinished(unfinished: Tensor, synced_gpus: bool) -> bool:
    """Whether any row (on any rank, with ``synced_gpus``) is still sampling."""
    if not synced_gpus:
        return bool(unfinished.any())
    flag = unfinished.any().to(torch.float32).reshape(1)
    torch.distributed.all_reduce(flag)
    return bool(flag.item() > 0)


class Prefill(NamedTuple):
    """The prompts forwarded once: what both decode loops continue from."""

    cache: dict[str, DynamicCache]  # {the forward's name for it: the KV cache of the prompts}, B rows
    logits: Tensor  # (B, V) the first response token's logits, in the model's output dtype
    next_pos: Tensor  # (B, 1) long, the first response token's position (padding skipped)


@torch.no_grad()
def prefill(policy, ids: Tensor, mask: Tensor, prompt_repeats: int = 1) -> Prefill:
    """Forward the prompts ids/mask (B, P), left-padded, filling a ``DynamicCache``.
    ``prompt_repeats`` k: the rows come in runs of k identical prompts (a group), so each run's
    prompt is forwarded once and its KV cache and logits are repeated k times."""
    B, k = ids.shape[0], prompt_repeats
    am = mask.long()
    pos = position_ids(mask)
    cache = {cache_kwarg(policy): DynamicCache()}  # filled in place by each forward
    if k > 1 and (B % k or not torch.equal(ids, ids[::k].repeat_interleave(k, 0))):
        raise ValueError(f"prompt_repeats={k}: the rows are not runs of {k} identical prompts")
    out = policy(input_ids=ids[::k], attention_mask=am[::k], position_ids=pos[::k], use_cache=True, logits_to_keep=1,
                 **cache)
    logits = out.logits[:, -1]
    if k > 1:  # each prompt's cache and next-token logits, once per response of its group
        next(iter(cache.values())).batch_repeat_interleave(k)
        logits = logits.repeat_interleave(k, 0)
    return Prefill(cache, logits, pos[:, -1:] + 1)


@torch.no_grad()
def sample_tokens(policy, ids: Tensor, mask: Tensor, max_new_tokens: int, temperature: float, top_p: float,
                  eos_id: int, pad_id: int, min_new_tokens: int = 0, keep_logits: bool = False,
                  synced_gpus: bool = False, prompt_repeats: int = 1, decode: str = "dynamic", sync_every: int = 8,
                  graph: bool = True, generator: torch.Generator | None = None,
                  uniforms: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Sampling with the KV cache, the steps of transformers' ``generate`` for
    ``do_sample=True, top_k=0`` (float32 logits of the last position; EOS forbidden before
    ``min_new_tokens``; ``/ temperature``; top-p; ``softmax``; one draw; finished rows get the
    pad id; stop when every row has sampled EOS or the budget is spent) without generate's
    per-token bookkeeping, which dominates the rollout of small models. The draw is
    ``sample_categorical`` (same distribution as generate's ``multinomial``, other random
    numbers), so the logits are generate's bit for bit but the sampled ids are not.

    ids/mask (B, P) left-padded. Returns the sampled ids (B, n <= max_new_tokens) and, with
    ``keep_logits``, the raw float32 logits at each sampled position (B, n, V). With
    ``synced_gpus`` a rank whose rows are all done keeps forwarding (pads) until every rank is,
    as generate's ``synced_gpus`` does, so ZeRO-3's collective parameter gathers stay matched.
    ``prompt_repeats`` k: the rows come in runs of k identical prompts (a group), so the prefill
    forwards each run's prompt once and repeats its KV cache and logits k times.

    ``decode="static"``: after the same prefill, the decode steps run on a static KV cache as
    one step captured as a CUDA graph on CUDA (``graph=False``: eagerly, as on CPU), checking
    for finished rows every ``sync_every`` steps (:mod:`datc.engines.static_decode`: the same
    distribution and logits to float rounding; a model or case it cannot take decodes here,
    after one log line saying why). ``"dynamic"``: this loop. ``generator``: the draws' random
    stream (None: torch's global one); ``uniforms`` (B, >= max_new_tokens): each row's uniform
    numbers, drawn beforehand (:func:`datc.engines.sampling.row_uniforms`), instead of a stream.
    The static decode takes only the global stream (either of them: the dynamic loop)."""
    B = ids.shape[0]
    cache, logits, next_pos = prefill(policy, ids, mask, prompt_repeats)
    if decode == "static" and max_new_tokens > 1 and generator is None and uniforms is None:
        dec = static_decoder(policy, cache, mask, logits, next_pos, max_new_tokens, temperature=temperature, top_p=top_p,
                             eos_id=eos_id, pad_id=pad_id, min_new_tokens=min_new_tokens, keep_logits=keep_logits,
                             synced_gpus=synced_gpus)
        if dec is not None:
            del cache  # the prefill's keys and values are in the static cache now
            return dec.run(sync_every, graph=graph and ids.is_cuda)
    am = mask.long()
    # GPT-2: the same decode forward without transformers' per-call plumbing (datc.engines.fast_decode)
    lean = lean_decoder(policy, next(iter(cache.values())), mask) if max_new_tokens > 1 and not synced_gpus else None
    unfinished = torch.ones(B, dtype=torch.bool, device=ids.device)
    tokens = []
    # kept logits go straight into one buffer: a (B, V) tensor kept per step would take fresh
    # memory every step (page faults, 1.5 s a step at B·T·V = 75M) and a stack at the end
    raw = logits.new_empty((B, max_new_tokens, logits.shape[-1]), dtype=torch.float32) if keep_logits else None
    ones = am.new_ones(B, 1)
    for t in range(max_new_tokens):
        if keep_logits:
            z = raw[:, t]
            z.copy_(logits)
        else:
            z = logits.to(dtype=torch.float32, copy=True)
        s = z
        if t < min_new_tokens:
            s = s.clone()
            s[:, eos_id] = -float("inf")
        if temperature != 1.0:
            s = s / temperature
        if top_p < 1.0:
            s = top_p_filter(s, top_p)
        nxt = sample_categorical(torch.softmax(s, dim=-1), generator=generator,
                                 uniforms=None if uniforms is None else uniforms[:, t])
        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad_id))
        tokens.append(nxt)
        unfinished &= nxt != eos_id
        if t == max_new_tokens - 1 or not _any_unfinished(unfinished, synced_gpus):
            break
        if lean is not None:
            logits = lean(nxt, next_pos)
        else:
            am = torch.cat([am, ones], 1)
            logits = policy(input_ids=nxt[:, None], attention_mask=am, position_ids=next_pos, use_cache=True,
                            **cache).logits[:, -1]
        next_pos = next_pos + 1
    return torch.stack(tokens, 1), (raw[:, : len(tokens)] if keep_logits else None)


@torch.no_grad()
def sample_groups(
    policy,
    tokenizer,
    examples: list[dict[str, Any]],
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    prompt_field: str = "prompt",
    keep_logits: bool = False,
    synced_gpus: bool = False,
    encoder=None,
    min_new_tokens: int = 0,
    share_prompts: bool = True,
    decode: str = "dynamic",
    sync_every: int = 8,
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
) -> Rollout:
    """Sample ``num_generations`` responses per prompt (pure sampling: ``top_k`` off, so the
    sampling distribution is ``softmax(z / temperature)`` up to top-p; see ``sample_tokens``).
    ``keep_logits`` also returns the raw logits computed for each sampled position (the rollout
    policy's distribution, without a second forward pass). ``synced_gpus`` keeps every rank
    forwarding until all are done (ZeRO-3: each forward gathers parameters from all ranks).
    ``encoder`` (a :class:`datc.models.chat.PromptEncoder`) renders the prompts; without one the
    ``prompt_field`` text is tokenized as is. ``min_new_tokens`` forbids EOS before that many
    tokens (the benchmark uses it to fix the response length). ``share_prompts``: the prefill
    forwards each prompt once for its group (``sample_tokens``' ``prompt_repeats``). ``decode``
    and ``sync_every``: ``sample_tokens``' decode loop (``"static"``: :mod:`datc.engines.static_decode`);
    ``generator``: its random stream (None: torch's global one); ``uniforms``: the rows' uniform
    numbers drawn beforehand (``sample_tokens``; ``trainer.deterministic``)."""
    device = next(policy.parameters()).device
    if encoder is not None:  # datc.models.chat.PromptEncoder: prompt formats and chat templates
        ids, mask = encoder.encode(examples, device)
    else:
        ids, mask = encode_prompts(tokenizer, examples, prompt_field, device)
    ids = ids.repeat_interleave(num_generations, 0)
    mask = mask.repeat_interleave(num_generations, 0)
    was_training = policy.training
    policy.eval()
    try:
        resp, logits = sample_tokens(policy, ids, mask, max_new_tokens, temperature, top_p, tokenizer.eos_token_id,
                                     tokenizer.pad_token_id, min_new_tokens, keep_logits, synced_gpus,
                                     num_generations if share_prompts else 1, decode, sync_every,
                                     generator=generator, uniforms=uniforms)
    finally:
        policy.train(was_training)
    if keep_logits and logits.shape[1] < max_new_tokens:
        logits = torch.cat([logits, logits.new_zeros(logits.shape[0], max_new_tokens - logits.shape[1], logits.shape[2])], 1)
    if resp.shape[1] < max_new_tokens:  # every response ended early: pad to the full budget
        pad = resp.new_full((resp.shape[0], max_new_tokens - resp.shape[1]), tokenizer.pad_token_id)
        resp = torch.cat([resp, pad], 1)
    rmask, truncated = response_mask_from_ids(resp, tokenizer.eos_token_id)
    resp = torch.where(rmask, resp, torch.full_like(resp, tokenizer.pad_token_id))
    expanded = [ex for ex in examples for _ in range(num_generations)]
    return Rollout(ids, mask, resp, rmask, truncated, expanded, logits)
