"""Where the end-of-text token's weight goes (METHOD §6, the length collapse): per setting and
scheme, on the same warm-started rollouts (``datc-credit-accuracy``'s inputs), the end token's mean
weight in responses with ``A > 0`` and with ``A < 0``, the mean coefficient ``A_i · w_end,i`` that
multiplies ``∇ log π(end)`` in the policy gradient (GRPO's ``w = 1`` gives the mean of ``A_i`` over
responses that ended: about 0, as the group's advantages are centred), how often the end token is the
response's largest weight, and the reward model's gradient norm ``‖g_t‖`` by position from the
response's end.

    python -m scripts.results.end_token_weights --out results/credit_breakdown/end_token.md [--batches 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

SETTINGS = [("tiny_gpt2", "keywords"), ("tiny_llama", "keywords"), ("tiny_gpt2", "arithmetic"), ("tiny_llama", "arithmetic")]
SCHEMES = ["grpo", "datc", "datc_identity", "datc_end_neutral", "p2t", "oracle"]
FROM_END = 4  # positions from the end whose gradient norm is reported


def measure(policy: str, data: str, batches: int) -> dict:
    from datc.analysis.inputs import credit_inputs, session_for
    from datc.analysis.schemes import scheme_outputs

    s = session_for(["credit=datc", "experiment=four_settings", f"policy={policy}", f"data={data}"])
    acc = {n: {"pos": [], "neg": [], "coef": [], "top": []} for n in SCHEMES}
    gnorm = [[] for _ in range(FROM_END)]
    for b in range(batches):
        inputs = credit_inputs(s, [s.assets.train[i] for i in s.sampler.indices(b)], generator_seed=b)
        r, adv = inputs.rollout, inputs.advantages
        mask = r.response_mask
        end = inputs.batch.response_end
        ended = end.any(-1) & (adv != 0)
        outs = scheme_outputs(inputs, SCHEMES)
        for n in SCHEMES:
            w = outs[n].weights
            w_end = (w * end).sum(-1)
            acc[n]["pos"].append(w_end[ended & (adv > 0)])
            acc[n]["neg"].append(w_end[ended & (adv < 0)])
            acc[n]["coef"].append((adv * w_end)[ended])
            acc[n]["top"].append((w_end >= torch.where(mask, w, -1.0).amax(-1))[ended & (mask.sum(-1) > 1)].float())
        norms = inputs.batch.rm_grad.float().norm(dim=-1)  # (B, T)
        last = mask.sum(-1) - 1
        for k in range(FROM_END):
            pos = last - k
            ok = ended & (pos >= 0)
            gnorm[k].append(norms[ok.nonzero()[:, 0], pos[ok]])
    out = {"schemes": {}, "rm_grad_norm_from_end": [float(torch.cat(g).mean()) for g in gnorm]}
    for n, a in acc.items():
        cat = {k: torch.cat(v) for k, v in a.items()}
        out["schemes"][n] = {"w_end_A_pos": float(cat["pos"].mean()), "w_end_A_neg": float(cat["neg"].mean()),
                             "coef": float(cat["coef"].mean()), "end_is_top": float(cat["top"].mean()),
                             "responses": int(cat["coef"].numel())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.results.end_token_weights", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=int, default=8)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.run.provenance import provenance
    from datc.utils import quiet_libraries

    quiet_libraries()
    res = {f"{d}-{p}": measure(p, d, a.batches) for p, d in SETTINGS}
    prov = provenance(" ".join(["python -m scripts.results.end_token_weights", *(sys.argv[1:] if argv is None else argv)]))
    atomic_write_json(a.out.with_suffix(".json"), {**prov, "settings": res})
    lines = ["# The end-of-text token's weight, by the advantage's sign", "",
             f"Command: `{prov['command']}` at `{prov['commit']}`; warm-started policies, asset draw 0, "
             f"{a.batches} batches of 64 responses per setting, responses that ended within their budget and have A ≠ 0.", "",
             "`coef`: mean of `A_i · w_end,i`, the coefficient of `∇ log π(end | ·)` per response in the policy gradient "
             "(GRPO: the mean advantage of the responses that ended). `top`: fraction of responses whose end token has "
             "the largest weight.", "",
             "| setting | scheme | w_end, A > 0 | w_end, A < 0 | coef | top | responses |", "|---|---|---|---|---|---|---|"]
    for setting, r in res.items():
        for n, x in r["schemes"].items():
            lines.append(f"| {setting} | {n} | {x['w_end_A_pos']:.3f} | {x['w_end_A_neg']:.3f} | {x['coef']:+.3f} | "
                         f"{x['end_is_top']:.3f} | {x['responses']} |")
    lines += ["", "The reward model's input gradient norm `‖g_t‖` by position from the end (end token first):", "",
              "| setting | " + " | ".join(["end", *[f"end − {k}" for k in range(1, FROM_END)]]) + " |",
              "|---|" + "---|" * FROM_END]
    for setting, r in res.items():
        lines.append(f"| {setting} | " + " | ".join(f"{g:.4f}" for g in r["rm_grad_norm_from_end"]) + " |")
    atomic_write_text(a.out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
