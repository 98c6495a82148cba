"""Evaluation on held-out prompts: one sample each, in a forked RNG (training's random stream
is untouched), scored by the reward model and, on a testbed task, by the gold reward."""

from __future__ import annotations

import contextlib

import torch

from datc.config import TrainConfig
from datc.engines.generate import sample_groups
from datc.forward.passes import rollout_policy_pass
from datc.math.losses import kl_k3
from datc.math.metrics import finite_mean, pearson
from datc.rewards.model import score
from datc.step.plan import StepPlan
from datc.tasks import gold_of
from datc.training.model_set import Models


@torch.no_grad()
def evaluate(c: TrainConfig, m: Models, rows: list[dict], task, device: torch.device, plan: StepPlan,
             generation=None) -> tuple[dict[str, float], list[dict]]:
    """Held-out prompts, one sample each, drawn with the eval seed inside a forked RNG so the
    training's random stream is untouched. Returns metrics under ``eval/`` and sample rows.
    Sampling as the step plan decided for the run (decode loop; under partitioned parameters,
    synced ranks or, inside ``generation(gather)``, the optimizer's context, parameters whole)."""
    t = c.trainer
    devices = [device.index or 0] if device.type == "cuda" else []
    generation = generation or (lambda gather: contextlib.nullcontext())
    golds, scores, kls, lens, ents, truncs, samples = [], [], [], [], [], [], []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(t.eval_seed)
        for i in range(0, len(rows), t.eval_batch_size):
            chunk = rows[i : i + t.eval_batch_size]
            with generation(plan.gather_generation):
                ro = sample_groups(m.policy, m.tok, chunk, 1, t.max_new_tokens, t.temperature, t.top_p,
                                   c.data.prompt_field, synced_gpus=plan.sample_synced, encoder=m.encoder,
                                   decode=plan.decode, sync_every=t.decode_sync_every)
            inp = m.score_inputs(ro)  # one response per prompt: no prompt to share (share=False)
            s = score(m.rm, inp, ro.response_mask, batch_size=t.eval_batch_size, share=False).scores
            pol = rollout_policy_pass(m.policy, ro, t.temperature, t.micro_batch_size, False, share=False)
            logps, ent = pol.logps, pol.entropy
            mask = ro.response_mask.float()
            if m.ref is not None:
                ref_logps = rollout_policy_pass(m.ref, ro, t.temperature, t.micro_batch_size, False, with_entropy=False,
                                                share=False).logps
                kls.append((kl_k3(logps, ref_logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
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
        "eval/rm_score": finite_mean(scores_t),  # non-finite scores are counted, not averaged
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
