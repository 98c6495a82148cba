"""The training loop, top to bottom: rollout → reward → credit → loss → update.

``train(cfg)`` is called by the Hydra entry point (:mod:`datc.train`) and directly by tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm
from transformers import get_scheduler

from datc.advantages import group_advantages
from datc.chat import RewardInputs, prompt_encoder
from datc.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_engine_checkpoint,
    save_checkpoint,
    save_engine_checkpoint,
)
from datc.config import ConfigError, TrainConfig, validate
from datc.credit import compute_credit, resolve_scheme
from datc.credit.base import (
    ENTROPY,
    LOGPS_UNDER,
    OLD_LOGPS,
    POLICY_HIDDEN,
    POLICY_LOGITS,
    PROMPTS,
    RM_EMBEDDING,
    RM_GRAD,
    CreditBatch,
)
from datc.credit.diagnostics import credit_metrics
from datc.distributed import Dist, deepspeed_config, gathered, inference_config
from datc.distributed import init as init_distributed
from datc.export import save_final_policy
from datc.logger import RunLogger, completions_of
from datc.logprobs import entropy_from_logits, selective_log_softmax
from datc.losses import AggNorm, aggregate, clipped_policy_loss
from datc.metrics import pearson, within_group_corr
from datc.models import freeze, load_pretrained, resolve_device, resolve_dtype
from datc.numerics import (
    NonFiniteReport,
    drop_nonfinite_rewards,
    loss_is_finite,
    uniform_nonfinite_weights,
    zero_nonfinite_advantages,
    zero_nonfinite_rm_grad,
)
from datc.prepare import Assets, ensure_assets, gold_of
from datc.rewards.model import score
from datc.rewards.rules import RULES, RuleContext
from datc.rollout import Rollout, cat_rollouts, position_ids, sample_groups, with_prompts
from datc.rundir import RunDir
from datc.tokenizer import load_tokenizer
from datc.utils import (
    atomic_write_json,
    peak_rss_mb,
    quiet_libraries,
    rng_state,
    seed_everything,
    set_rng_state,
)

# Largest B·T·V for which generate's logits are kept for credit (``reuse_rollout_logits: auto``):
# 2^28 float32 values = 1 GiB. Real vocabularies at real batch sizes recompute them in chunks.
REUSE_LOGITS_MAX_ELEMENTS = 2**28

# ============================================================================================
# Plumbing: prompts, models, policy passes
# ============================================================================================


class PromptSampler:
    """Prompts for step ``s`` are a pure function of (seed, s): consecutive slices of a stream
    of per-epoch permutations, so a resumed run draws exactly the prompts it would have."""

    def __init__(self, n: int, per_step: int, seed: int) -> None:
        self.n, self.per_step, self.seed = n, per_step, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        start = step * self.per_step
        return [self._perm(i // self.n)[i % self.n] for i in range(start, start + self.per_step)]


@dataclass
class Models:
    policy: Any  # the policy module (under DeepSpeed: the engine's module; forwards go through it)
    ref: Any | None
    rm: Any
    tok: Any
    vocab_size: int = 0  # rows of the policy's LM head (read before any ZeRO-3 partitioning)
    synced_gpus: bool = False  # generate keeps every rank in step (ZeRO-3 with several ranks)
    encoder: Any = None  # datc.chat.PromptEncoder: the policy's prompts (format, chat template)
    rm_inputs: Any = None  # datc.chat.RewardInputs: the reward model's inputs (its own chat template)

    def score_inputs(self, ro: Rollout):
        return self.rm_inputs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, ro.examples)


def _frozen(model, c: TrainConfig, dist: Dist):
    """A frozen model placed for inference: sharded under ZeRO-3 (as TRL prepares its reference
    and reward models), else a plain replica on every rank."""
    ds_cfg = inference_config(c, dist.world_size) if dist.enabled else None
    if ds_cfg is None:
        return model
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=ds_cfg)
    engine.module.eval()
    return engine.module


def load_models(c: TrainConfig, assets: Assets, device: torch.device, dist: Dist | None = None) -> Models:
    dist = dist or Dist()
    dtype = resolve_dtype(c.policy.dtype, device)
    tok = load_tokenizer(assets.tokenizer_path)
    policy = load_pretrained("causal_lm", assets.policy_path, "policy.path").to(device)  # fp32 master weights
    ref = freeze(load_pretrained("causal_lm", assets.policy_path, "policy.path", dtype).to(device)) if c.trainer.beta > 0 else None
    rm = freeze(load_pretrained("reward", assets.reward_path, "reward.path", dtype).to(device))
    rm_tok = load_tokenizer(assets.reward_path, "reward.path") if c.reward.path is not None else tok
    if rm_tok.get_vocab() != tok.get_vocab():
        raise ConfigError(
            f"reward.path: the reward model's tokenizer ({assets.reward_path}) and the policy's "
            f"({assets.tokenizer_path}) assign different token ids; the reward model must read the "
            "policy's sampled ids as they are (use a reward model of the policy's family)"
        )
    vocab = policy.get_output_embeddings().weight.shape[0]
    ref = _frozen(ref, c, dist) if ref is not None else None
    rm = _frozen(rm, c, dist)
    encoder = prompt_encoder(c, tok)
    return Models(policy, ref, rm, tok, vocab, synced_gpus=dist.enabled and c.deepspeed.stage == 3 and dist.world_size > 1,
                  encoder=encoder, rm_inputs=RewardInputs(rm_tok, encoder, c.reward.chat_template))


def policy_logits(model, ro: Rollout, rows: slice | torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits over the response positions, divided by the sampling temperature. (b, T, V)"""
    ids, am = ro.input_ids[rows], ro.attention_mask[rows]
    T = ro.response_ids.shape[1]
    # the LM head only at the T positions that predict a response token (not at the prompt's)
    logits = model(input_ids=ids, attention_mask=am.long(), position_ids=position_ids(am), logits_to_keep=T + 1).logits
    return logits[:, :-1].float() / temperature


