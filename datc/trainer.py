"""The training loop and its step, top to bottom: rollout → reward → credit → loss → update.

``train(cfg)`` is called by the Hydra entry point (:mod:`datc.train`) and directly by tests.
Each phase of the step is one function with a named result; :func:`train_step` calls them in
order, and the credit analysis (:mod:`datc.credit.analysis`), the benchmark scripts and the
distributed test worker call the same functions. Around the loop: the session
(:mod:`datc.session`), the models (:mod:`datc.model_set`), the policy's no-grad passes
(:mod:`datc.passes`), evaluation (:mod:`datc.evaluation`) and the run's life cycle
(:mod:`datc.lifecycle`).

Shapes: B responses on this rank (whole groups of G, contiguous), T response positions
(right-padded), V vocabulary, d the reward model's hidden size.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor
from tqdm.auto import tqdm

from datc.advantages import group_advantages
from datc.config import TrainConfig, validate
from datc.credit import CreditOutput, compute_credit
from datc.credit.base import (
    ENTROPY,
    LOGPS_UNDER,
    OLD_LOGPS,
    POLICY_HIDDEN,
    POLICY_LOGITS,
    PROMPTS,
    RM_GRAD,
    CreditBatch,
)
from datc.credit.diagnostics import credit_metrics
from datc.distributed import Dist
from datc.distributed import init as init_distributed
from datc.evaluation import evaluate
from datc.export import save_final_policy
from datc.lifecycle import GIT_COMMIT, NoLogger, finish, open_run, resolved_config, resume, save
from datc.logger import RunLogger, completions_of
from datc.logprobs import entropy_from_logits, selective_log_softmax
from datc.losses import AggNorm, aggregate, clipped_policy_loss
from datc.metrics import finite_mean, finite_std, within_group_corr
from datc.model_set import Models, load_models
from datc.numerics import (
    NonFiniteReport,
    drop_nonfinite_rewards,
    loss_is_finite,
    uniform_nonfinite_weights,
    zero_nonfinite_advantages,
    zero_nonfinite_rm_grad,
)
from datc.passes import (
    REUSE_LOGITS_MAX_ELEMENTS,
    PassPlan,
    logps_under_prompts,
    pass_plan,
    policy_logits,
    rollout_policy_pass,
    scaled,
)
from datc.prepare import gold_of
from datc.rewards.model import score
from datc.rewards.rules import RULES, RuleContext
from datc.rollout import Rollout, cat_rollouts, sample_groups
from datc.rundir import release_run_locks
from datc.session import PromptSampler, Session, build_session
from datc.signals import stop_if_requested, stop_requested, stop_signals
from datc.trunk import reference_and_score
from datc.utils import (
    atomic_write_json,
    keep_freed_memory,
    peak_rss_mb,
    quiet_libraries,
    seed_everything,
)

__all__ = [  # the loop and the step's phases; the rest is re-exported from the modules that now hold it
    "GIT_COMMIT", "REUSE_LOGITS_MAX_ELEMENTS", "Credited", "CreditChunk", "Models", "PassPlan", "PromptSampler",
    "Rewarded", "Session", "assign_credit", "build_session", "credit_inputs", "credit_row_slices", "evaluate",
    "learn", "load_models", "logps_under_prompts", "loss_mask", "pass_plan", "policy_logits", "reference_logps", "reward",
    "rollout", "rollout_policy_pass", "step_metrics", "train", "train_step", "update",
]


# ============================================================================================
# The loop
# ============================================================================================


def train(cfg: DictConfig | dict, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Run one experiment; return its summary (also written to ``<run_dir>/summary.json``).

    Under DeepSpeed every process calls this; rank 0 owns the run directory, the metrics, W&B
    and the summary, every rank writes its own shards and RNG state into the checkpoints."""
    c = validate(cfg)  # typed and range-checked before any model loads
    dist = init_distributed(c)  # world-size checks, then the process group (DeepSpeed only)
    try:
        with stop_signals():  # SIGTERM / SIGINT: checkpoint at the next step boundary, then stop
            return _train(c, resolved_config(cfg), dist, run_dir)
    finally:
        release_run_locks()
        dist.close()



