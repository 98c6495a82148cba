"""The step's metrics: ``reward/``, ``rollout/``, ``credit/``, ``loss/``, the non-finite counts
and the ``perf/`` phase timers, averaged over ranks (each key is described in the docs'
metrics reference)."""

from __future__ import annotations

import math

import torch

from datc.backends.distributed import Dist
from datc.batch import Rollout
from datc.credit.diagnostics import credit_metrics
from datc.math.metrics import finite_mean, finite_std, within_group_corr
from datc.step.credit import Credited
from datc.step.reward import Rewarded
from datc.utils import resident_mb


def step_metrics(s, ro: Rollout, rw: Rewarded, cr: Credited, stats: dict[str, float],
                 times: tuple[float, float, float, float, float]) -> dict[str, float]:
    """The step's metrics, averaged over ranks: ``reward/``, ``rollout/``, ``loss/`` (from
    ``stats``, :func:`update`'s figures), ``credit/``, the non-finite counts and ``perf/``.
    ``times``: perf_counter at the step's start, after the rollout, after the frozen models'
    passes and the rewards (``perf/reward_s``: the reference and the reward model, whatever the
    plan), after the credit and after the update."""
    t = s.c.trainer
    t0, t1, t2, t3, t4 = times
    n_tokens = int(ro.response_mask.sum())
    rollout_entropy = stats.pop("entropy")
    if cr.entropy is not None:
        rollout_entropy = float((cr.entropy * ro.response_mask).sum() / max(n_tokens, 1))
    host = resident_mb()
    metrics = {
        "reward/total": finite_mean(rw.rewards),
        "reward/rm_score": finite_mean(rw.scores),
        "reward/rm_score_std": finite_std(rw.scores),
        "reward/advantage_abs": float(rw.advantages.abs().mean()),
        **rw.rule_metrics,
        "rollout/response_len": float(ro.response_mask.float().sum(-1).mean()),
        "rollout/truncated_frac": float(ro.truncated.float().mean()),
        # responses whose first token ended them (the length collapse of METHOD §6, datc.math.collapse)
        "rollout/first_token_end_frac": float(((ro.response_mask.sum(-1) == 1) & ~ro.truncated).float().mean()),
        "rollout/entropy": rollout_entropy,
        "credit/skipped_frac": float((~rw.credited).float().mean()),  # responses left out of the credit (A = 0)
        **{(k if "/" in k else f"loss/{k}"): v for k, v in stats.items()},  # rollout/sampler_*: the engine's gap
        **credit_metrics(cr.credit, rw.advantages, rw.mask, rw.gold_contrib),
        **rw.nonfinite.metrics(),
        "perf/step_s": t4 - t0, "perf/rollout_s": t1 - t0, "perf/reward_s": t2 - t1,
        "perf/credit_s": t3 - t2, "perf/update_s": t4 - t3,
        "perf/tokens_per_s": n_tokens / (t4 - t0), "perf/samples_per_s": t.batch_size / (t4 - t0),
        # host memory now (a run's trace of it over steps shows whether it stays flat) and the peak so far,
        # read together (datc.utils.resident_mb): the host peak is never below the resident set beside it
        "perf/rss_gb": host[0] / 1024,
        "perf/peak_mem_gb": peak_memory_gb(s.device, host[1]),
        **s.stream.figures(),  # rollout.max_staleness > 0: the batch's staleness and the waits (datc.step.stream)
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
        elif k in ("perf/peak_mem_gb", "perf/rss_gb"):
            out[k] = max(vals)
        elif k == "perf/samples_per_s":
            out[k] = min(vals)
        elif k.startswith("perf/") and k.endswith("_s"):
            out[k] = max(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out



def peak_memory_gb(device: torch.device, host_peak_mb: float) -> float:
    """Peak memory so far, GiB: allocated on the GPU, else this process's resident high-water
    mark (VmHWM, ``host_peak_mb``; NaN where /proc is missing)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_peak_mb / 1024