@torch.no_grad()
def rollout_policy_pass(model, ro: Rollout, temperature: float, micro: int, keep_logits: bool,
                        keep_hidden: bool = False, with_entropy: bool = True):
    """One no-grad pass of a frozen or pre-update policy: log-probs, entropies (None without
    ``with_entropy``) and (when a credit scheme declares them) the logits. Returns (logps (B,T),
    entropy (B,T)|None, logits|None);
    with ``keep_hidden`` a fourth element, the LM-head inputs (B,T,d) float32 at the same
    positions (the last hidden state, after the final norm: logits = lm_head(hidden) / temperature)."""
    logps, ents, all_logits, hidden = [], [], [], []
    P = ro.prompt_ids.shape[1]
    for i in range(0, ro.response_ids.shape[0], micro):
        if keep_hidden:  # policy_logits' forward, also returning the last hidden state
            ids, am = ro.input_ids[i : i + micro], ro.attention_mask[i : i + micro]
            fwd = model(input_ids=ids, attention_mask=am.long(), position_ids=position_ids(am), output_hidden_states=True,
                        logits_to_keep=ro.response_ids.shape[1] + 1)
            z = fwd.logits[:, :-1].float() / temperature
            hidden.append(fwd.hidden_states[-1][:, P - 1 : -1].float())
        else:
            z = policy_logits(model, ro, slice(i, i + micro), temperature)
        logps.append(selective_log_softmax(z, ro.response_ids[i : i + micro]))
        if with_entropy:
            ents.append(entropy_from_logits(z))
        if keep_logits:
            all_logits.append(z)
    out = torch.cat(logps), torch.cat(ents) if with_entropy else None, torch.cat(all_logits) if keep_logits else None
    return (*out, torch.cat(hidden)) if keep_hidden else out


def logps_under_prompts(model, tok, ro: Rollout, temperature: float, micro: int, encoder=None):
    """The ``LOGPS_UNDER`` input of a credit scheme: a function from B prompt texts to the
    rollout policy's log-probs (B, T) of the sampled response ids under those prompts, one
    no-grad :func:`rollout_policy_pass` per call (ids spliced, never re-tokenized; see
    :func:`datc.rollout.with_prompts`). Under the original prompts it gives the old log-probs."""
    cfg = getattr(model, "config", None)
    ctx = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)

    def logps_under(prompts: list[str]) -> torch.Tensor:
        other = with_prompts(ro, tok, prompts, encoder)
        width = other.prompt_ids.shape[1] + other.response_ids.shape[1]
        if ctx is not None and width > ctx:
            raise ValueError(f"prompts of up to {other.prompt_ids.shape[1]} tokens plus {other.response_ids.shape[1]} "
                             f"response positions exceed the policy's context of {ctx}")
        return rollout_policy_pass(model, other, temperature, micro, False, with_entropy=False)[0]

    return logps_under


# ============================================================================================
# Evaluation
# ============================================================================================