def _train(c: TrainConfig, resolved: dict[str, Any], dist: Dist, run_dir: str | Path | None) -> dict[str, Any]:
    t = c.trainer
    run, done = open_run(dist, run_dir or c.run_dir, resolved, t.resume)
    if done is not None:  # this run already finished: nothing to redo
        if dist.is_main and c.results_dir is not None:  # e.g. `make demo-results` after `make demo`
            atomic_write_json(Path(c.results_dir) / f"{c.run_name}.json", done)
        return done
    torch.set_num_threads(t.threads)
    if t.keep_freed_memory and not dist.enabled:  # single-process runs (see the README's speed section)
        keep_freed_memory()
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
    logger = RunLogger(run.path, run.metrics_file, c.logger, c.run_name, run.wandb_id, resolved) if dist.is_main else NoLogger()
    eval_rows = list(s.assets.eval)[: t.eval_size]
    start, elapsed = resume(s, run)

    def do_eval(step: int) -> None:
        with s.autocast():  # every rank evaluates (ZeRO-3 gathers need all of them); rank 0 logs
            metrics, samples = evaluate(c, s.m, eval_rows, s.assets.task, s.device)
        logger.log(metrics, step)
        logger.log_samples(samples, step)
        logger.log_completions(s.completions, step)

    stop_if_requested(stop_requested(dist), start, saved=False)  # a signal during the set-up
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
        stopping = stop_requested(dist)
        if step % t.checkpoint_every == 0 or step == t.steps or stopping:
            save(s, run, step, elapsed)
        bar.set_postfix({k.split("/")[1]: f"{metrics[k]:.3f}" for k in ("reward/gold", "reward/rm_score", "loss/kl")
                         if k in metrics})
        stop_if_requested(stopping and step < t.steps, step)  # the last step finishes the run instead

    save_final_policy(s.engine or s.m.policy, s.m.tok, run.path / "final", dist)  # a Hugging Face checkpoint
    summary = None
    if dist.is_main:
        summary = finish(c, run, s.assets, elapsed)
        logger.finish(dict(summary["eval"]["final"]))
    return dist.broadcast(summary)


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



# ============================================================================================
# The step: rollout → reward → credit inputs → credit → loss and update → metrics
# ============================================================================================


def train_step(s: Session, it: int) -> dict[str, float]:
    """One iteration of the spine: rollout → reward → credit → loss → update. Returns its
    metrics (``reward/``, ``rollout/``, ``credit/``, ``loss/``, ``perf/``)."""
    with s.autocast():
        t0 = time.perf_counter()
        indices = s.sampler.indices(it)
        examples = [s.assets.train[i] for i in indices[s.dist.shard(len(indices))]]  # whole groups per rank
        reuse = pass_plan(s.c.trainer, s.scheme.needs, s.m.vocab_size).reuse
        ro = rollout(s, examples, keep_logits=reuse)
        return learn(s, it, ro, t0)


def learn(s: Session, it: int, ro: Rollout, t0: float) -> dict[str, float]:
    """Everything after the rollout, on this rank's responses (whole groups): reward → credit →
    loss → update → metrics. ``t0``: when the step began (``perf/`` times). When ``ro.logits``
    holds the sampler's logits, the credit reads the rollout distribution from them."""
    t = s.c.trainer
    # the sampler's logits are reused exactly when the rollout kept them (train_step asks for them by the plan)
    plan = pass_plan(t, s.scheme.needs, s.m.vocab_size)._replace(reuse=ro.logits is not None)
    t1 = time.perf_counter()
    rw = reward(s, ro, loss_mask(t, ro), with_grad=RM_GRAD in s.scheme.needs, skip_zero=skips_zero_advantage(s),
                with_ref=True)
    s.nonfinite = rw.nonfinite
    t2 = time.perf_counter()
    ref_logps = rw.ref_logps if rw.ref_logps is not None else reference_logps(s, ro)
    cr = assign_credit(s, it, ro, rw, plan)
    if s.dist.is_main and s.c.logger.name == "wandb" and ((it + 1) % t.eval_every == 0 or it + 1 == t.steps):  # for the eval's W&B table
        s.completions = completions_of(s.m.tok, [s.m.encoder.text(ex) for ex in ro.examples], ro.response_ids, rw.mask,
                                       rw.rewards, rw.advantages, cr.credit.weights, s.c.logger.log_samples)
    # The credit inputs are spent: free generate's (B, T, V) logits and the RM gradients before
    # the update's own activations (at a real vocabulary they are the step's largest tensors).
    ro.logits = rw.rm_grad = None
    t3 = time.perf_counter()
    stats = update(s.c, s.m.policy, s.opt, s.sched, ro, rw.mask, cr.token_adv, cr.old_logps, ref_logps, rw.nonfinite,
                   s.engine, s.dist, s.m.share_prompts)
    t4 = time.perf_counter()
    return step_metrics(s, ro, rw, cr, stats, (t0, t1, t2, t3, t4))


