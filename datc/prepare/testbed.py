"""The testbed's trained assets: the supervised warm start of a testbed policy on its task's
demonstrations, and the reward model trained to predict the task's gold reward (both run by
the prepare step, :func:`datc.prepare.assets.ensure_assets`, and cached there)."""

from __future__ import annotations

import logging
import random
import time
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm

from datc.batch import encode_prompts, position_ids
from datc.engines.generate import sample_groups
from datc.math.metrics import pearson, within_group_corr
from datc.models.lora import DEFAULT_TARGETS
from datc.models.reward_delta import add_adapters, take_delta
from datc.models.rm_inputs import build_rm_inputs
from datc.models.shared_prompt import PromptGroups, forward_after_prompts, prompt_groups
from datc.rewards.model import as_score, rm_forward, score
from datc.run.signals import stop_in_prepare
from datc.tasks import Task, gold_of

log = logging.getLogger("datc.prepare.assets")

PREP_SEED = 0  # the warm start and the reward model are shared by every run seed


def _pad_responses(tok, responses: list[list[int]], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(responses), T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(responses), T, dtype=torch.bool)
    for i, r in enumerate(responses):
        r = r[:T]
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
    return ids, mask


def warm_start(policy, tok, task: Task, train_rows: list[dict], steps: int, lr: float, batch_size: int, max_new_tokens: int,
               seed: int = PREP_SEED, progress: bool = False) -> list[float]:
    """Supervised fine-tuning on the task's demonstrations (loss on response tokens only), so
    the policy writes in-distribution text of mixed quality before RL. ``progress``: a
    progress bar (steps, loss, time left) on stderr."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    policy.train()
    losses = []
    bar = tqdm(range(steps), desc="prepare: warm start", disable=not progress, mininterval=1.0)
    for i in bar:
        stop_in_prepare("warm start")
        _log_every_tenth(progress, "warm start", i, steps, losses)
        # Without replacement when the prompts allow it; a prompt set smaller than a batch repeats.
        examples = rng.sample(train_rows, batch_size) if len(train_rows) >= batch_size else rng.choices(train_rows, k=batch_size)
        prompt_ids, prompt_mask = encode_prompts(tok, examples, "prompt", "cpu")
        resp = [tok.convert_tokens_to_ids(task.demonstration(ex, rng)) for ex in examples]
        resp_ids, resp_mask = _pad_responses(tok, resp, max_new_tokens)
        ids = torch.cat([prompt_ids, resp_ids], 1)
        am = torch.cat([prompt_mask, resp_mask], 1)
        labels = torch.where(torch.cat([torch.zeros_like(prompt_mask), resp_mask], 1), ids, torch.full_like(ids, -100))
        loss = policy(input_ids=ids, attention_mask=am.long(), position_ids=position_ids(am), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    policy.eval()
    return losses


def _rm_pool(policy, tok, task: Task, rows: list[dict], samples_per_prompt: int, max_new_tokens: int,
             edits_per_sample: int = 0, perturbations: bool = False,
             seed: int = PREP_SEED, progress: bool = False, desc: str = "",
             encoder=None) -> list[tuple[dict, list[list[int]], torch.Tensor]]:
    """Responses grouped by prompt, to train or test the reward model on: the warm policy's own
    samples (what RL starts from), local edits of them, and optionally the task's extreme
    perturbations (what RL may push towards).
    Returns ``[(example, [response ids], gold (n,)), ...]``, one entry per prompt."""
    rng = random.Random(seed + 1)
    groups = []
    for i in tqdm(range(0, len(rows), 64), desc=desc, disable=not progress, mininterval=1.0):
        stop_in_prepare("reward-model samples")
        chunk = rows[i : i + 64]
        ro = sample_groups(policy, tok, chunk, samples_per_prompt, max_new_tokens, encoder=encoder)
        g, _ = gold_of(task, tok, ro.examples, ro.response_ids, ro.response_mask)
        for k, ex in enumerate(chunk):
            resp, gold = [], []
            for j in range(k * samples_per_prompt, (k + 1) * samples_per_prompt):
                ids = ro.response_ids[j, : int(ro.response_mask[j].sum())].tolist()
                resp.append(ids)
                gold.append(float(g[j]))
                for _ in range(edits_per_sample):
                    toks = task.edit(ex, tok.convert_ids_to_tokens(ids), rng)[:max_new_tokens]
                    resp.append(tok.convert_tokens_to_ids(toks))
                    gold.append(task.gold(ex, toks))
            if perturbations:
                for toks in task.perturbations(ex, rng):
                    resp.append(tok.convert_tokens_to_ids(toks[:max_new_tokens]))
                    gold.append(task.gold(ex, toks[:max_new_tokens]))
            groups.append((ex, resp, torch.tensor(gold)))
    return groups


def _rm_inputs(tok, examples, responses, max_new_tokens, encoder=None):
    """The reward model's input for (prompt, response ids): the policy's prompt ids (its chat
    template with ``encoder``) followed by the response, as the trainer scores them."""
    p_ids, p_mask = encoder.encode(examples, "cpu") if encoder is not None else encode_prompts(tok, examples, "prompt", "cpu")
    r_ids, r_mask = _pad_responses(tok, responses, max_new_tokens)
    return build_rm_inputs(p_ids, p_mask, r_ids, r_mask, tok.pad_token_id)


def _rm_batch_scores(rm, tok, examples, responses, max_new_tokens, encoder=None):
    inp = _rm_inputs(tok, examples, responses, max_new_tokens, encoder)
    return rm_forward(rm, rm.get_input_embeddings()(inp.input_ids), inp.attention_mask)


def top_layers_view(rm, k: int):
    """The reward model from its last ``k`` blocks up (final norm and score head included),
    sharing its modules: fed the hidden states that enter block ``n - k`` as ``inputs_embeds``,
    it computes the whole model's score. Lets training of the top blocks reuse the frozen lower
    blocks' output, computed once per response. Llama/Qwen-style models (``.model.layers``)."""
    import copy

    inner = copy.copy(rm.model)
    inner._modules = dict(rm.model._modules)  # a new module table: the original is untouched
    inner.layers = torch.nn.ModuleList(list(rm.model.layers)[-k:])
    top = copy.copy(rm)
    top._modules = dict(rm._modules)
    top.model = inner
    return top