@torch.no_grad()
def evaluate(c: TrainConfig, m: Models, rows: list[dict], task, device: torch.device) -> tuple[dict[str, float], list[dict]]:
    """Held-out prompts, one sample each, drawn with the eval seed inside a forked RNG so the
    training's random stream is untouched. Returns metrics under ``eval/`` and sample rows."""
    t = c.trainer
    devices = [device.index or 0] if device.type == "cuda" else []
    golds, scores, kls, lens, ents, truncs, samples = [], [], [], [], [], [], []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(t.eval_seed)
        for i in range(0, len(rows), t.eval_batch_size):
            chunk = rows[i : i + t.eval_batch_size]
            ro = sample_groups(m.policy, m.tok, chunk, 1, t.max_new_tokens, t.temperature, t.top_p, c.data.prompt_field,
                               synced_gpus=m.synced_gpus, encoder=m.encoder)
            inp = m.score_inputs(ro)
            s = score(m.rm, inp, ro.response_mask, batch_size=t.eval_batch_size).scores
            logps, ent, _ = rollout_policy_pass(m.policy, ro, t.temperature, t.micro_batch_size, False)
            mask = ro.response_mask.float()
            if m.ref is not None:
                ref_logps, _, _ = rollout_policy_pass(m.ref, ro, t.temperature, t.micro_batch_size, False, with_entropy=False)
                d = ref_logps - logps
                kls.append(((d.exp() - d - 1) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
            scores.append(s)
            lens.append(mask.sum(-1))
            ents.append((ent * mask).sum(-1) / mask.sum(-1).clamp(min=1))
            truncs.append(ro.truncated.float())
            if task is not None:
                golds.append(gold_of(task, m.tok, ro.examples, ro.response_ids, ro.response_mask)[0])
            if i == 0:
                for j in range(min(c.logger.log_samples, len(chunk))):
                    n = int(ro.response_mask[j].sum())
                    samples.append({"prompt": chunk[j][c.data.prompt_field],
                                    "response": m.tok.decode(ro.response_ids[j, :n].tolist()),
                                    "rm_score": float(s[j]), "gold": float(golds[-1][j]) if golds else None})
    scores_t = torch.cat(scores)
    out = {
        "eval/rm_score": _finite_mean(scores_t),  # non-finite scores are counted, not averaged
        "eval/rm_nonfinite_frac": float((~torch.isfinite(scores_t)).float().mean()),
        "eval/response_len": float(torch.cat(lens).mean()),
        "eval/entropy": float(torch.cat(ents).mean()),
        "eval/truncated_frac": float(torch.cat(truncs).mean()),
    }
    if kls:
        out["eval/kl"] = float(torch.cat(kls).mean())
    if golds:
        gold_t = torch.cat(golds)
        out["eval/gold"] = float(gold_t.mean())
        ok = torch.isfinite(scores_t)
        out["eval/rm_gold_corr"] = pearson(scores_t[ok], gold_t[ok])
    return out, samples


# ============================================================================================
# Training
# ============================================================================================


def _resolved(cfg: DictConfig | dict) -> dict[str, Any]:
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    out = OmegaConf.to_container(node, resolve=True)
    out.pop("hydra", None)
    return out


def _git_commit() -> str | None:
    """The commit of the code this process loaded (``+dirty`` if the tree had changes then)."""
    try:
        cwd = Path(__file__).parent
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=cwd).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               timeout=5, cwd=cwd).stdout.strip()
        return (head + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


GIT_COMMIT = _git_commit()  # read at import: a sweep's later runs report the code they ran


@dataclass
class Session:
    """Everything one training run holds: config, models, optimizer, credit scheme, prompts."""

    c: TrainConfig
    m: Models
    assets: Assets
    device: torch.device
    scheme: Any  # datc.credit.CreditScheme
    credit_params: Any
    opt: torch.optim.Optimizer
    sched: Any
    sampler: PromptSampler
    rm_embedding: torch.Tensor | None  # (V, d) when the scheme declares it
    amp_dtype: torch.dtype | None  # autocast dtype for the policy (bf16 on capable GPUs), None = fp32
    nonfinite: NonFiniteReport | None = None  # the last step's non-finite hits (datc.numerics)
    dist: Dist = dataclasses.field(default_factory=Dist)  # this process's rank (datc.distributed)
    engine: Any = None  # the policy's DeepSpeed engine (None = plain PyTorch)
    completions: Any = None  # datc.logger.Completions of the last step before an eval (rank 0), for W&B

    def autocast(self):
        # No cast cache under DeepSpeed: ZeRO-3 re-partitions a weight between forward and
        # backward, so a cached low-precision copy would be stale (an empty tensor) by then.
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None,
                              cache_enabled=self.engine is None)