def skips_zero_advantage(s: Session) -> bool:
    """Whether this step's credit phases leave out the responses with ``A = 0``
    (``trainer.skip_zero_advantage``). Their ``Â = A · w`` is 0 whatever their weights, so
    leaving them out changes nothing, provided the other responses' weights do not depend on
    them: only for a ``row_separable`` scheme (per-response weights, no draws shared across
    rows), never for one whose weights compare responses (``delta``, ``entropy_top``: batch-wide
    centroids, quantiles and normalizers must see the whole batch), which is computed in full.
    Off under ZeRO-3 with several ranks, where every rank must run as many forwards as the others."""
    return s.c.trainer.skip_zero_advantage and s.scheme.row_separable and not s.m.synced_gpus


# ---- rollout: G samples per prompt ------------------------------------------------------------


def rollout(s: Session, examples: list[dict], keep_logits: bool = False) -> Rollout:
    """``num_generations`` responses to each example, sampled in calls of
    ``generation_batch_size`` responses and joined (groups contiguous). ``keep_logits``: keep
    generate's logits (B, T, V) in ``ro.logits`` for the credit (see :func:`datc.passes.pass_plan`)."""
    c, t, m = s.c, s.c.trainer, s.m
    per_call = (t.generation_batch_size or len(examples) * t.num_generations) // t.num_generations  # prompts
    return cat_rollouts([sample_groups(m.policy, m.tok, examples[i : i + per_call], t.num_generations, t.max_new_tokens,
                                       t.temperature, t.top_p, c.data.prompt_field, keep_logits=keep_logits,
                                       synced_gpus=m.synced_gpus, encoder=m.encoder, share_prompts=m.share_prompts)
                         for i in range(0, len(examples), per_call)], m.tok.pad_token_id)


def loss_mask(t, ro: Rollout) -> Tensor:
    """(B, T) bool: the response tokens the loss may use, before the non-finite guards."""
    mask = ro.response_mask
    if t.mask_truncated:  # TRL's mask_truncated_completions: no loss on unfinished responses
        mask = mask & ~ro.truncated[:, None]
    return mask


# ---- reward: frozen RM (+ its input-embedding gradient when declared) + rules -------------------


@dataclass
class Rewarded:
    """The reward phase's result for B responses, non-finite values already repaired."""

    scores: Tensor  # (B,) the reward model's scores, as it gave them (may hold NaN/inf)
    rewards: Tensor  # (B,) reward.scale · scores + weighted rules, as computed (may hold NaN/inf)
    advantages: Tensor  # (B,) group advantages, finite: 0 for responses with a non-finite reward or advantage
    mask: Tensor  # (B, T) bool loss mask: the given mask minus responses with a non-finite reward
    rm_grad: Tensor | None  # (B, T, d) the RM's input-embedding gradient, non-finite rows zeroed; None unless asked
    bad_rm_grad: Tensor | None  # (B,) bool, responses whose rm_grad row was zeroed (they get w = 1)
    gold: Tensor | None  # (B,) gold reward on a testbed task (on the CPU), else None
    gold_contrib: Tensor | None  # (B, T) per-token gold contribution, 0 on padding; or None
    rule_metrics: dict[str, float]  # reward/rule_<name>: mean of each rule's term
    nonfinite: NonFiniteReport  # hits at the reward, advantage and rm_grad stages
    credited: Tensor  # (B,) bool, the responses the credit phases work on: all, or those with A != 0 (skip_zero)
    ref_logps: Tensor | None = None  # (B, T) the reference's log-probs, when its pass also scored (datc.trunk)

    def select(self, rows: Tensor) -> Rewarded:
        """Responses ``rows`` (k,) long; the rule metrics and the non-finite report stay the step's."""
        def pick(x):
            return None if x is None else x[rows.to(x.device)]

        return Rewarded(pick(self.scores), pick(self.rewards), pick(self.advantages), pick(self.mask),
                        pick(self.rm_grad), pick(self.bad_rm_grad), pick(self.gold), pick(self.gold_contrib),
                        self.rule_metrics, self.nonfinite, pick(self.credited), pick(self.ref_logps))


