"""Each scale's results as markdown (results/bench/trl.md, trl_real.md), rendered from its
JSON file alone, with the section that puts both scales side by side once both have run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from scripts.bench.scales import CONTESTANTS, PHASES, SAME_LOSS, SCALES, TESTBED_TARGETS


def render(res: dict[str, Any], other: dict[str, Any] | None = None) -> str:
    """One scale's results as markdown; with ``other`` (the other scale's results) a section puts
    both scales' ratios side by side."""
    th = res["throughput"]
    med = th["median_over_repeats"]
    r, rc, rd = th["grpo_over_trl_samples_per_s"], th["datc_over_grpo_step_s"], th["datc_over_trl_samples_per_s"]
    mem = res.get("memory", {})
    sl = res["same_loss"]
    real = res.get("scale", "testbed") != "testbed"
    targets = res.get("targets", TESTBED_TARGETS)
    gt, dt = targets["grpo_over_trl_samples_per_s"], targets["datc_over_grpo_step_s"]
    names = {"trl": f"TRL GRPOTrainer {res['machine']['trl']}", "grpo": "datc credit=grpo", "datc": "datc credit=datc"}

    def sp(x):
        ci = "" if x.get("ci_low") is None else \
            f"; 95% interval of the median {x['ci_low']:.2f} to {x['ci_high']:.2f}, ±{100 * x['ci_rel']:.1f}%"
        return f"{x['median']:.2f} (min {x['min']:.2f}, max {x['max']:.2f}; quartiles {x['q1']:.2f} to {x['q3']:.2f}{ci})"

    lines = [
        "# This project's GRPO against TRL's GRPOTrainer" + (f": {SCALES[res['scale']].title}" if real else ""), "",
        f"Command: `{res['command']}`  ",
        f"Commit {res['commit']}, {res['date']}; torch {res['machine']['torch']}, transformers "
        f"{res['machine']['transformers']}, trl {res['machine']['trl']}; {res['threads']} torch thread(s), "
        f"{res['machine']['cpus']} CPU cores (shared with other jobs; load average "
        f"{res['load_average_1_5_15min']['start'][0]:.1f} at the start, {res['load_average_1_5_15min']['end'][0]:.1f} at the end).", "",
        f"Work per step: {res['work']}.", "",
        f"## Throughput: medians over {th['repeats']} interleaved repeats of {th['steps']} steps "
        f"(after {th['warmup']} warm-up steps, each block from the warm policy)", "",
        "| trainer | samples/s | response tokens/s | step (ms) | rollout | reward | ref + adv + credit | update | other | "
        "response len | peak RSS (MB) | RSS growth in steps (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for who in CONTESTANTS:
        m = med[who]
        mm = mem.get(who, {})
        lines.append(
            f"| {names[who]} | {m['samples_per_s']:.1f} | {m['tokens_per_s']:.0f} | {m['step_s'] * 1000:.1f} | "
            + " | ".join(f"{m[f'{p}_s'] * 1000:.1f}" for p in (*PHASES, "other"))
            + f" | {m['response_len']:.2f} | {mm.get('peak_rss_mb', math.nan):.0f} | {mm.get('step_growth_mb', math.nan):.0f} |")
    lines += [
        "", "Phase columns are medians in ms; TRL's are timed around its own methods (`_generate_single_turn`, "
        "`_calculate_rewards`, the rest of `_generate_and_score_completions`, and the remainder of the step).", "",
        f"**datc (credit=grpo) / TRL samples per second: {sp(r)}**  ",
        f"datc (credit=datc) / TRL samples per second: {sp(rd)}  ",
        f"**credit=datc / credit=grpo step time: {sp(rc)}**", "",
        *_load_lines(th),
        f"## Same loss on the same batch (first step, on-policy, tolerance {sl['tolerance']:g} relative)", "",
        "| quantity | TRL | datc | agree |", "|---|---|---|---|",
        *[f"| {k} | {sl['trl'][k]:.7g} | {sl['datc'][k]:.7g} | {'yes' if sl['agree'][k] else 'NO'} |" for k in SAME_LOSS],
        "",
    ]
    if real:
        lines += [f"Prompt ids after the chat template: {'the same' if sl['same_prompt_ids'] else 'NOT the same'} on both "
                  f"sides ({sl['prompt_tokens']:.1f} tokens per prompt). Both policies were moved off their reference by "
                  f"the same Gaussian noise (scale {sl['perturb']:g}) so that the KL term and its gradient count.", ""]
    sc = res.get("scaling")
    if sc:
        lengths = ("responses forced to the budget with `min_new_tokens` on both sides" if res.get("force_length")
                   else "natural lengths")
        lines += ["## Scaling: median step time (ms)", "",
                  "Response length (responses forced to the budget with `min_new_tokens` on both sides; "
                  f"{res['work_batch']} responses per step):", "",
                  "| max_new_tokens | datc credit=grpo | TRL | TRL / datc |", "|---|---|---|---|",
                  *[f"| {x['max_new_tokens']} | {x['grpo']['step_s'] * 1000:.1f} | {x['trl']['step_s'] * 1000:.1f} | "
                    f"{x['trl']['step_s'] / x['grpo']['step_s']:.2f} |" for x in sc["length"]],
                  "", f"Group size (8 prompts per step, {lengths}):", "",
                  "| num_generations | responses | datc credit=grpo | TRL | TRL / datc |", "|---|---|---|---|---|",
                  *[f"| {x['num_generations']} | {x['batch_size']} | {x['grpo']['step_s'] * 1000:.1f} | "
                    f"{x['trl']['step_s'] * 1000:.1f} | {x['trl']['step_s'] / x['grpo']['step_s']:.2f} |" for x in sc["group"]],
                  ""]
    if other is not None:
        tb, rl = (other, res) if real else (res, other)
        lines += side_by_side(tb, rl)
    g, d, t = med["grpo"], med["datc"], med["trl"]
    extra = {p: (d[f"{p}_s"] - g[f"{p}_s"]) * 1000 for p in (*PHASES, "other")}
    # by how much a target is missed (the testbed's lines as they were: the figure alone)
    short = f"; {gt - r['median']:.2f} short" if real and r["median"] < gt else ""
    over = f"; {rc['median'] - dt:.2f} over" if real and rc["median"] > dt else ""
    lines += [
        "## Targets", "",
        f"- credit=grpo at least {gt:g}x TRL's samples/s: **{'met' if r['median'] >= gt else 'not met'}** "
        f"({r['median']:.2f}x{short}). Per phase, TRL minus datc (ms): "
        + ", ".join(f"{p} {(t[f'{p}_s'] - g[f'{p}_s']) * 1000:+.1f}" for p in (*PHASES, "other")) + ".",
        f"- credit=datc at most {dt:.2f}x the step time of credit=grpo: **{'met' if rc['median'] <= dt else 'not met'}** "
        f"({rc['median']:.2f}x{over}). What credit=datc adds (ms): reward {extra['reward']:+.1f} (the reward model's backward "
        f"to its inputs), ref + adv + credit {extra['prep']:+.1f} (the credit scores), other {extra['other']:+.1f} "
        f"(after the update: credit diagnostics and metrics), rollout {extra['rollout']:+.1f}, update {extra['update']:+.1f}.",
        f"- Profile of this project's credit=grpo step: `{res.get('profile_file', 'trl_profile.txt')}`.", "",
    ]
    if res.get("notes"):
        lines += ["## Notes", "", *res["notes"], ""]
    return "\n".join(lines)


def _load_lines(th: dict[str, Any]) -> list[str]:
    """The load during the repeats, and the ratios over the steady ones, where the run kept them."""
    loads = th.get("load_per_repeat")
    if not loads:
        return []
    flagged = [i for i, x in enumerate(loads) if x["flagged"]]
    lines = [f"1-minute load average per repeat: {min(x['start'] for x in loads):.1f} to {max(x['end'] for x in loads):.1f}; "
             f"{len(flagged)} of {len(loads)} repeats flagged (the load moved by more than 1.0 during them)"
             + (f": {', '.join(map(str, flagged))}" if flagged else "") + "."
             + (f" Repeats were added until the intervals of both headline ratios were within ±{100 * th['until']:.0f}%, "
                f"or the cap: {th['repeats_run']} repeats, {th['measure_s']:.0f} s of blocks." if th.get("until") else "")]
    st = th.get("steady", {})
    if flagged and st.get("repeats", 0) >= 1:
        r = st["grpo_over_trl_samples_per_s"]
        ci = "" if r.get("ci_low") is None else f", interval {r['ci_low']:.2f} to {r['ci_high']:.2f}"
        lines.append(f"Over the {st['repeats']} unflagged repeats: credit=grpo / TRL {r['median']:.2f}{ci}; "
                     f"credit=datc / credit=grpo {st['datc_over_grpo_step_s']['median']:.2f}.")
    return [*lines, ""]


def _short_work(res: dict[str, Any]) -> str:
    """The work per step without the settings both scales share: prompts, responses, tokens."""
    return res["work"].split(", temperature")[0]


def _verdict(x: float, target: float, at_least: bool) -> str:
    """Whether a ratio meets its target, and by how much it misses."""
    if (x >= target) if at_least else (x <= target):
        return f"met ({x:.2f} against {target:.2f})"
    return f"**not met** ({x:.2f} against {target:.2f}: {abs(x - target):.2f} {'short' if at_least else 'over'})"


def side_by_side(tb: dict[str, Any], rl: dict[str, Any]) -> list[str]:
    """The testbed's and the real model's figures and ratios next to each other: how each
    ratio moves from the testbed's scale to the real one."""
    cols = (tb, rl)

    def med(res, who, key):
        return res["throughput"]["median_over_repeats"][who][key]

    def ratio(res, key):
        x = res["throughput"][key]
        return f"{x['median']:.2f} ({x['q1']:.2f} to {x['q3']:.2f})"

    def row(label, f):
        return f"| {label} | " + " | ".join(f(res) for res in cols) + " |"

    def params(res):
        n = res.get("policy_params")
        return f"{n / 1e6:.1f}M" if n else "n/a"

    def phase_ratio(res, ps):
        trl, ours = (sum(med(res, who, f"{p}_s") for p in ps) for who in ("trl", "grpo"))
        # under 0.1% of TRL's: the work moved to another phase (the shared trunk's reference pass)
        return "n/a (moved)" if ours < 1e-3 * trl else f"{trl / ours:.2f}"

    def share(res, p):
        return f"{100 * med(res, 'grpo', f'{p}_s') / med(res, 'grpo', 'step_s'):.0f}%"

    def added(res, p):
        return f"{100 * (med(res, 'datc', f'{p}_s') - med(res, 'grpo', f'{p}_s')) / med(res, 'grpo', 'step_s'):+.1f}%"

    def targets(res):
        return res.get("targets", TESTBED_TARGETS)

    labels = {"rollout": "rollout", "reward": "reward", "prep": "ref + adv + credit", "update": "update", "other": "other"}
    lines = [
        "## Scaling: the testbed to a real model", "",
        f"Each column from its own run (testbed: `{SCALES['testbed'].stem}.json`, commit {tb['commit']}, {tb['date']}; real "
        f"model: `{SCALES['real'].stem}.json`, commit {rl['commit']}, {rl['date']}). Times are medians over repeats, "
        "ratios the median over repeats (quartiles); shares and additions are percentages of the credit=grpo step.", "",
        f"| | {SCALES['testbed'].title} | {SCALES['real'].title} |", "|---|---|---|",
        row("policy parameters", params),
        row("work per step", _short_work),
        row("response tokens per step", lambda res: f"{med(res, 'grpo', 'response_len') * res['throughput']['batch_size']:.0f}"),
        row("step, datc credit=grpo (ms)", lambda res: f"{med(res, 'grpo', 'step_s') * 1000:.1f}"),
        row("step, TRL (ms)", lambda res: f"{med(res, 'trl', 'step_s') * 1000:.1f}"),
        row("step, datc credit=datc (ms)", lambda res: f"{med(res, 'datc', 'step_s') * 1000:.1f}"),
        row("**datc (credit=grpo) / TRL samples/s**", lambda res: ratio(res, "grpo_over_trl_samples_per_s")),
        *[row(f"TRL / datc time: {labels[p]}", lambda res, p=p: phase_ratio(res, (p,))) for p in PHASES],
        row("TRL / datc time: reward + ref + adv + credit", lambda res: phase_ratio(res, ("reward", "prep"))),
        *[row(f"credit=grpo step share: {labels[p]}", lambda res, p=p: share(res, p)) for p in (*PHASES, "other")],
        row("**credit=datc / credit=grpo step time**", lambda res: ratio(res, "datc_over_grpo_step_s")),
        *[row(f"credit=datc adds: {labels[p]}", lambda res, p=p: added(res, p)) for p in ("reward", "prep", "other")],
        row("target: credit=grpo / TRL samples/s", lambda res: _verdict(
            res["throughput"]["grpo_over_trl_samples_per_s"]["median"], targets(res)["grpo_over_trl_samples_per_s"], True)),
        row("target: credit=datc / credit=grpo step", lambda res: _verdict(
            res["throughput"]["datc_over_grpo_step_s"]["median"], targets(res)["datc_over_grpo_step_s"], False)),
        "",
    ]
    return lines


def load_results(out: Path, scale: str) -> dict[str, Any] | None:
    """A scale's results file in ``out``, or None where it has not been run."""
    path = out / f"{SCALES[scale].stem}.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_markdown(out: Path) -> list[Path]:
    """Render each scale's markdown from its results file in ``out``, with the side-by-side
    section where both scales have results. Returns the files written."""
    from datc.atomic import atomic_write_text

    res = {k: load_results(out, k) for k in SCALES}
    written = []
    for k, other in (("testbed", "real"), ("real", "testbed")):
        if res[k] is not None:
            path = out / f"{SCALES[k].stem}.md"
            atomic_write_text(path, render(res[k], res[other]))
            written.append(path)
    return written


def write_result(out: Path, stem: str, res: dict[str, Any], markdown: str) -> Path:
    """``res`` as ``out/<stem>.json`` and ``markdown`` as ``out/<stem>.md`` (each written whole, or
    not at all); the markdown's path."""
    from datc.atomic import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{stem}.json", res)
    atomic_write_text(out / f"{stem}.md", markdown)
    return out / f"{stem}.md"
