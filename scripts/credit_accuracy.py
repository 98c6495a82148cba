"""Credit accuracy of every score-based scheme on the same rollouts, written to
results/credit_accuracy/<data>-<policy>.{json,md}.

Rollouts come from the warm-started policy (early training, where credit matters most), or
from a checkpoint; every scheme scores the *same* batches. Reported per scheme: credit accuracy
(mean per-response Spearman between ``sign(A)·s`` and the gold per-token contribution) and the
mean weight of tokens whose gold contribution agrees with the advantage's sign
(``sign(A)·c > 0``: the tokens that earned the response its advantage), is zero, or disagrees.

    python scripts/credit_accuracy.py [--batches 8] [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ["datc", "datc_shuffled", "datc_unsigned", "datc_identity", "datc_magnitude", "rm_saliency"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from hydra import compose, initialize_config_dir

    from datc.advantages import group_advantages
    from datc.config import validate
    from datc.credit import CreditBatch, compute_credit, resolve_scheme
    from datc.credit.diagnostics import credit_accuracy
    from datc.prepare import gold_of
    from datc.rewards.model import build_rm_inputs, score
    from datc.rollout import sample_groups
    from datc.train import CONFIG_DIR
    from datc.trainer import build_session, rollout_policy_pass
    from datc.utils import atomic_write_json, atomic_write_text, quiet_libraries

    quiet_libraries()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["credit=datc", *a.overrides])
    c = validate(cfg)
    torch.manual_seed(c.seed)
    s = build_session(c)
    t, m = c.trainer, s.m
    schemes = {name: resolve_scheme({"name": name}) for name in SCHEMES}
    acc: dict[str, list[float]] = {n: [] for n in SCHEMES}
    wsum = {n: {"agree": 0.0, "neutral": 0.0, "disagree": 0.0} for n in SCHEMES}
    count = {"agree": 0, "neutral": 0, "disagree": 0}
    E = m.rm.get_input_embeddings().weight.detach().float()
    for b in range(a.batches):
        examples = [s.assets.train[i] for i in s.sampler.indices(b)]
        ro = sample_groups(m.policy, m.tok, examples, t.num_generations, t.max_new_tokens, t.temperature, t.top_p)
        inp = build_rm_inputs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, m.tok.pad_token_id)
        rm = score(m.rm, inp, ro.response_mask, with_grad=True, batch_size=t.micro_batch_size)
        adv = group_advantages(rm.scores, t.num_generations, t.scale_rewards)
        _, ent, logits = rollout_policy_pass(m.policy, ro, t.temperature, t.micro_batch_size, True)
        _, contrib = gold_of(s.assets.task, m.tok, ro.examples, ro.response_ids, ro.response_mask)
        mask = ro.response_mask & (adv != 0)[:, None]
        aligned = torch.sign(adv)[:, None] * contrib
        groups = {"agree": mask & (aligned > 0), "neutral": mask & (aligned == 0), "disagree": mask & (aligned < 0)}
        for k, g in groups.items():
            count[k] += int(g.sum())
        for name, (scheme, params) in schemes.items():
            batch = CreditBatch(ro.response_ids, ro.response_mask, adv, rm_grad=rm.grad, rm_embedding=E,
                                policy_logits=logits, entropy=ent, generator=torch.Generator().manual_seed(b))
            out = compute_credit(scheme, batch, params)
            acc[name].append(credit_accuracy(out.scores * torch.sign(adv)[:, None], contrib, mask))
            for k, g in groups.items():
                wsum[name][k] += float(out.weights[g].sum())
    result = {
        "command": "python scripts/credit_accuracy.py " + " ".join(sys.argv[1:]),
        "setting": f"{c.data.name}-{c.policy.name}", "batches": a.batches, "responses_per_batch": t.batch_size,
        "rm_within_group_corr": (s.assets.rm_report or {}).get("heldout_within_group_corr"),
        "tokens": count,
        "schemes": {
            n: {"credit_accuracy": _mean(acc[n]),
                "mean_weight": {k: (wsum[n][k] / count[k] if count[k] else None) for k in count}}
            for n in SCHEMES
        },
    }
    out_dir = ROOT / "results" / "credit_accuracy"
    atomic_write_json(out_dir / f"{result['setting']}.json", result)
    lines = [f"# Credit accuracy on {result['setting']} (warm-started policy, {a.batches} batches of {t.batch_size})", "",
             f"Command: `{result['command']}`. Tokens by `sign(A)·gold contribution`: {count}.", "",
             "| scheme | credit accuracy | mean w, agree | mean w, neutral | mean w, disagree |", "|---|---|---|---|---|"]
    for n, r in result["schemes"].items():
        w = r["mean_weight"]
        lines.append(f"| {n} | {_fmt(r['credit_accuracy'])} | {_fmt(w['agree'])} | {_fmt(w['neutral'])} | {_fmt(w['disagree'])} |")
    atomic_write_text(out_dir / f"{result['setting']}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