def reward(s: Session, ro: Rollout, mask: Tensor, with_grad: bool, shaped: bool = True,
           skip_zero: bool = False, with_ref: bool = False) -> Rewarded:
    """Score the responses with the frozen reward model (and, ``with_grad``, its gradient with
    respect to its input embeddings), add the rules, and turn rewards into group advantages,
    with the non-finite guards of :mod:`datc.numerics` (reward, advantage, rm_grad stages).

    ``shaped=False``: the reward is the reward model's score alone (no ``reward.scale``, no
    rules), as the credit analysis judges credit against the model it differentiates.

    ``skip_zero`` (``trainer.skip_zero_advantage``, for a ``row_separable`` scheme): the credit
    will work only on the responses with ``A != 0`` (``credited``), so only they need the
    gradient. A backward needs its forward's graph, and ``A`` is known only once every response
    is scored; rather than a second forward, the backward is skipped for the groups whose
    responses are all the same token ids (identical inputs: equal rewards, ``A = 0``), and any
    response that still gets ``A != 0`` has its gradient computed afterwards. Other responses
    with ``A = 0`` (rewards tied by value, non-finite rewards) keep theirs, unused.

    ``with_ref``: when the reward model shares its lower blocks with the reference (``m.trunk``,
    :mod:`datc.trunk`), one reference pass also gives the reference's log-probs
    (``ref_logps``) and the reward model runs its own blocks only; otherwise ``ref_logps`` is None."""
    c, t, m = s.c, s.c.trainer, s.m
    grad_rows = ~identical_groups(ro, t.num_generations) if skip_zero and with_grad else None
    ref_logps = None
    if with_ref and m.trunk and m.ref is not None and ro.prompt_ids.shape[1] > 1:
        ref_logps, rm_out = reference_and_score(m.ref, m.rm, m.trunk, ro, t.temperature, t.micro_batch_size,
                                                with_grad=with_grad, grad_rows=grad_rows)
    else:
        rm_out = score(m.rm, m.score_inputs(ro), ro.response_mask, with_grad=with_grad, batch_size=t.micro_batch_size,
                       grad_rows=grad_rows, share=m.share_prompts)
    gold, gold_contrib = (gold_of(s.assets.task, m.tok, ro.examples, ro.response_ids, ro.response_mask)
                          if s.assets.task is not None else (None, None))
    rewards = c.reward.scale * rm_out.scores if shaped else rm_out.scores
    rule_metrics = {}
    if shaped and c.reward.rules:
        ctx = RuleContext(ro.response_mask, ro.truncated, gold, ro.examples)
        for rule in c.reward.rules:
            r = RULES.get(rule.name)(ctx).to(rewards)
            rewards = rewards + rule.weight * r
            rule_metrics[f"reward/rule_{rule.name}"] = float(r.mean())
    nf = NonFiniteReport(len(rewards))  # NaN/inf caught per stage (datc.numerics)
    finite_rewards, mask, bad_reward = drop_nonfinite_rewards(rewards, mask, t.num_generations)
    nf.add("reward", bad_reward)
    advantages = group_advantages(finite_rewards, t.num_generations, t.scale_rewards)
    advantages, bad_adv = zero_nonfinite_advantages(advantages, dropped=bad_reward)
    nf.add("advantage", bad_adv)
    credited = advantages != 0 if skip_zero else torch.ones_like(advantages, dtype=torch.bool)
    rm_grad = rm_out.grad
    if grad_rows is not None and (missing := credited & ~grad_rows).any():  # an RM that is not batch-invariant
        rows = missing.nonzero().squeeze(-1)
        rm_grad[rows] = score(m.rm, m.score_inputs(ro).select(rows), ro.response_mask[rows], with_grad=True,
                              batch_size=t.micro_batch_size, share=m.share_prompts).grad
    rm_grad, bad_rm_grad = zero_nonfinite_rm_grad(rm_grad)
    nf.add("rm_grad", bad_rm_grad)
    return Rewarded(rm_out.scores, rewards, advantages, mask, rm_grad, bad_rm_grad, gold, gold_contrib, rule_metrics, nf,
                    credited, ref_logps)