def build_session(c: TrainConfig, dist: Dist | None = None) -> Session:
    """Prepare (or load from cache) the assets, load the models, build the optimizer (under
    DeepSpeed: the policy's engine, whose optimizer and schedule are the same AdamW and
    transformers scheduler)."""
    t = c.trainer
    dist = dist or Dist()
    device = resolve_device(t.device)
    if device.type == "cuda" and dist.enabled:
        device = torch.device("cuda", dist.local_rank)
    scheme, credit_params = resolve_scheme(c.credit)
    if not dist.is_main:  # rank 0 prepares the cache; the others read it
        dist.barrier()
    assets = ensure_assets(c)
    if dist.is_main:
        dist.barrier()
    m = load_models(c, assets, device, dist)
    m.policy.eval()  # dropout off: the loss must see the distribution that sampled (ratio = 1 on-policy)
    updates_per_step = t.epochs * (t.batch_size // t.mini_batch_size)

    def make_scheduler(opt):
        return get_scheduler(t.lr_scheduler, opt, num_warmup_steps=t.warmup_steps * updates_per_step,
                             num_training_steps=t.steps * updates_per_step)

    engine = None
    if dist.enabled:
        import deepspeed

        engine, opt, _, sched = deepspeed.initialize(model=m.policy, model_parameters=m.policy.parameters(),
                                                     config=deepspeed_config(c, dist.world_size, device),
                                                     lr_scheduler=make_scheduler)
        m.policy = engine.module
        m.policy.eval()
    else:
        opt = torch.optim.AdamW(m.policy.parameters(), lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay,
                                fused=True)  # one fused kernel (CPU and CUDA) instead of per-tensor loops
        sched = make_scheduler(opt)
    sampler = PromptSampler(len(assets.train), t.batch_size // t.num_generations, c.seed)
    rm_embedding = gathered(m.rm.get_input_embeddings().weight).float() if RM_EMBEDDING in scheme.needs else None
    dtype = resolve_dtype(c.policy.dtype, device)
    amp = dtype if dtype != torch.float32 else None  # fp32 master weights, low-precision compute
    return Session(c, m, assets, device, scheme, credit_params, opt, sched, sampler, rm_embedding, amp,
                   dist=dist, engine=engine)


class PassPlan(NamedTuple):
    on_policy: bool  # one epoch, one mini-batch: the loss's old log-probs are the current ones
    wants_dist: bool  # the credit scheme reads the rollout policy's distribution
    reuse: bool  # ... and takes it from the sampler's kept logits (no second forward pass)


def pass_plan(t, needs: frozenset[str], vocab_size: int) -> PassPlan:
    """Which no-grad passes of the rollout policy a step makes, for trainer settings ``t`` and a
    scheme's declared inputs (also read by scripts/memory_plan.py)."""
    on_policy = t.epochs == 1 and t.mini_batch_size == t.batch_size
    wants_dist = bool(needs & {POLICY_LOGITS, ENTROPY, OLD_LOGPS, POLICY_HIDDEN})
    reuse = on_policy and wants_dist and POLICY_HIDDEN not in needs and (  # the sampler keeps no hidden states
        t.reuse_rollout_logits == "always"
        or (t.reuse_rollout_logits == "auto" and t.batch_size * t.max_new_tokens * vocab_size <= REUSE_LOGITS_MAX_ELEMENTS))
    return PassPlan(on_policy, wants_dist, reuse)


def train_step(s: Session, it: int) -> dict[str, float]:
    """One iteration of the spine: rollout → reward → credit → loss → update. Returns its
    metrics (``reward/``, ``rollout/``, ``credit/``, ``loss/``, ``perf/``)."""
    with s.autocast():
        return _train_step(s, it)


def _train_step(s: Session, it: int) -> dict[str, float]:
    c, t, m, needs = s.c, s.c.trainer, s.m, s.scheme.needs
    t0 = time.perf_counter()
    indices = s.sampler.indices(it)
    examples = [s.assets.train[i] for i in indices[s.dist.shard(len(indices))]]  # whole groups per rank

    # ---- rollout: G samples per prompt ----------------------------------------------------
    reuse = pass_plan(t, needs, m.vocab_size).reuse
    per_call = (t.generation_batch_size or len(examples) * t.num_generations) // t.num_generations  # prompts
    ro = cat_rollouts([sample_groups(m.policy, m.tok, examples[i : i + per_call], t.num_generations, t.max_new_tokens,
                                     t.temperature, t.top_p, c.data.prompt_field, keep_logits=reuse,
                                     synced_gpus=m.synced_gpus, encoder=m.encoder)
                       for i in range(0, len(examples), per_call)], m.tok.pad_token_id)
    return _learn(s, it, ro, reuse, t0)


def _learn(s: Session, it: int, ro: Rollout, reuse: bool, t0: float) -> dict[str, float]:
    """Everything after the rollout: reward → credit → loss → update, on this rank's responses
    (whole groups). ``reuse``: ``ro.logits`` holds generate's logits for the credit."""
    c, t, m, needs = s.c, s.c.trainer, s.m, s.scheme.needs
    on_policy, wants_dist, _ = pass_plan(t, needs, m.vocab_size)
    mask = ro.response_mask
    if t.mask_truncated:  # TRL's mask_truncated_completions: no loss on unfinished responses
        mask = mask & ~ro.truncated[:, None]
    t1 = time.perf_counter()

    # ---- reward: frozen RM (+ its input-embedding gradient when declared) + rules ----------
    inp = m.score_inputs(ro)
    rm_out = score(m.rm, inp, ro.response_mask, with_grad=RM_GRAD in needs, batch_size=t.micro_batch_size)
    gold, gold_contrib = (gold_of(s.assets.task, m.tok, ro.examples, ro.response_ids, ro.response_mask)
                          if s.assets.task is not None else (None, None))
    rewards = c.reward.scale * rm_out.scores
    rule_metrics = {}
    if c.reward.rules:
        ctx = RuleContext(ro.response_mask, ro.truncated, gold, ro.examples)
        for rule in c.reward.rules:
            r = RULES.get(rule.name)(ctx).to(rewards)
            rewards = rewards + rule.weight * r
            rule_metrics[f"reward/rule_{rule.name}"] = float(r.mean())
    nf = s.nonfinite = NonFiniteReport(len(rewards))  # NaN/inf caught per stage (datc.numerics)
    finite_rewards, mask, bad_reward = drop_nonfinite_rewards(rewards, mask, t.num_generations)
    nf.add("reward", bad_reward)
    advantages = group_advantages(finite_rewards, t.num_generations, t.scale_rewards)
    advantages, bad_adv = zero_nonfinite_advantages(advantages, dropped=bad_reward)
    nf.add("advantage", bad_adv)
    t2 = time.perf_counter()

    # ---- credit: token weights w, Â = A · w ----------------------------------------------
    rm_grad, bad_rm_grad = zero_nonfinite_rm_grad(rm_out.grad)
    nf.add("rm_grad", bad_rm_grad)
    ref_logps = (rollout_policy_pass(m.ref, ro, t.temperature, t.micro_batch_size, False, with_entropy=False)[0]
                 if m.ref is not None else None)
    B = ro.response_ids.shape[0]
    # A row-local scheme that reads the policy's logits gets them one micro-batch of rows at a
    # time, so the (B, T, V) logits are never all held (at a real vocabulary, the largest tensor).
    rows = t.micro_batch_size if s.scheme.row_local and POLICY_LOGITS in needs and not reuse else B
    generator = torch.Generator().manual_seed(c.seed * 1_000_003 + it)
    parts, old_parts, ent_parts = [], [], []
    for i in range(0, B, rows):
        sl = slice(i, i + rows)
        sub = ro if rows >= B else ro.select(sl)
        old_logps = entropy = logits = credit_old_logps = hidden = None
        if reuse:  # the rollout distribution as generate computed it: no second forward pass
            logits = sub.logits / t.temperature
            entropy = entropy_from_logits(logits)
            credit_old_logps = selective_log_softmax(logits, sub.response_ids) if OLD_LOGPS in needs else None
        elif not on_policy or wants_dist:
            old_logps, entropy, logits, *rest = rollout_policy_pass(m.policy, sub, t.temperature, t.micro_batch_size,
                                                                    POLICY_LOGITS in needs, POLICY_HIDDEN in needs)
            hidden = rest[0] if rest else None
            credit_old_logps = old_logps
        prompts = [m.encoder.text(ex) for ex in sub.examples] if PROMPTS in needs else None
        logps_under = (logps_under_prompts(m.policy, m.tok, sub, t.temperature, t.micro_batch_size, m.encoder)
                       if LOGPS_UNDER in needs else None)
        parts.append(compute_credit(s.scheme, CreditBatch(
            response_ids=sub.response_ids, response_mask=mask[sl], advantages=advantages[sl],
            rm_grad=rm_grad[sl] if rm_grad is not None else None, rm_embedding=s.rm_embedding,
            policy_logits=logits, entropy=entropy, old_logps=credit_old_logps, prompts=prompts,
            logps_under=logps_under, policy_hidden=hidden, generator=generator,
            all_sum=s.dist.tensor_sum if s.dist.world_size > 1 else None,  # "global" = the global batch
            all_cat=s.dist.tensor_cat if s.dist.world_size > 1 else None,
        ), s.credit_params))
        old_parts.append(old_logps)
        ent_parts.append(entropy)
        logits = hidden = None  # this chunk's credit inputs are spent
    credit = _cat_credit(parts)
    old_logps = torch.cat(old_parts) if old_parts[0] is not None else None
    entropy = torch.cat(ent_parts) if ent_parts[0] is not None else None
    credit, bad_weight = uniform_nonfinite_weights(credit, mask, forced=bad_rm_grad)
    nf.add("weight", bad_weight)
    token_adv = advantages[:, None] * credit.weights  # (B, T)
    if s.dist.is_main and c.logger.name == "wandb" and ((it + 1) % t.eval_every == 0 or it + 1 == t.steps):  # for the eval's W&B table
        s.completions = completions_of(m.tok, [m.encoder.text(ex) for ex in ro.examples], ro.response_ids, mask, rewards,
                                       advantages, credit.weights, c.logger.log_samples)
    # The credit inputs are spent: free generate's (B, T, V) logits and the RM gradients before
    # the update's own activations (at a real vocabulary they are the step's largest tensors).
    rm_grad = ro.logits = rm_out.grad = None  # noqa: F841
    t3 = time.perf_counter()

    # ---- loss and update ------------------------------------------------------------------
    stats = _update(c, m.policy, s.opt, s.sched, ro, mask, token_adv, old_logps, ref_logps, nf, s.engine, s.dist)
    t4 = time.perf_counter()

    n_tokens = int(ro.response_mask.sum())
    rollout_entropy = stats.pop("entropy")
    if entropy is not None:
        rollout_entropy = float((entropy * ro.response_mask).sum() / max(n_tokens, 1))
    metrics = {
        "reward/total": _finite_mean(rewards),
        "reward/rm_score": _finite_mean(rm_out.scores),
        "reward/rm_score_std": _finite_std(rm_out.scores),
        "reward/advantage_abs": float(advantages.abs().mean()),
        **rule_metrics,
        "rollout/response_len": float(ro.response_mask.float().sum(-1).mean()),
        "rollout/truncated_frac": float(ro.truncated.float().mean()),
        "rollout/entropy": rollout_entropy,
        **{f"loss/{k}": v for k, v in stats.items()},
        **credit_metrics(credit, advantages, mask, gold_contrib),
        **nf.metrics(),
        "perf/step_s": t4 - t0, "perf/rollout_s": t1 - t0, "perf/reward_s": t2 - t1,
        "perf/credit_s": t3 - t2, "perf/update_s": t4 - t3,
        "perf/tokens_per_s": n_tokens / (t4 - t0), "perf/samples_per_s": t.batch_size / (t4 - t0),
        "perf/peak_mem_gb": peak_memory_gb(s.device),
    }
    if gold is not None:
        metrics["reward/gold"] = float(gold.mean())
        metrics["reward/rm_gold_corr"] = within_group_corr(rm_out.scores, gold, t.num_generations)
    return _across_ranks(s.dist, metrics)


def _cat_credit(parts: list) -> Any:
    """The credit of consecutive row chunks as one :class:`datc.credit.CreditOutput`."""
    if len(parts) == 1:
        return parts[0]
    scores = None if parts[0].scores is None else torch.cat([p.scores for p in parts])
    return dataclasses.replace(parts[0], weights=torch.cat([p.weights for p in parts]), scores=scores,
                               fallback=torch.cat([p.fallback for p in parts]))


def _across_ranks(dist: Dist, metrics: dict[str, float]) -> dict[str, float]:
    """One rank's step metrics -> the run's: means over ranks (every rank holds equally many
    responses), token throughput summed, the slowest rank's times."""
    if dist.world_size == 1:
        return metrics
    parts = dist.gather(metrics)
    out = {}
    for k in metrics:
        vals = [p[k] for p in parts if isinstance(p.get(k), (int, float)) and math.isfinite(p[k])]
        if not vals:
            out[k] = metrics[k]
        elif k == "perf/tokens_per_s":
            out[k] = sum(vals)
        elif k == "perf/peak_mem_gb":
            out[k] = max(vals)
        elif k == "perf/samples_per_s":
            out[k] = min(vals)
        elif k.startswith("perf/") and k.endswith("_s"):
            out[k] = max(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out


def train(cfg: DictConfig | dict, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Run one experiment; return its summary (also written to ``<run_dir>/summary.json``).

    Under DeepSpeed every process calls this; rank 0 owns the run directory, the metrics, W&B
    and the summary, every rank writes its own shards and RNG state into the checkpoints."""
    c = validate(cfg)  # typed and range-checked before any model loads
    dist = init_distributed(c)  # world-size checks, then the process group (DeepSpeed only)
    try:
        return _train(c, _resolved(cfg), dist, run_dir)
    finally:
        dist.close()


def _train(c: TrainConfig, resolved: dict[str, Any], dist: Dist, run_dir: str | Path | None) -> dict[str, Any]:
    t = c.trainer
    run, done = _open_run(dist, run_dir or c.run_dir, resolved, t.resume)
    if done is not None:  # this run already finished: nothing to redo
        if dist.is_main and c.results_dir is not None:  # e.g. `make demo-results` after `make demo`
            atomic_write_json(Path(c.results_dir) / f"{c.run_name}.json", done)
        return done
    torch.set_num_threads(t.threads)
    quiet_libraries()
    try:
        s = build_session(c, dist)
    except BaseException:
        if dist.is_main:
            run.discard()
        raise
    # Seeded after the set-up: a cold cache (prepare draws random numbers) and a warm one must
    # give the same run. Rank r samples its own responses (rank 0's stream is a lone run's).
    seed_everything(c.seed + 1_000_003 * dist.rank)
    logger = RunLogger(run.path, run.metrics_file, c.logger, c.run_name, run.wandb_id, resolved) if dist.is_main else _NoLogger()
    eval_rows = list(s.assets.eval)[: t.eval_size]

    start, elapsed = 0, 0.0
    ckpt = latest_checkpoint(run.path) if run.resumable else None
    if ckpt is not None:
        if s.engine is None:
            state = load_checkpoint(ckpt)
            if state.get("deepspeed"):
                raise ConfigError(f"deepspeed: {ckpt} was written under DeepSpeed ({state['world_size']} processes); "
                                  "resume it with the same deepspeed stage and process count")
            s.m.policy.load_state_dict(state["policy"])
            s.opt.load_state_dict(state["optimizer"])
            s.sched.load_state_dict(state["scheduler"])
        else:
            state = load_engine_checkpoint(ckpt, s.engine, dist.rank, dist.world_size)
        set_rng_state(state["rng"])
        start, elapsed = state["step"], state["elapsed"]
    if dist.is_main:
        run.truncate_metrics(start if ckpt is not None else -1)

    def do_eval(step: int) -> None:
        with s.autocast():  # every rank evaluates (ZeRO-3 gathers need all of them); rank 0 logs
            metrics, samples = evaluate(c, s.m, eval_rows, s.assets.task, s.device)
        logger.log(metrics, step)
        logger.log_samples(samples, step)
        logger.log_completions(s.completions, step)

    if start == 0:
        do_eval(0)
    bar = tqdm(range(start, t.steps), initial=start, total=t.steps, disable=not (t.progress and dist.is_main), desc=c.run_name)
    for it in bar:
        metrics = train_step(s, it)
        step = it + 1
        elapsed += metrics["perf/step_s"]
        logger.log(metrics, step)
        _merged_nonfinite(dist, s.nonfinite).check(t.max_nonfinite_frac, step)  # after the step is logged
        if step % t.eval_every == 0 or step == t.steps:
            do_eval(step)
        if step % t.checkpoint_every == 0 or step == t.steps:
            if s.engine is None:
                save_checkpoint(run.path, step, {"policy": s.m.policy.state_dict(), "optimizer": s.opt.state_dict(),
                                                 "scheduler": s.sched.state_dict(), "rng": rng_state(), "elapsed": elapsed},
                                t.keep_checkpoints)
            else:
                save_engine_checkpoint(run.path, step, s.engine, {"elapsed": elapsed}, {"rng": rng_state()},
                                       dist.rank, dist.world_size, dist.barrier, t.keep_checkpoints)
        bar.set_postfix({k.split("/")[1]: f"{metrics[k]:.3f}" for k in ("reward/gold", "reward/rm_score", "loss/kl")
                         if k in metrics})

    save_final_policy(s.engine or s.m.policy, s.m.tok, run.path / "final", dist)  # a Hugging Face checkpoint
    summary = None
    if dist.is_main:
        summary = _summary(c, run, s.assets, elapsed)
        atomic_write_json(run.summary_file, summary)
        if c.results_dir is not None:
            atomic_write_json(Path(c.results_dir) / f"{c.run_name}.json", summary)
        logger.finish(dict(summary["eval"]["final"]))
    return dist.broadcast(summary)


class _NoLogger:
    """Ranks other than 0 log nothing."""

    def log(self, *args: Any) -> None: ...

    def log_samples(self, *args: Any) -> None: ...

    def log_completions(self, *args: Any) -> None: ...

    def finish(self, *args: Any) -> None: ...


def _open_run(dist: Dist, path: str | Path, resolved: dict[str, Any], resume: str) -> tuple[RunDir, dict | None]:
    """Rank 0 opens (or refuses) the run directory; every rank learns the outcome, so a refusal
    stops all of them with the same message. Returns (run, summary if the run already finished)."""
    outcome: tuple = ()
    if dist.is_main:
        try:
            run = RunDir.open(path, resolved, resume)
            outcome = ("ok", run, json.loads(run.summary_file.read_text()) if run.summary_file.exists() else None)
        except ConfigError as e:
            dist.broadcast(("error", str(e), None))
            raise
    outcome = dist.broadcast(outcome)
    if outcome[0] == "error":
        raise ConfigError(outcome[1])
    return outcome[1], outcome[2]


def _merged_nonfinite(dist: Dist, report: NonFiniteReport) -> NonFiniteReport:
    """The step's non-finite hits over all ranks, so every rank stops (or not) together."""
    if dist.world_size == 1:
        return report
    parts = dist.gather(report)
    merged = NonFiniteReport(sum(p.batch_size for p in parts))
    for src in {k for p in parts for k in p.hits}:
        merged.add(src, torch.cat([p.hits.get(src, torch.zeros(p.batch_size, dtype=torch.bool)) for p in parts]))
    merged.nonfinite_micro_batches = sum(p.nonfinite_micro_batches for p in parts)
    return merged


def _update(c: TrainConfig, policy, opt, sched, ro: Rollout, mask, token_adv, old_logps, ref_logps,
            nf: NonFiniteReport, engine=None, dist: Dist | None = None) -> dict[str, float]:
    """``epochs`` passes over the rollout batch in mini-batches (one optimizer step each),
    accumulated over micro-batches; the aggregation normalizers are the mini-batch's, so the
    accumulated gradient equals the mini-batch's gradient. A non-finite micro-batch loss is
    not backpropagated (recorded in ``nf``); a mini-batch left without any gradient, or with a
    non-finite gradient norm, takes no optimizer step (``skipped_steps``).

    Under DeepSpeed (``engine``) each of the W ranks holds 1/W of every mini-batch. The
    normalizers are the global mini-batch's (token counts summed over ranks) and each rank's
    loss is scaled by W, because DeepSpeed averages gradients over ranks: the reduced gradient is
    again exactly the mini-batch's. Every rank must then run the same backward passes (their
    gradient reductions are collective), so a non-finite micro-batch loss is zeroed token-wise
    rather than skipped, and clipping and the step are DeepSpeed's."""
    t = c.trainer
    dist = dist or Dist()
    W = dist.world_size if engine is not None else 1
    B, T = ro.response_ids.shape
    mini = t.mini_batch_size // W
    micro_size = min(t.micro_batch_size, mini)
    sums: dict[str, float] = {"kl": 0.0, "clip_frac": 0.0, "ratio": 0.0, "entropy": 0.0, "total": 0.0,
                              "grad_norm": 0.0, "skipped_steps": 0.0}
    n_tok_total, n_updates = 0.0, 0
    for _ in range(t.epochs):
        order = torch.randperm(B) if mini < B else torch.arange(B)
        for mb in order.split(mini):
            norm = AggNorm(num_seqs=len(mb) * W, num_tokens=dist.sum(mask[mb].sum()), norm_len=T)
            if norm.num_tokens == 0:  # every response masked (e.g. all truncated with mask_truncated):
                sums["skipped_steps"] += 1  # no step, or Adam's momentum alone would move the policy
                sched.step()
                n_updates += 1
                continue
            if engine is None:
                opt.zero_grad(set_to_none=True)
            backpropagated = 0
            for micro in mb.split(micro_size):
                z = policy_logits(engine or policy, ro, micro, t.temperature)
                logps = selective_log_softmax(z, ro.response_ids[micro])
                old = old_logps[micro] if old_logps is not None else logps.detach()
                out = clipped_policy_loss(logps, old, token_adv[micro], t.epsilon_low, t.epsilon_high, t.beta,
                                          ref_logps[micro] if ref_logps is not None else None)
                mk = mask[micro]
                loss = aggregate(out.loss, mk, t.loss_agg, norm)
                if not loss_is_finite(loss):  # never backpropagate NaN/inf
                    nf.nonfinite_micro_batches += 1
                    nf.add("loss", torch.zeros(B, dtype=torch.bool).index_fill_(0, micro.cpu(), True))
                    if engine is None:
                        continue
                    loss = aggregate(torch.where(torch.isfinite(out.loss), out.loss, torch.zeros_like(out.loss)), mk,
                                     t.loss_agg, norm)
                if engine is not None:
                    engine.backward(loss * W, scale_wrt_gas=False)
                    engine.step()  # applies the update only at the mini-batch's last micro-batch
                else:
                    loss.backward()
                backpropagated += 1
                mkf = mk.float()
                with torch.no_grad():
                    sums["total"] += float(loss)
                    sums["clip_frac"] += float((out.clipped.float() * mkf).sum())
                    sums["ratio"] += float((out.ratio * mkf).sum())
                    sums["entropy"] += float((entropy_from_logits(z.detach()) * ro.response_mask[micro]).sum())
                    if out.kl is not None:
                        sums["kl"] += float((out.kl * mkf).sum())
                n_tok_total += float(mkf.sum())
            if engine is not None:
                gn = engine.get_global_grad_norm()
                grad_norm = torch.tensor(float(gn) if gn is not None else math.nan)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), t.max_grad_norm)
                if backpropagated and torch.isfinite(grad_norm):
                    opt.step()
                else:  # never step on a non-finite gradient
                    sums["skipped_steps"] += 1
                sched.step()
            sums["grad_norm"] += float(grad_norm)
            n_updates += 1
    # the global mini-batch's figures (each rank's loss is its share of it; one process: as they are)
    sums = {k: dist.sum(v) if k in ("total", "kl", "clip_frac", "ratio", "entropy") else v for k, v in sums.items()}
    n_tok_total = dist.sum(n_tok_total)
    n_resp_tok = dist.sum(ro.response_mask.sum())
    n_tok = max(n_tok_total, 1.0)
    return {
        "total": sums["total"] / n_updates,
        "kl": sums["kl"] / n_tok,
        "clip_frac": sums["clip_frac"] / n_tok,
        "ratio": sums["ratio"] / n_tok,
        "grad_norm": sums["grad_norm"] / n_updates,
        "skipped_steps": sums["skipped_steps"],
        "lr": sched.get_last_lr()[0],
        "entropy": sums["entropy"] / max(n_resp_tok * t.epochs, 1.0),
    }


def _summary(c: TrainConfig, run: RunDir, assets: Assets, elapsed: float) -> dict[str, Any]:
    rows = run.read_metrics()
    evals = [r for r in rows if "eval/rm_score" in r]
    trains = [r for r in rows if "perf/step_s" in r]
    out: dict[str, Any] = {
        "run_name": c.run_name, "run_id": run.run_id, "seed": c.seed,
        "credit": c.credit.get("name", c.credit.get("_target_")), "policy": c.policy.name, "data": c.data.name,
        "steps": c.trainer.steps, "wall_time_s": round(elapsed, 2), "git_commit": GIT_COMMIT,
        "eval": {"initial": {k: v for k, v in evals[0].items() if k != "step"} if evals else {},
                 "final": {k: v for k, v in evals[-1].items() if k != "step"} if evals else {},
                 "curve": [{"step": r["step"], "gold": r.get("eval/gold"), "rm_score": r["eval/rm_score"]} for r in evals]},
        "rm_report": assets.rm_report,
    }
    golds = [(r["step"], r["eval/gold"]) for r in evals if r.get("eval/gold") is not None]
    if len(golds) > 1:  # normalized area under the gold curve (trapezoid rule, per step)
        area = sum((s1 - s0) * (g0 + g1) / 2 for (s0, g0), (s1, g1) in zip(golds, golds[1:], strict=False))
        out["eval"]["gold_auc"] = area / (golds[-1][0] - golds[0][0])
    if trains:
        keys = [k for k in trains[0] if k.startswith(("perf/", "credit/"))]
        out["train_mean"] = {k: _mean([r.get(k) for r in trains]) for k in keys}
    return out


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far, GiB: allocated on the GPU, else this process's resident high-water
    mark (VmHWM; NaN where /proc is missing)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_mb() / 1024


def _finite_mean(x: torch.Tensor) -> float:
    """Mean of the finite entries of ``x`` (NaN if none); non-finite ones are counted apart."""
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else math.nan


def _finite_std(x: torch.Tensor) -> float:
    """Std of the finite entries of ``x`` (NaN if fewer than two)."""
    x = x[torch.isfinite(x)]
    return float(x.std()) if x.numel() > 1 else math.nan


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None
