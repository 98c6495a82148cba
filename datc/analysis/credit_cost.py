"""``credit=datc`` against ``credit=grpo`` on the same work, paired: two sessions of one config,
each step started from the same weights and random stream (so both sample the same responses),
steps interleaved (grpo, datc, datc, grpo, ...). Shared by scripts/bench/credit.py (the testbed
figure of results/bench/credit.md) and scripts/results/paired_cost.py (any preset)."""

from __future__ import annotations

import statistics

import torch


def paired_steps(steps: int, overrides: list[str]) -> dict:
    """``steps`` measured pairs of training steps (after 2 warm-up pairs): medians of the step and
    its phases per scheme, the ratio of the medians, the quartiles of the paired ratios, the
    reward phase's extra time (the reward model's input gradient), and both sessions."""
    from datc.analysis.inputs import session_for
    from datc.step import train_step

    sessions = {name: session_for([f"credit={name}", *overrides]) for name in ("grpo", "datc")}
    keys = ["perf/step_s", "perf/rollout_s", "perf/reward_s", "perf/credit_s", "perf/update_s"]
    rows: dict[str, list[dict]] = {name: [] for name in sessions}
    warmup = 2
    for it in range(steps + warmup):
        order = ["grpo", "datc"] if it % 2 == 0 else ["datc", "grpo"]
        # Same weights and same random stream for both: the two steps sample the same responses,
        # so the comparison is of the same work (diverged policies would write other lengths).
        state = {k: v.clone() for k, v in sessions["grpo"].m.policy.state_dict().items()}
        for name in order:
            sessions[name].m.policy.load_state_dict(state)
            torch.manual_seed(10_000 + it)
            m = train_step(sessions[name], it).metrics
            if it >= warmup:
                rows[name].append({k: m[k] for k in keys})
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in rows.items()}
    ratios = [d["perf/step_s"] / g["perf/step_s"] for d, g in zip(rows["datc"], rows["grpo"], strict=True)]
    return {
        "steps_measured": steps,
        "median_seconds": med,
        "datc_over_grpo_step": med["datc"]["perf/step_s"] / med["grpo"]["perf/step_s"],
        "paired_ratio_quartiles": statistics.quantiles(ratios, n=4),
        "rm_gradient_extra_s": med["datc"]["perf/reward_s"] - med["grpo"]["perf/reward_s"],
        "sessions": sessions,
    }