def identical_groups(ro: Rollout, num_generations: int) -> Tensor:
    """(B,) bool: True for the responses of each group whose responses are all the same token ids."""
    ids = torch.where(ro.response_mask, ro.response_ids, -1).view(-1, num_generations, ro.response_ids.shape[1])
    same = (ids == ids[:, :1]).all(-1).all(-1)  # (groups,)
    return same.repeat_interleave(num_generations)


def reference_logps(s: Session, ro: Rollout) -> Tensor | None:
    """(B, T) log-probs of the sampled ids under the frozen reference (None without a KL term)."""
    t, m = s.c.trainer, s.m
    return (rollout_policy_pass(m.ref, ro, t.temperature, t.micro_batch_size, False, with_entropy=False,
                                share=m.share_prompts)[0]
            if m.ref is not None else None)


# ---- credit inputs: what the scheme declared, for a chunk of rows --------------------------------


@dataclass
class CreditChunk:
    """The credit inputs of rows ``rows`` of a rollout (b of them), and what the same policy
    pass gives the loss and the metrics."""

    rows: slice  # which rows of the rollout
    batch: CreditBatch  # the scheme's inputs: exactly the fields it declares (b rows)
    old_logps: Tensor | None  # (b, T) the rollout policy's log-probs, for the loss's ratio; None on-policy without a pass
    entropy: Tensor | None  # (b, T) its entropies (nats), for rollout/entropy; None without a pass


def credit_row_slices(s: Session, plan: PassPlan, B: int) -> list[slice]:
    """The row chunks a step computes credit in. A row-local scheme that reads the policy's
    logits gets them one micro-batch of rows at a time, so the (B, T, V) logits are never all
    held (at a real vocabulary, the largest tensor); any other scheme sees the whole batch."""
    needs = s.scheme.needs
    rows = s.c.trainer.micro_batch_size if s.scheme.row_local and POLICY_LOGITS in needs and not plan.reuse else max(B, 1)
    return [slice(i, i + rows) for i in range(0, B, rows)]


def credit_inputs(s: Session, ro: Rollout, rw: Rewarded, rows: slice, plan: PassPlan,
                  generator: torch.Generator | None, needs: frozenset[str] | None = None) -> CreditChunk:
    """Build the :class:`CreditBatch` for rows ``rows`` of ``ro``: the inputs the scheme declares
    (``needs``, default the session scheme's) and nothing else. The rollout policy's
    distribution comes from the sampler's kept logits when ``plan.reuse`` (no second forward
    pass), else from one no-grad :func:`datc.passes.rollout_policy_pass` when the scheme wants
    it or the loss needs old log-probs (``not plan.on_policy``)."""
    t, m = s.c.trainer, s.m
    needs = s.scheme.needs if needs is None else needs
    B = ro.response_ids.shape[0]
    sub = ro if rows.start in (None, 0) and (rows.stop is None or rows.stop >= B) else ro.select(rows)
    old_logps = entropy = logits = credit_old_logps = hidden = None
    # On-policy the update's forward is the rollout policy's, and rollout/entropy comes from it;
    # the entropies here only where the scheme reads them or the update's policy differs.
    with_entropy = ENTROPY in needs or not plan.on_policy
    if plan.reuse:  # the rollout distribution as generate computed it: no second forward pass
        logits = scaled(sub.logits, t.temperature)
        entropy = entropy_from_logits(logits) if with_entropy else None
        credit_old_logps = selective_log_softmax(logits, sub.response_ids) if OLD_LOGPS in needs else None
    elif not plan.on_policy or plan.wants_dist:
        old_logps, entropy, logits, *rest = rollout_policy_pass(m.policy, sub, t.temperature, t.micro_batch_size,
                                                                POLICY_LOGITS in needs, POLICY_HIDDEN in needs,
                                                                with_entropy=with_entropy, share=m.share_prompts)
        hidden = rest[0] if rest else None
        credit_old_logps = old_logps
    prompts = [m.encoder.text(ex) for ex in sub.examples] if PROMPTS in needs else None
    logps_under = (logps_under_prompts(m.policy, m.tok, sub, t.temperature, t.micro_batch_size, m.encoder,
                                       m.share_prompts)
                   if LOGPS_UNDER in needs else None)
    batch = CreditBatch(
        response_ids=sub.response_ids, response_mask=rw.mask[rows], advantages=rw.advantages[rows],
        rm_grad=rw.rm_grad[rows] if rw.rm_grad is not None else None, rm_embedding=s.rm_embedding,
        policy_logits=logits, entropy=entropy, old_logps=credit_old_logps, prompts=prompts,
        logps_under=logps_under, policy_hidden=hidden, generator=generator,
        all_sum=s.dist.tensor_sum if s.dist.world_size > 1 else None,  # "global" = the global batch
        all_cat=s.dist.tensor_cat if s.dist.world_size > 1 else None,
    )
    return CreditChunk(rows, batch, old_logps, entropy)