def _left_pad(hs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of hidden states (L_i, d) left-padded with zeros into (n, L, d), and their mask (n, L)."""
    L, d = max(len(h) for h in hs), hs[0].shape[-1]
    x = hs[0].new_zeros(len(hs), L, d)
    mask = torch.zeros(len(hs), L, dtype=torch.bool)
    for r, h in enumerate(hs):
        x[r, L - len(h):] = h
        mask[r, L - len(h):] = True
    return x, mask


@contextmanager
def _numbered_from_zero(layers):
    """Blocks ``layers`` (the top of a model, run alone) numbered 0.. for the KV cache, as in a
    model of that depth; their own numbers restored on exit."""
    idx = [blk.self_attn.layer_idx for blk in layers]
    try:
        for j, blk in enumerate(layers):
            blk.self_attn.layer_idx = j
        yield
    finally:
        for blk, i in zip(layers, idx, strict=True):
            blk.self_attn.layer_idx = i


class _FrozenBottom:
    """Scores of a reward model whose lower blocks are frozen: the hidden states entering the
    first trainable block are computed once per (prompt, response) and cached, so each training
    step runs only the top ``k`` blocks. Same function as ``_rm_batch_scores`` (tested).

    ``share``: each prompt (but its last token) is cached once, apart from its responses (the
    prompt's last token and the response), and both the caching pass (the lower blocks only) and
    each training step forward a prompt once for all its responses in the batch, through the KV
    cache (:func:`datc.models.shared_prompt.forward_after_prompts`; the step backpropagates
    through the repeated cache). Same function up to float rounding; about half the tokens at
    2 prompts x 8 responses of ~45 + ~30 tokens."""

    def __init__(self, rm, k: int, tok, max_new_tokens: int, encoder=None, share: bool = False, lora_r: int = 0,
                 seed: int = PREP_SEED):
        for p in rm.parameters():
            p.requires_grad_(False)
        self.top = top_layers_view(rm, k)
        for m in (self.top.model.norm, self.top.score, *(() if lora_r else self.top.model.layers)):
            for p in m.parameters():
                p.requires_grad_(True)
        if lora_r:  # the top blocks as LoRA adapters (datc.models.reward_delta): a small file any machine merges alike
            n = len(rm.model.layers)
            add_adapters(rm, list(range(n - k, n)), DEFAULT_TARGETS[rm.config.model_type], lora_r, 2.0 * lora_r, seed)
        self.rm, self.k, self.tok, self.T, self.encoder, self.share = rm, k, tok, max_new_tokens, encoder, share
        # (group, response) -> (L, d) valid positions; shared: the prompt's last token and the response
        self.cache: dict[tuple[int, int], torch.Tensor] = {}
        self.prompts: dict[int, torch.Tensor] = {}  # shared: group -> (L, d), its prompt but the last token

    def fill(self, pool, batch: int = 32) -> None:
        if self.share:
            return self._fill_shared(pool, batch)
        keys = [(g, j) for g, (_, resp, _) in enumerate(pool) for j in range(len(resp))]
        n_layers = len(self.rm.model.layers)
        for i in range(0, len(keys), batch):
            chunk = keys[i : i + batch]
            inp = _rm_inputs(self.tok, [pool[g][0] for g, _ in chunk], [pool[g][1][j] for g, j in chunk], self.T, self.encoder)
            with torch.no_grad():
                out = self.rm.model(input_ids=inp.input_ids, attention_mask=inp.attention_mask.long(),
                                    position_ids=position_ids(inp.attention_mask), output_hidden_states=True)
            h = out.hidden_states[n_layers - self.k]  # (B, L, d): the input of the first trainable block
            for r, key in enumerate(chunk):
                self.cache[key] = h[r][inp.attention_mask[r]].clone()

    def _bottom(self):
        """The reward model's base model up to the first trainable block (no final norm): its
        last hidden state is that block's input. Shares the modules."""
        import copy

        inner = copy.copy(self.rm.model)
        inner._modules = dict(self.rm.model._modules)
        inner.layers = torch.nn.ModuleList(list(self.rm.model.layers)[: len(self.rm.model.layers) - self.k])
        inner.norm = torch.nn.Identity()
        return inner

    def _fill_shared(self, pool, batch: int) -> None:
        keys = [(g, j) for g, (_, resp, _) in enumerate(pool) for j in range(len(resp))]
        bottom = self._bottom()
        for i in range(0, len(keys), batch):
            chunk = keys[i : i + batch]
            inp = _rm_inputs(self.tok, [pool[g][0] for g, _ in chunk], [pool[g][1][j] for g, j in chunk], self.T, self.encoder)
            cut, am = inp.prefix_len - 1, inp.attention_mask  # the prompt's last token goes with the response
            groups = prompt_groups(inp.input_ids[:, :cut], am[:, :cut])
            with torch.no_grad():
                pre, out = forward_after_prompts(bottom, am[:, :cut], am[:, cut:], groups, prompt_ids=inp.input_ids[:, :cut],
                                                 cont_ids=inp.input_ids[:, cut:])
            for r, (g, j) in enumerate(chunk):
                if g not in self.prompts:
                    self.prompts[g] = pre.last_hidden_state[groups.inverse[r]][am[r, :cut]].clone()
                self.cache[(g, j)] = out.last_hidden_state[r][am[r, cut:]].clone()

    def scores(self, keys: list[tuple[int, int]]) -> torch.Tensor:
        if self.share:
            return self._scores_shared(keys)
        x, mask = _left_pad([self.cache[k] for k in keys])
        return rm_forward(self.top, x, mask)

    def _scores_shared(self, keys: list[tuple[int, int]]) -> torch.Tensor:
        order = list(dict.fromkeys(g for g, _ in keys))  # the distinct prompts, in order of first use
        at = {g: i for i, g in enumerate(order)}
        inverse = torch.tensor([at[g] for g, _ in keys])
        first = torch.tensor([next(r for r, (g2, _) in enumerate(keys) if g2 == g) for g in order])
        xp, pmask = _left_pad([self.prompts[g] for g in order])
        xc, cmask = _left_pad([self.cache[k] for k in keys])
        with _numbered_from_zero(self.top.model.layers):
            _, out = forward_after_prompts(self.top, pmask[inverse], cmask, PromptGroups(first, inverse),
                                           prompt_embeds=xp[inverse], cont_embeds=xc)
        return as_score(out.logits)


def _test_scores(rm, tok, examples, responses, max_new_tokens, encoder=None, share: bool = False) -> torch.Tensor:
    """The reward model's scores of the held-out responses, in batches of 64 (``share``: each
    prompt forwarded once per batch, :func:`datc.rewards.model.score`)."""
    out = []
    for i in range(0, len(responses), 64):
        ex, resp = examples[i : i + 64], responses[i : i + 64]
        if not share:
            out.append(_rm_batch_scores(rm, tok, ex, resp, max_new_tokens, encoder))
            continue
        inp = _rm_inputs(tok, ex, resp, max_new_tokens, encoder)
        out.append(score(rm, inp, _pad_responses(tok, resp, max_new_tokens)[1], batch_size=64).scores)
    return torch.cat(out)


RM_GROUP = 8  # responses per prompt in a reward-model batch, and per prompt in its held-out test


def train_reward_model(rm, policy, tok, task: Task, train_rows, eval_rows, rcfg, max_new_tokens: int,
                       seed: int = PREP_SEED, progress: bool = False, encoder=None) -> dict[str, Any]:
    """Fit the gold reward on groups of responses to the same prompt. The loss is the MSE plus
    the MSE of the within-group deviations (prediction and gold each centred on their group's
    mean): GRPO only ever compares responses to one prompt, so that ranking is what the reward
    model must get right. Reports the fit on fresh warm-policy samples of held-out prompts.
    ``progress``: progress bars (sampling the pool; steps, loss, time left) on stderr.
    ``rcfg.trainable_layers = k > 0`` trains only the top k blocks (with ``rcfg.lora_r``: rank-r
    LoRA adapters on them, returned as ``"delta"``, merged), final norm and head (the
    lower blocks' output is computed once per response); with ``rcfg.share_prompts`` each prompt
    is forwarded once for its responses there and in the held-out scoring (same function up to
    float rounding); ``encoder`` renders prompts with the policy's chat template, for sampling
    and scoring alike."""
    torch.manual_seed(seed)
    t0 = time.time()
    pool = _rm_pool(policy, tok, task, train_rows[: rcfg.n_prompts], rcfg.samples_per_prompt, max_new_tokens,
                    rcfg.edits_per_sample, rcfg.perturbations, seed, progress, "prepare: reward-model samples", encoder)
    log.info("reward-model pool: %d responses in %.0fs", sum(len(r) for _, r, _ in pool), time.time() - t0)
    frozen = None
    if rcfg.trainable_layers > 0:
        frozen = _FrozenBottom(rm, rcfg.trainable_layers, tok, max_new_tokens, encoder, rcfg.share_prompts, rcfg.lora_r, seed)
        frozen.fill(pool)
        log.info("cached the frozen blocks' output in %.0fs", time.time() - t0)
    rng = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in rm.parameters() if p.requires_grad], lr=rcfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(rcfg.steps, 1))
    rm.train()
    n_prompts = max(rcfg.batch_size // RM_GROUP, 1)
    losses = []
    bar = tqdm(range(rcfg.steps), desc="prepare: reward model", disable=not progress, mininterval=1.0)
    for i in bar:
        stop_in_prepare("reward-model training")
        _log_every_tenth(progress, "reward model", i, rcfg.steps, losses)
        examples, responses, golds, keys = [], [], [], []
        for p in torch.randint(len(pool), (n_prompts,), generator=rng).tolist():
            ex, resp, gold = pool[p]
            pick = torch.randint(len(resp), (RM_GROUP,), generator=rng)
            examples += [ex] * RM_GROUP
            responses += [resp[j] for j in pick.tolist()]
            keys += [(p, j) for j in pick.tolist()]
            golds.append(gold[pick])
        gold = torch.cat(golds)
        pred = (frozen.scores(keys) if frozen is not None
                else _rm_batch_scores(rm, tok, examples, responses, max_new_tokens, encoder))
        dev_pred = pred.view(-1, RM_GROUP) - pred.view(-1, RM_GROUP).mean(1, keepdim=True)
        dev_gold = gold.view(-1, RM_GROUP) - gold.view(-1, RM_GROUP).mean(1, keepdim=True)
        loss = torch.nn.functional.mse_loss(pred, gold) + rcfg.group_weight * torch.nn.functional.mse_loss(dev_pred, dev_gold)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in rm.parameters() if p.requires_grad], 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    rm.eval()
    delta = None
    if rcfg.lora_r:  # the adapters as integer factors, merged as any machine merges them: the model tested is the one saved
        whole = [n for n, p in rm.named_parameters() if p.requires_grad and "lora_" not in n]
        delta = take_delta(rm, rcfg.lora_r, 2.0 * rcfg.lora_r, whole)
    for p in rm.parameters():
        p.requires_grad_(True)
    return {"train_pool": sum(len(r) for _, r, _ in pool),
            "final_train_loss": sum(losses[-50:]) / len(losses[-50:]) if losses else None,
            **heldout_fit(rm, policy, tok, task, eval_rows, rcfg, max_new_tokens, encoder),
            **({"delta": delta} if delta is not None else {})}  # the caller saves it (datc.prepare.assets)


