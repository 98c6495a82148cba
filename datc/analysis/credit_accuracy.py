"""Credit accuracy of every scheme that ranks tokens on the same rollouts, written to
runs/credit_accuracy/<data>-<policy>.{json,md} (or to ``--out``; the committed tables:
``--out results/credit_accuracy``).

Rollouts come from the warm-started policy (early training, where credit matters most), or
from the model the overrides name (``policy.path``; there is no ``--run``: ``datc-heatmaps --run``
reads a run directory); every scheme scores the *same* batches. Reported per scheme: credit accuracy
(mean per-response Spearman between ``sign(A)·s`` and the gold per-token contribution, with a
95% t-interval over responses, and its paired difference to ``datc``'s on the same responses) and
the mean weight of tokens whose gold contribution agrees with the advantage's sign
(``sign(A)·c > 0``: the tokens that earned the response its advantage), is zero, or disagrees.

A second reference, what the reward model itself attributes: each scheme's accuracy against
the reward model's counterfactual contributions ``c_t = R(y) - E_{v~π_t} R(y with y_t := v)``
on the same responses (:func:`datc.credit.schemes.rm_counterfactual.counterfactual_contributions`,
``--cf-k`` draws per token from a generator of its own, so the ``rm_counterfactual`` scheme's own
draws are independent of the reference's; ``--cf-k 0`` leaves it out), and the reference's own
accuracy against gold (what the reward model knows about which tokens matter).

Both counterfactuals cost K reward-model forwards per valid token (the reference ``--cf-k``, the
``rm_counterfactual`` scheme its config's ``k``): on a real model that is more than a CPU can
afford for every response. ``--cf-rows N`` restricts them to the first N responses with
``A != 0`` of each batch: the reference and the schemes that edit responses (those needing
``rm_edit_scores``) are computed, and judged, on those responses alone (NaN elsewhere, so their
intervals and paired differences are over that subset; ``responses`` says how many); every other
scheme is judged against gold on every response as before.

    datc-credit-accuracy [--batches 8] [--out runs/credit_accuracy] [--schemes a,b,...]
                         [--cf-k 16] [--cf-rows N] [hydra overrides ...]

(or ``python -m datc.analysis.credit_accuracy``). The default schemes are every credit config
and registered scheme but the uniform ones (``grpo``: no token ranked), found by
:func:`datc.analysis.schemes.analysed_schemes`. A scheme that returns weights rather than
scores is judged by ``sign(A)·w``, as the training diagnostics do.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

COMMAND = "datc-credit-accuracy"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("runs") / "credit_accuracy",
                    help="output directory (default: runs/credit_accuracy)")
    ap.add_argument("--schemes", default=None,
                    help="comma-separated credit configs or registered schemes (default: all but the uniform ones)")
    ap.add_argument("--cf-k", type=int, default=16,
                    help="draws per token of the reward model's counterfactual reference (0: no such reference)")
    ap.add_argument("--cf-rows", type=int, default=None,
                    help="per batch, the counterfactual reference and the schemes that edit responses "
                         "(rm_counterfactual) only on the first N responses with A != 0 (default: all)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also by quintile of pi_old(y_t) and by token class (datc.analysis.breakdown), with a plot")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(args)
    from datc.analysis.schemes import analysed_schemes

    schemes = analysed_schemes(uniform=False) if a.schemes is None else [n for n in a.schemes.split(",") if n]
    unknown = sorted(set(schemes) - set(analysed_schemes()))
    if unknown:
        ap.error(f"--schemes: {', '.join(unknown)} not a credit config or registered scheme; "
                 f"choose from {', '.join(analysed_schemes())}")
    if a.cf_rows is not None and a.cf_rows < 1:
        ap.error(f"--cf-rows must be >= 1, got {a.cf_rows}")
    torch.set_num_threads(1)
    import dataclasses

    from datc.analysis.breakdown import Tokens, breakdown, breakdown_markdown
    from datc.analysis.inputs import credit_inputs, session_for
    from datc.analysis.schemes import scheme_of, scheme_outputs
    from datc.atomic import atomic_write_json, atomic_write_text
    from datc.credit.base import RM_EDIT_SCORES
    from datc.credit.diagnostics import credit_accuracy_rows
    from datc.credit.schemes.rm_counterfactual import counterfactual_contributions
    from datc.run.provenance import provenance
    from datc.utils import quiet_libraries

    quiet_libraries()
    s = session_for(["credit=datc", *a.overrides])
    if s.assets.task is None:
        raise SystemExit("credit accuracy needs a testbed task (data.task): it compares the "
                         "schemes' scores with the task's gold contributions")
    c, t = s.c, s.c.trainer
    acc: dict[str, list[torch.Tensor]] = {n: [] for n in schemes}  # per response, NaN where undefined
    acc_cf: dict[str, list[torch.Tensor]] = {n: [] for n in [*schemes, "reference_vs_gold"]}  # against the RM's own c_t
    wsum = {n: {"agree": 0.0, "neutral": 0.0, "disagree": 0.0} for n in schemes}
    count = {"agree": 0, "neutral": 0, "disagree": 0}
    wcount = {n: dict(count) for n in schemes}  # the tokens each scheme's mean weights are over
    editing = {n for n in schemes if RM_EDIT_SCORES in scheme_of(n)[0].needs}  # restricted by --cf-rows
    tokens = Tokens() if a.breakdown else None
    for b in range(a.batches):
        examples = [s.assets.train[i] for i in s.sampler.indices(b)]
        inputs = credit_inputs(s, examples, generator_seed=b)
        adv, contrib = inputs.advantages, inputs.gold_contrib
        mask = inputs.rollout.response_mask & (adv != 0)[:, None]
        aligned = torch.sign(adv)[:, None] * contrib
        groups = {"agree": mask & (aligned > 0), "neutral": mask & (aligned == 0),
                  "disagree": mask & (aligned < 0)}
        for k, g in groups.items():
            count[k] += int(g.sum())
        sub = adv != 0  # the responses the counterfactuals are computed on
        if a.cf_rows is not None:
            sub = sub & (sub.cumsum(0) <= a.cf_rows)
        cf_mask = mask & sub[:, None]
        cf = None
        if a.cf_k > 0:  # the reward model's own counterfactual contributions, on the responses with A != 0
            ib = inputs.batch
            cf = counterfactual_contributions(ib.rm_scores, ib.policy_logits, cf_mask, ib.rm_edit_scores, a.cf_k,
                                              torch.Generator().manual_seed(1_000_003 + b), rows_per_forward=64)
            # a contribution, like gold's (not a score to sign): Spearman between the two references
            acc_cf["reference_vs_gold"].append(credit_accuracy_rows(cf, contrib, cf_mask))
        outs = scheme_outputs(inputs, [n for n in schemes if n not in editing])
        if editing:  # A set to 0 outside the subset: the editing schemes spend no forwards there
            only = dataclasses.replace(inputs, batch=dataclasses.replace(inputs.batch, advantages=adv * sub))
            outs.update(scheme_outputs(only, [n for n in schemes if n in editing]))
        if tokens is not None:
            from datc.math.logprobs import selective_log_softmax

            prob = selective_log_softmax(inputs.batch.policy_logits.float(), inputs.batch.response_ids).exp()  # pi_old(y_t)
            rec = tokens.add_batch(prob, contrib, adv, cf_mask if editing else mask, inputs.batch.response_end)
        for name in schemes:
            out, m = outs[name], (cf_mask if name in editing else mask)
            judged = out.scores if out.scores is not None else out.weights
            if tokens is not None:
                tokens.add_scheme(name, judged, out.weights, adv, rec)
            acc[name].append(credit_accuracy_rows(judged * torch.sign(adv)[:, None], contrib, m))
            if cf is not None:
                acc_cf[name].append(credit_accuracy_rows(judged * torch.sign(adv)[:, None], cf, cf_mask))
            for k, g in groups.items():
                wsum[name][k] += float(out.weights[g & m].sum())
                wcount[name][k] += int((g & m).sum())
    rows = {n: torch.cat(v) for n, v in acc.items()}
    rows_cf = {n: torch.cat(v) for n, v in acc_cf.items() if v}
    result = {
        **provenance(" ".join([COMMAND, *args])),
        "setting": f"{c.data.name}-{c.policy.name}", "batches": a.batches,
        "responses_per_batch": t.batch_size,
        "rm_within_group_corr": (s.assets.rm_report or {}).get("heldout_within_group_corr"),
        "tokens": count,
        "schemes": {
            n: {"credit_accuracy": _mean(rows[n]), "interval95": _interval(rows[n]),
                "responses": int((~rows[n].isnan()).sum()),
                "minus_datc": (_interval(rows[n] - rows["datc"], centre=True) if "datc" in rows and n != "datc" else None),
                "mean_weight": {k: (wsum[n][k] / wcount[n][k] if wcount[n][k] else None) for k in count}}
            for n in schemes
        },
        "cf_rows": a.cf_rows,
        "rm_counterfactual_reference": None if not rows_cf else {
            "k": a.cf_k,
            "responses": int((~rows_cf["reference_vs_gold"].isnan()).sum()),
            "vs_gold": {"credit_accuracy": _mean(rows_cf["reference_vs_gold"]),
                        "interval95": _interval(rows_cf["reference_vs_gold"])},
            "schemes": {n: {"credit_accuracy": _mean(rows_cf[n]), "interval95": _interval(rows_cf[n]),
                            "responses": int((~rows_cf[n].isnan()).sum()),
                            "minus_datc": (_interval(rows_cf[n] - rows_cf["datc"], centre=True)
                                           if "datc" in rows_cf and n != "datc" else None)}
                        for n in schemes},
        },
    }
    if tokens is not None:
        result["breakdown"] = breakdown(tokens)
        if editing:
            result["breakdown"]["note"] = "on the --cf-rows responses only, for every scheme"
    atomic_write_json(a.out / f"{result['setting']}.json", result)
    lines = [f"# Credit accuracy on {result['setting']} (warm-started policy, {a.batches} batches "
             f"of {t.batch_size})", "",
             f"Command: `{result['command']}`. Tokens by `sign(A)·gold contribution`: {count}.", "",
             "Credit accuracy: mean over responses (where defined) ± half its 95% t-interval; "
             "minus datc: the paired difference on the responses where both are defined.", "",
             "| scheme | credit accuracy | minus datc | mean w, agree | mean w, neutral | mean w, disagree |",
             "|---|---|---|---|---|---|"]
    if a.cf_rows is not None:  # say what the restriction left
        lines[-2:-2] = [f"`--cf-rows {a.cf_rows}`: the counterfactual reference and "
                        + ", ".join(f"`{n}` ({result['schemes'][n]['responses']} responses)" for n in sorted(editing))
                        + f" on the first {a.cf_rows} response(s) with A ≠ 0 of each batch only; every other scheme on "
                        "all of them.", ""]
    for n, r in result["schemes"].items():
        w = r["mean_weight"]
        lines.append(f"| {n} | {_pm(r['credit_accuracy'], r['interval95'])} | {_pm(*(r['minus_datc'] or (None, None)))} | "
                     f"{_fmt(w['agree'])} | "
                     f"{_fmt(w['neutral'])} | {_fmt(w['disagree'])} |")
    ref = result["rm_counterfactual_reference"]
    if ref is not None:
        vg = ref["vs_gold"]
        lines += ["", f"## Against the reward model's counterfactual contributions (K = {ref['k']} draws per token)", "",
                  "`c_t = R(y) - E_v R(y with y_t := v)`, `v` drawn from the rollout policy; the reference itself "
                  f"scores {_pm(vg['credit_accuracy'], vg['interval95'])} against gold "
                  f"({ref['responses']} responses).", "",
                  "| scheme | credit accuracy vs RM counterfactual | minus datc |", "|---|---|---|"]
        for n, r in ref["schemes"].items():
            lines.append(f"| {n} | {_pm(r['credit_accuracy'], r['interval95'])} | {_pm(*(r['minus_datc'] or (None, None)))} |")
    if tokens is not None:
        lines += ["", *breakdown_markdown(result["breakdown"])]
        from datc.analysis.breakdown import plot_breakdown

        plot_breakdown(result["breakdown"], a.out / f"{result['setting']}-breakdown.png", result["setting"])
    atomic_write_text(a.out / f"{result['setting']}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def _mean(x: torch.Tensor) -> float | None:
    x = x[~x.isnan()]
    return float(x.mean()) if len(x) else None


def _interval(x: torch.Tensor, centre: bool = False):
    """Half the width of the 95% t-interval of the mean of ``x``'s defined entries (None below 2);
    with ``centre``, (mean, half width)."""
    from scipy.stats import t as student_t

    x = x[~x.isnan()]
    half = float(student_t.ppf(0.975, len(x) - 1) * x.std() / math.sqrt(len(x))) if len(x) >= 2 else None
    return (_mean(x), half) if centre else half


def _pm(mean: float | None, half: float | None) -> str:
    return "n/a" if mean is None else _fmt(mean) if half is None else f"{mean:.3f} ± {half:.3f}"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