# ---- credit: token weights w, Â = A · w --------------------------------------------------------


@dataclass
class Credited:
    """The credit phase's result for B responses."""

    credit: CreditOutput  # weights (B, T), scores (B, T) or None, fallback (B,) bool; non-finite weights repaired
    token_adv: Tensor  # (B, T) Â = A · w, the loss's per-token advantages
    old_logps: Tensor | None  # (B, T) the rollout policy's log-probs when a pass was made (None on-policy if rows were skipped), else None
    entropy: Tensor | None  # (B, T) its entropies (nats) when known, else None


def assign_credit(s: Session, it: int, ro: Rollout, rw: Rewarded, plan: PassPlan) -> Credited:
    """The scheme's token weights for the responses ``rw.credited`` (every response unless the
    zero-advantage skip applies, :func:`skips_zero_advantage`), chunk by chunk
    (:func:`credit_row_slices`); a skipped response gets ``w = 1`` (:func:`_with_skipped`). Then
    the ``weight`` stage's guard: a response with a non-finite weight (or a zeroed rm_grad row)
    gets ``w = 1``. Random schemes draw from a generator seeded by (seed, step)."""
    generator = torch.Generator().manual_seed(s.c.seed * 1_000_003 + it)
    keep = rw.credited.nonzero().squeeze(-1)  # (k,) the responses whose credit is computed
    skipping = len(keep) < len(rw.credited)
    ro_c, rw_c = (ro.select(keep), rw.select(keep)) if skipping else (ro, rw)
    parts, old_parts, ent_parts = [], [], []
    for rows in credit_row_slices(s, plan, len(keep)):
        chunk = credit_inputs(s, ro_c, rw_c, rows, plan, generator)
        parts.append(compute_credit(s.scheme, chunk.batch, s.credit_params))
        old_parts.append(chunk.old_logps)
        ent_parts.append(chunk.entropy)
        chunk = None  # this chunk's credit inputs (its (b, T, V) logits) are spent
    credit = _cat_credit(parts) if parts else None
    old_logps = torch.cat(old_parts) if parts and old_parts[0] is not None else None
    entropy = torch.cat(ent_parts) if parts and ent_parts[0] is not None else None
    if skipping:
        credit, old_logps, entropy = _with_skipped(s, ro, rw, plan, keep, credit, old_logps, entropy)
    credit, bad_weight = uniform_nonfinite_weights(credit, rw.mask, forced=rw.bad_rm_grad)
    rw.nonfinite.add("weight", bad_weight)
    token_adv = rw.advantages[:, None] * credit.weights  # (B, T)
    return Credited(credit, token_adv, old_logps, entropy)


def _with_skipped(s: Session, ro: Rollout, rw: Rewarded, plan: PassPlan, keep: Tensor, credit: CreditOutput | None,
                  old_logps: Tensor | None, entropy: Tensor | None) -> tuple[CreditOutput, Tensor | None, Tensor | None]:
    """The whole batch's credit, old log-probs and entropies from those of the credited rows
    ``keep`` (None when there are none). A skipped response (``A = 0``) gets ``w = 1`` on its
    valid tokens and score 0, marked as a fallback, as DATC itself treats a zero advantage.

    On-policy the loss's old log-probs are the current ones, for every response (as on-policy
    without a pass: ratio 1), and ``rollout/entropy`` comes from the update's forward of the same
    policy. Otherwise the loss needs them: one no-grad pass over the skipped responses (no
    logits kept) gives their old log-probs and entropies."""
    B, T = rw.mask.shape
    by_scores = s.scheme.output == "scores"
    whole = CreditOutput(rw.mask.float(), rw.mask.new_zeros(B, T, dtype=torch.float32) if by_scores else None,
                         torch.ones(B, dtype=torch.bool, device=rw.mask.device),
                         "per_response" if by_scores else s.scheme.normalization)
    if credit is not None:
        whole.weights[keep], whole.fallback[keep] = credit.weights, credit.fallback
        if by_scores:
            whole.scores = whole.scores.to(credit.scores.dtype).index_copy(0, keep, credit.scores)
    if plan.on_policy:
        return whole, None, None
    t = s.c.trainer
    skipped = (~rw.credited).nonzero().squeeze(-1)
    logps, ent, _ = rollout_policy_pass(s.m.policy, ro.select(skipped), t.temperature, t.micro_batch_size, False,
                                        share=s.m.share_prompts)
    old_all, ent_all = logps.new_empty(B, T), ent.new_empty(B, T)
    old_all[skipped], ent_all[skipped] = logps, ent
    if old_logps is not None:  # off-policy, the credited rows' pass made them too
        old_all[keep], ent_all[keep] = old_logps, entropy
    return whole, old_all, ent_all