def heldout_fit(rm, policy, tok, task: Task, eval_rows, rcfg, max_new_tokens: int, encoder=None) -> dict[str, float]:
    """The reward model's fit to gold on ``RM_GROUP`` fresh samples of the warm policy for each of
    ``rcfg.test_prompts`` held-out prompts, as GRPO will see them (drawn from the global random
    state as it is: after the pool's sampling, whatever the training, so LoRA and whole blocks
    are tested on the same draw)."""
    test = _rm_pool(policy, tok, task, eval_rows[: rcfg.test_prompts], RM_GROUP, max_new_tokens, encoder=encoder)
    ex = [e for e, resp, _ in test for _ in resp]
    resp = [r for _, rs, _ in test for r in rs]
    gold = torch.cat([g for _, _, g in test])
    with torch.no_grad():
        pred = _test_scores(rm, tok, ex, resp, max_new_tokens, encoder, rcfg.share_prompts)
    return {"heldout_corr": pearson(pred, gold), "heldout_within_group_corr": within_group_corr(pred, gold, RM_GROUP),
            "heldout_gold_mean": float(gold.mean())}


def _log_every_tenth(progress: bool, what: str, i: int, steps: int, losses: list[float]) -> None:
    """Without progress bars (``trainer.progress=false``, e.g. the real preset), a log line at
    every tenth of the prepare step's loops, so a long prepare is not silent."""
    if not progress and i > 0 and i % max(steps // 10, 1) == 0:
        log.info("prepare: %s step %d of %d, loss %.4f", what, i, steps, losses[-1] if losses else float("nan"))
