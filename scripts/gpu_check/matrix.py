"""The GPU check's matrix: which cases run, in which order, their estimated time on one H200,
and each case's one-line verdict (printed as it ends, so a cut run still says something).

**The default matrix** (a GPU, no ``--full``) fits one lent device's 10 minutes with its start
excluded (on one GPU: estimated 540 s; the two-rank case, on two GPUs, adds about 70 s, and the
deadline then cuts ZeRO-3, the last case): what was built since the first run (LoRA, the
asynchronous rollout, the deterministic mode, FSDP2 against ZeRO-2/3), with its comparators.
Its estimates come from that run's case times (``results/gpu/*.log``: a training case 31-43 s
at 2 steps, ZeRO-3 126 s, a build 21-27 s); the cases built since have none, and are guessed from
their nearest measured case (said in :data:`ESTIMATE_S`). ``--full`` (and ``--tiny``, the CPU
rehearsal) runs every case: each family x credit x stage, as before, and the new cases.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CREDITS = ("grpo", "datc")
STAGES = ("none", "zero2", "zero3", "fsdp2")  # fsdp2: backend=fsdp2 on one rank (DeepSpeed off)
DEFAULT_BUDGET_S = 540.0  # the default matrix's deadline: 10 minutes less the kit's install and the report's writing

# Estimated seconds on one H200 (the case's own process included), by kind and variant.
ESTIMATE_S: dict[str, float] = {
    "build/qwen3": 30, "build/llama32": 25,  # measured 27 s and about 21 s
    "credit": 5,  # measured 2 s and 1 s
    "decode": 60,  # not measured: 4 loops x 3 rounds of 128 steps, and a model load
    "train": 45,  # measured 31-43 s (no DeepSpeed, ZeRO-2)
    "train/zero3": 130,  # measured 126 s (per-module gathers on one rank: 7x slower sampling)
    "train/lora": 45,  # guessed as a full-policy case (fewer optimizer states, the same sampling)
    "train/async": 55,  # guessed: a full-policy case and the engine's own copy of the weights
    "train/auto": 50,
    "determinism": 70,  # guessed: two sessions of 2 steps, no evaluation, the dynamic decode
    "ranks": 70,  # guessed: a launch of two processes, each loading the models
    "synced": 60, "fused_adam": 30, "fail": 5,
}


@dataclass
class Case:
    """One check: ``kind`` is a key of :func:`scripts.gpu_check.cases._kinds`, ``spec`` its (picklable) arguments."""

    name: str  # e.g. train/qwen3/datc/zero3
    kind: str
    spec: dict[str, Any]
    timeout_s: float  # the case's own limit (the global deadline may cut it shorter)
    result: dict[str, Any] = field(default_factory=dict)  # status ok | error | timeout | skipped, and the case's numbers
    est_s: float = 0.0  # estimated seconds on one H200


def estimate(case: Case) -> float:
    """:data:`ESTIMATE_S` for the case."""
    if case.kind == "build":
        return ESTIMATE_S.get(case.name, 30)
    if case.kind == "train":
        variant = case.spec.get("variant") or ("auto" if case.spec.get("micro") == "auto" else None)
        if variant in ("lora", "async", "auto"):
            return ESTIMATE_S[f"train/{variant}"]
        return ESTIMATE_S["train/zero3"] if case.spec["stage"] == "zero3" else ESTIMATE_S["train"]
    return ESTIMATE_S.get(case.kind, 45)


def _train(fam: str, credit: str, stage: str, scale, variant: str | None = None, **extra) -> Case:
    name = f"train/{fam}/{credit}/{stage}" + (f"/{variant}" if variant else "")
    spec = {"family": fam, "credit": credit, "stage": stage, "steps": scale.steps, "threads": scale.threads, **extra}
    if variant:
        spec["variant"] = variant
        if variant == "lora":
            spec["preset"] = "_lora"
    return Case(name, "train", spec, scale.case_timeout_s)


def _new_cases(fam: str, first: bool, a: argparse.Namespace, scale, gpus: int) -> list[Case]:
    """What was built since the first run, for family ``fam``: its preset's LoRA variant; on the
    first family the asynchronous rollout, the determinism case and FSDP2 on two ranks (two GPUs,
    or two gloo processes on CPU; on one GPU a skipped case says why)."""
    out = [_train(fam, credit, "none", scale, "lora") for credit in CREDITS if credit in a.credits]
    if not first:
        return out
    if "grpo" in a.credits:
        out.append(_train(fam, "grpo", "none", scale, "async"))
    out.append(Case(f"determinism/{fam}", "determinism", {"family": fam, "credit": "grpo", "stage": "none", "steps": scale.steps,
                                                         "threads": scale.threads}, 2 * scale.case_timeout_s))
    if "fsdp2" in a.stages:
        out.append(Case(f"train/{fam}/grpo/fsdp2/2ranks", "ranks",
                        {"family": fam, "credit": "grpo", "stage": "fsdp2", "steps": scale.steps, "threads": scale.threads,
                         "nproc": 2, "gpus": gpus}, 1.5 * scale.case_timeout_s))
    return out


def full_matrix(a: argparse.Namespace, scale, work: Path, gpus: int) -> list[Case]:
    """Every case, family by family (Qwen3, the larger, first): its models, its credit timing,
    its decode loops, its training cases stage by stage (grpo and datc side by side), the cases
    built since the first run, then the first family's synced_gpus sampling, and last the
    FusedAdam build."""
    from scripts.gpu_check.check import arch_overrides

    cases: list[Case] = []
    for i, fam in enumerate(a.families):
        cases.append(Case(f"build/{fam}", "build", {"family": fam, "dir": str(work / fam), "arch_overrides": arch_overrides(scale),
                                                   "prompt_words": scale.prompt_words, "threads": scale.threads}, 300.0))
        cases.append(Case(f"credit/{fam}", "credit", {"family": fam, "repeats": 5, "tokens": 512,
                                                     "arch_overrides": arch_overrides(scale)}, 90.0))
        cases.append(Case(f"decode/{fam}", "decode", {"family": fam, "stage": "none", "rows": scale.decode_rows,
                                                     "max_new_tokens": scale.max_new_tokens, "repeats": scale.decode_repeats,
                                                     "check_tokens": scale.decode_check_tokens,
                                                     "copy_bytes": scale.copy_bytes, "threads": scale.threads}, 150.0))
        for stage in (s for s in STAGES if s in a.stages):
            for credit in (c for c in CREDITS if c in a.credits):
                cases.append(_train(fam, credit, stage, scale))
        if i == 0 and "none" in a.stages and "datc" in a.credits:
            # trainer.micro_batch_size: auto over one mini-batch of the whole batch (datc.memory.micro_batch)
            cases.append(Case(f"train/{fam}/datc/none/auto", "train",
                              {"family": fam, "credit": "datc", "stage": "none", "steps": scale.steps,
                               "threads": scale.threads, "micro": "auto", "mini": scale.prompts * 8}, scale.case_timeout_s))
        for engine in (e for e in a.engines if e != "torch"):  # another rollout engine: the preset's step with it
            if i == 0 and "none" in a.stages:
                for credit in (c for c in CREDITS if c in a.credits):
                    cases.append(Case(f"train/{fam}/{credit}/none/{engine}", "train",
                                      {"family": fam, "credit": credit, "stage": "none", "steps": scale.steps,
                                       "threads": scale.threads, "engine": engine}, scale.case_timeout_s))
        if "none" in a.stages:
            cases += _new_cases(fam, i == 0, a, scale, gpus)
        if i == 0 and "zero3" in a.stages:
            for gather in (False, True):  # ZeRO-3 sampling: per-module synced gathers, then gathered once
                cases.append(Case(f"synced/{fam}" + ("/gathered" if gather else ""), "synced",
                                  {"family": fam, "prompts": scale.prompts, "threads": scale.threads, "gather": gather}, 120.0))
    if not a.tiny:
        cases.append(Case("fused_adam", "fused_adam", {}, 90.0))
    return cases


# The default matrix on a GPU, most important first: (case name with {0} the first family and
# {1} the second). What was built since the first run, its comparators, then the earlier targets.
DEFAULT_ORDER = (
    "build/{0}", "train/{0}/grpo/none", "train/{0}/grpo/none/lora", "train/{0}/grpo/none/async", "determinism/{0}",
    "train/{0}/grpo/fsdp2", "train/{0}/grpo/zero2", "train/{0}/grpo/fsdp2/2ranks", "build/{1}", "train/{1}/grpo/none/lora",
    "credit/{0}", "train/{0}/grpo/zero3",
)  # --full adds the decode loops, FusedAdam's build, micro-batch auto, synced sampling and every credit x stage


def build_cases(a: argparse.Namespace, scale, work: Path, gpus: int) -> list[Case]:
    """The cases of this run: every case (``--tiny``, ``--full``), or the default matrix
    (:data:`DEFAULT_ORDER`, the cases ``--families``/``--stages``/``--credits`` leave in); each
    with its estimate. ``--inject-failures`` adds a failing and a hanging case early."""
    cases = full_matrix(a, scale, work, gpus)
    if not (a.tiny or a.full):
        fams = [*a.families, "", ""]
        by_name = {c.name: c for c in cases}
        cases = [by_name[n] for n in (o.format(*fams) for o in DEFAULT_ORDER) if n in by_name]
    for c in cases:
        c.est_s = estimate(c)
    if a.inject_failures:  # early, so the rehearsal shows that the cases after them still run
        cases[1:1] = [Case("fail/error", "fail", {"how": "error"}, 60.0, est_s=5), Case("fail/hang", "fail", {"how": "hang"}, 3.0, est_s=5)]
    return cases


# ---------------------------------------------------------------------------------------------
# Verdicts: one line per case, printed as it ends
# ---------------------------------------------------------------------------------------------


def _gib(x: Any) -> str:
    return f"{x:.2f} GiB" if isinstance(x, (int, float)) else "-"


def _pct(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.0f}%"


def verdict(name: str, r: dict[str, Any], cases: dict[str, dict[str, Any]]) -> str:
    """One line on what case ``name`` showed (``cases``: every result so far, for comparisons)."""
    if r.get("status") != "ok":
        return f"{r.get('status')}: {r.get('error', '')}"
    parts = name.split("/")
    if parts[0] == "train" and "summary" in r:
        s = r["summary"]
        line = f"step {s['step_s']:.2f} s (rollout {s['rollout_s']:.2f}, update {s['update_s']:.2f}), peak {_gib(s['peak_mem_gib'])}"
        plan = r.get("plan", {}).get("gib")
        if plan and r.get("device", "cpu") != "cpu" and s["peak_mem_gib"] > 0:  # on CPU the peak is the process's memory
            line += f", plan {_gib(plan)} ({_pct(plan, s['peak_mem_gib'])} of the peak)"
        base = cases.get("/".join(parts[:3]) + "/none", {})
        if len(parts) > 4 and parts[4] == "lora" and "summary" in base:
            b = base["summary"]
            line += f"; the full policy: step {b['step_s']:.2f} s, peak {_gib(b['peak_mem_gib'])}"
        if len(parts) > 4 and parts[4] == "async":
            line += "; " + async_verdict(r, base)
        if parts[3] in ("fsdp2", "zero2", "zero3") or (len(parts) > 4 and parts[4] == "2ranks"):
            others = [f"{st} {cases[k]['summary']['step_s']:.2f} s / {_gib(cases[k]['summary']['peak_mem_gib'])}"
                      for st in ("none", "zero2", "zero3", "fsdp2") if (k := "/".join([*parts[:3], st])) != name
                      and "summary" in cases.get(k, {})]
            if others:
                line += "; beside " + ", ".join(others)
        return line
    if parts[0] == "determinism":
        eq = "EQUAL bit for bit" if r["metrics_equal"] and r["params_equal"] else (
            f"NOT equal: metrics {', '.join(r['unequal_metrics']) or 'equal'}; parameters {r['params_diff']['unequal_tensors']} "
            f"of {r['params_diff']['tensors']} tensors differ (max {r['params_diff']['max_abs_diff']:.2e})")
        base = cases.get(f"train/{parts[1]}/grpo/none", {}).get("summary")
        cost = (f"; step {r['step_s']:.2f} s against {base['step_s']:.2f} s by default ({_pct(r['step_s'], base['step_s'])})"
                if base else f"; step {r['step_s']:.2f} s")
        return f"two identical runs of {r['steps']} steps: {eq}{cost}"
    if parts[0] == "build":
        return f"policy {r['params']['policy'] / 1e9:.2f} B, reward {r['params']['reward'] / 1e9:.2f} B parameters, prompts of {r['prompt_tokens']} tokens"
    if parts[0] == "credit":
        return f"exact credit {r['over_lm_head_bf16']['datc_exact']:.1f}x a bf16 LM-head matmul (bf16 credit {r['over_lm_head_bf16']['datc_exact_bfloat16']:.1f}x)"
    if parts[0] == "decode":
        best = max((m for k, m in r["modes"].items() if k != "prefill"), key=lambda m: m["tokens_per_s"])
        return f"best loop {best['tokens_per_s']:.0f} tokens/s, {best['hbm_fraction']:.1%} of the HBM bound"
    keep = {k: v for k, v in r.items() if k not in ("status", "traceback", "error", "wall_s")}
    return ", ".join(f"{k} {v}" for k, v in list(keep.items())[:4])[:200]


def async_verdict(r: dict[str, Any], base: dict[str, Any]) -> str:
    """Whether the asynchronous rollout's sampling overlapped the update: the steps' total time
    against the synchronous case's (the cost of sampling ahead moves into the first step, so
    totals, not the reported step, compare); ``hidden``: the share of the synchronous rollout
    time the overlap saved."""
    s = r["summary"]
    stream = r.get("async", {})
    where = ("the engine's thread shares the trainer's CUDA stream" if stream.get("own_stream") is False else
             "the engine's thread has its own stream" if stream.get("own_stream") else "no CUDA stream (CPU)")
    if "summary" not in base:
        return f"no synchronous case to compare; {where}"
    b = base["summary"]
    saved = b["total_s"] - s["total_s"]
    hidden = saved / b["rollout_total_s"] if b["rollout_total_s"] > 0 else 0.0
    r["overlap"] = {"saved_s": saved, "hidden_of_rollout": hidden, "overlaps": hidden >= 0.2, "where": where}
    says = "overlaps" if hidden >= 0.2 else "does not overlap"
    return (f"{says}: {s['total_s']:.2f} s for the steps against {b['total_s']:.2f} s synchronous "
            f"({hidden:.0%} of the synchronous rollout hidden); {where}")


def render_since(report: dict[str, Any]) -> list[str]:
    """The report's section on what was built since the first run: the LoRA variants, the
    asynchronous rollout, the deterministic mode, and FSDP2 against ZeRO-2/3 side by side."""
    cases = report["cases"]
    lines = ["", "## Built since the first run", "",
             "Each case's verdict as it was printed when the case ended.", "",
             "| case | status | verdict |", "|---|---|---|"]
    for name, r in cases.items():
        p = name.split("/")
        if p[0] == "determinism" or (p[0] == "train" and len(p) > 4 and p[4] in ("lora", "async", "2ranks")):
            lines.append(f"| {name} | {r['status']} | {r.get('verdict', r.get('error', ''))} |")
    lines += ["", "### FSDP2 against ZeRO-2/3", "",
              "The same preset, credit and batch on one GPU (two ranks: two GPUs): the reported step's time, the run's "
              "peak memory (`torch.cuda.max_memory_allocated`, rank 0) and the memory plan's estimate.", "",
              "| family / credit | stage | status | step s | rollout s | update s | peak GiB | plan GiB |",
              "|---|---|---|---|---|---|---|---|"]
    for fam in report.get("prompt_tokens", {}):
        for credit in CREDITS:
            for stage in ("none", "zero2", "zero3", "fsdp2", "fsdp2/2ranks"):
                r = cases.get(f"train/{fam}/{credit}/{stage}")
                if r is None:
                    continue
                s = r.get("summary", {})
                num = [f"{s[k]:.2f}" if k in s else "-" for k in ("step_s", "rollout_s", "update_s", "peak_mem_gib")]
                plan = r.get("plan", {}).get("gib")
                lines.append(f"| {fam} / {credit} | {stage} | {r['status']} | {' | '.join(num)} | "
                             f"{f'{plan:.2f}' if isinstance(plan, (int, float)) else '-'} |")
    return lines