def _cat_credit(parts: list) -> Any:
    """The credit of consecutive row chunks as one :class:`datc.credit.CreditOutput`."""
    if len(parts) == 1:
        return parts[0]
    scores = None if parts[0].scores is None else torch.cat([p.scores for p in parts])
    return dataclasses.replace(parts[0], weights=torch.cat([p.weights for p in parts]), scores=scores,
                               fallback=torch.cat([p.fallback for p in parts]))



# ---- loss and update ------------------------------------------------------------------------------


def update(c: TrainConfig, policy, opt, sched, ro: Rollout, mask, token_adv, old_logps, ref_logps,
           nf: NonFiniteReport, engine=None, dist: Dist | None = None, share: bool = True) -> dict[str, float]:
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
    rather than skipped, and clipping and the step are DeepSpeed's. ``share``: the forwards
    compute each distinct prompt of a micro-batch once (:func:`datc.passes.policy_forward`)."""
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
                z = policy_logits(engine or policy, ro, micro, t.temperature, share)
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



# ---- metrics --------------------------------------------------------------------------------------


def step_metrics(s: Session, ro: Rollout, rw: Rewarded, cr: Credited, stats: dict[str, float],
                 times: tuple[float, float, float, float, float]) -> dict[str, float]:
    """The step's metrics, averaged over ranks: ``reward/``, ``rollout/``, ``loss/`` (from
    ``stats``, :func:`update`'s figures), ``credit/``, the non-finite counts and ``perf/``.
    ``times``: perf_counter at the step's start, after the rollout, the reward, the credit and
    the update."""
    t = s.c.trainer
    t0, t1, t2, t3, t4 = times
    n_tokens = int(ro.response_mask.sum())
    rollout_entropy = stats.pop("entropy")
    if cr.entropy is not None:
        rollout_entropy = float((cr.entropy * ro.response_mask).sum() / max(n_tokens, 1))
    metrics = {
        "reward/total": finite_mean(rw.rewards),
        "reward/rm_score": finite_mean(rw.scores),
        "reward/rm_score_std": finite_std(rw.scores),
        "reward/advantage_abs": float(rw.advantages.abs().mean()),
        **rw.rule_metrics,
        "rollout/response_len": float(ro.response_mask.float().sum(-1).mean()),
        "rollout/truncated_frac": float(ro.truncated.float().mean()),
        "rollout/entropy": rollout_entropy,
        "credit/skipped_frac": float((~rw.credited).float().mean()),  # responses left out of the credit (A = 0)
        **{f"loss/{k}": v for k, v in stats.items()},
        **credit_metrics(cr.credit, rw.advantages, rw.mask, rw.gold_contrib),
        **rw.nonfinite.metrics(),
        "perf/step_s": t4 - t0, "perf/rollout_s": t1 - t0, "perf/reward_s": t2 - t1,
        "perf/credit_s": t3 - t2, "perf/update_s": t4 - t3,
        "perf/tokens_per_s": n_tokens / (t4 - t0), "perf/samples_per_s": t.batch_size / (t4 - t0),
        "perf/peak_mem_gb": peak_memory_gb(s.device),
    }
    if rw.gold is not None:
        metrics["reward/gold"] = float(rw.gold.mean())
        metrics["reward/rm_gold_corr"] = within_group_corr(rw.scores, rw.gold, t.num_generations)
    return _across_ranks(s.dist, metrics)


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



def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far, GiB: allocated on the GPU, else this process's resident high-water
    mark (VmHWM; NaN where /proc is missing)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_mb() / 1024
