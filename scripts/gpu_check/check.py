"""GPU check of the paper presets at their real shapes, with no checkpoint and no network.

For each family (qwen3, llama32) the preset's policy and reward model are built from their
``arch`` blocks with random weights (bf16, full vocabulary) and saved with ``save_pretrained``,
next to a word-level chat tokenizer of the real vocabulary size and a local prompt file; the
training cases then load them through the preset's own path (``experiment=paper/<family>_
ultrafeedback policy.path=<dir> reward.path=<dir> data.path=<dir>``), so every tensor has the
shape it has with the real checkpoints. Random weights rarely sample EOS, so responses run to
the budget: the worst case for time and memory.

Cases, most important first (a global deadline skips what does not fit, and says so):

- ``build/<family>``: the random models, tokenizer and prompts (on the GPU);
- ``credit/<family>``: DATC's exact and top-64 credit (``datc.credit.datc_math.datc_scores``, the
  call ``python -m scripts.bench.credit`` times on CPU) against one LM-head matmul of the same shape, and the
  exact credit with ``credit.matmul_dtype`` bfloat16 and tf32;
- ``decode/<family>``: the rollout's decode loops at a generation batch of 128 rows
  (``scripts.gpu_check.decode_bench``): the dynamic-cache loop, the static-cache step eager and as a replayed
  CUDA graph, tokens/s and the fraction of the HBM bound (bandwidth of a device-to-device copy
  measured in the same case), and the graph's replay against the eager step;
- ``train/<family>/<credit>/<stage>``: a few training steps, ``credit`` in grpo, datc and
  ``deepspeed`` in none, zero2, zero3, or ``backend=fsdp2`` (stage ``fsdp2``; one process, which
  joins a one-rank process group);
  ``train/<family>/<credit>/none/vllm``: the same with ``rollout=vllm``, where vLLM is installed
  (``--engines``; the machine this project's checks run on has no vLLM, so it has no such case);
- ``synced/<family>``: sampling with ``synced_gpus=True`` from a ZeRO-3 engine under bf16
  autocast (the trainer turns synced_gpus on only with several ranks); ``synced/<family>/gathered``
  the same with the parameters gathered once per call (``deepspeed.gather_for_generation``);
- ``fused_adam``: whether DeepSpeed's FusedAdam (the optimizer ``deepspeed.optimizer_impl=auto``
  picks on GPUs) JIT-compiles; the training cases use torch's AdamW so that no case waits on it.

Every case (its code: scripts/gpu_check/cases.py) runs in its own process, forked from a server that
imported the libraries once, with its own time limit, so a hang or a crash costs that case only; errors are reported with one line
and the traceback's tail. A training case ends as soon as its last step is in metrics.jsonl: the
run's closing evaluation and checkpoint (several GB of optimizer state) are not part of the
check and are cut. Results go to ``<out>/gpu_check.json`` and ``<out>/gpu_check.md``, rewritten
after every case, and the progress lines to ``<out>/gpu_check.log``; the exit status is 0 once
the report is written, whatever the cases' outcomes.

    python -m scripts.gpu_check --out DIR            # real shapes (a GPU; about 8 minutes)
    python -m scripts.gpu_check --tiny --out DIR     # the same cases at tiny shapes (CPU rehearsal)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from datc.run.provenance import package_version, provenance
from scripts.gpu_check.cases import FAMILIES, _child, set_environment
from scripts.gpu_check.matrix import (
    CREDITS,
    DEFAULT_BUDGET_S,
    STAGES,
    Case,
    build_cases,
    render_since,
    verdict,
)
from scripts.gpu_check.runs import VARIANTS

set_environment()  # before torch is imported (here, in the fork server and in the cases)

PEAK_BF16 = 989e12  # H200 SXM dense bf16 (NVIDIA datasheet: 1,979 TFLOP/s with 2:4 sparsity, halved)
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "accelerate", "deepspeed", "datasets", "pyarrow",
            "pandas", "fsspec", "huggingface-hub", "hydra-core", "omegaconf", "pydantic", "pydantic-core", "numpy")


@dataclass(frozen=True)
class Scale:
    """The scaled-down batch of the training cases (the presets: 64 prompts x 8, mini-batch 128,
    micro-batch 4, 512-token responses, prompts up to 512 tokens), and, for ``--tiny``, the
    architecture fields that replace the preset's."""

    prompts: int = 4  # prompts per step (x num_generations 8 = batch_size responses)
    mini_batch: int = 8  # responses per optimizer step: 4 optimizer steps per rollout, as the presets
    micro_batch: int = 4  # the presets' micro-batch
    max_new_tokens: int = 128  # response budget (random weights fill it)
    prompt_words: int = 48  # words per prompt; the chat template adds a few tokens
    steps: int = 2  # training steps; the first is warm-up (the step-0 evaluation has already sampled), the others are reported
    eval_prompts: int = 4  # the run's evaluation at step 0 (one generation batch)
    threads: int = 8
    case_timeout_s: float = 150.0
    min_start_s: float = 45.0  # a training case starts only with this much of the global budget left
    arch: dict[str, Any] = field(default_factory=dict)  # overrides of both models' arch blocks
    decode_rows: int = 128  # the decode case's rows: a preset's generation batch (16 prompts x 8)
    decode_repeats: int = 2  # timed rounds of the decode case (after one warm-up round)
    decode_check_tokens: int = 16  # tokens of the graph-against-eager logits check
    copy_bytes: int = 2**30  # the device-to-device copy that measures the bandwidth


REAL = Scale()
TINY = Scale(prompts=2, mini_batch=8, micro_batch=4, max_new_tokens=8, prompt_words=6, steps=2, eval_prompts=2,
             threads=1, case_timeout_s=120.0, min_start_s=5.0, decode_rows=16, decode_check_tokens=8, copy_bytes=2**22,
             arch=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=512, max_position_embeddings=256))


# =============================================================================================
# The parent: cases in order, a deadline, the report
# =============================================================================================


class Runner:
    """Runs each case in a process of its own, forked from a server that imported the heavy
    libraries once (``forkserver``; ``spawn`` starts a fresh interpreter per case), and turns
    whatever happens to it (a result, an exception, a hang, a crash) into its result."""

    def __init__(self, work: Path, deadline: float, start_method: str, preload: list[str]):
        self.work, self.deadline = work, deadline
        self.ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self.ctx.set_forkserver_preload(preload)
        self.start_method = start_method

    def run(self, case: Case, min_s: float = 5.0) -> dict[str, Any]:
        result = self._run(case, min_s)
        if self.start_method == "forkserver" and "forked subprocess" in result.get("error", ""):
            # CUDA was initialised in the fork server after all: fresh interpreters from here on
            self.ctx, self.start_method = mp.get_context("spawn"), "spawn"
            result = {**self._run(case, min_s), "retried": "with start method spawn"}
        return result

    def _run(self, case: Case, min_s: float) -> dict[str, Any]:
        left = self.deadline - time.monotonic()
        if left < min_s:
            return {"status": "skipped", "error": f"global deadline: {max(left, 0):.0f} s left"}
        d = self.work / "cases" / case.name.replace("/", "_")
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        limit = min(case.timeout_s, left)
        t0 = time.monotonic()
        p = self.ctx.Process(target=_child, args=(case.kind, case.spec, str(d)), daemon=False)
        try:
            p.start()
        except Exception as e:  # noqa: BLE001 - e.g. no fork server on this machine
            if self.start_method != "forkserver":
                return {"status": "error", "error": f"could not start the case's process: {type(e).__name__}: {e}"}
            print(f"[gpu_check] the fork server failed ({type(e).__name__}: {e}); spawning each case instead", flush=True)
            self.ctx, self.start_method = mp.get_context("spawn"), "spawn"
            p = self.ctx.Process(target=_child, args=(case.kind, case.spec, str(d)), daemon=False)
            p.start()
        p.join(limit)
        timed_out = p.is_alive()
        if timed_out:
            p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        wall = time.monotonic() - t0
        log_tail = (d / "log.txt").read_text(errors="replace")[-3000:] if (d / "log.txt").exists() else ""
        if (d / "result.json").exists():
            text = (d / "result.json").read_text()
            try:
                result = json.loads(text)
            except json.JSONDecodeError as e:  # never since the write is once and whole; said, not raised, if it is
                result = {"status": "error", "error": f"unreadable result.json ({e}): {text[:200]!r}", "traceback": log_tail}
        elif timed_out:
            result = {"status": "timeout", "error": f"no result within the case's limit of {limit:.0f} s",
                      "traceback": log_tail}
        else:
            result = {"status": "error", "error": f"the case's process ended with code {p.exitcode} and no result",
                      "traceback": log_tail}
        result["wall_s"] = round(wall, 2)
        return result


def env_report() -> dict[str, Any]:
    import torch

    pkgs = {name: package_version(name) for name in PACKAGES}
    gpu = None
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "torch_cuda": torch.version.cuda, "cuda_devices": torch.cuda.device_count(), "nvidia_smi": gpu,
            "packages": pkgs}


def arch_overrides(scale: Scale) -> list[str]:
    return [f"{role}.arch.{k}={v}" for role in ("policy", "reward") for k, v in scale.arch.items()]


def train_overrides(family: str, credit: str, stage: str, scale: Scale, fam_dir: Path, prompt_tokens: int,
                    run_dir: Path, work: Path, ds_optimizer: str, micro: int | str | None = None,
                    mini: int | None = None, engine: str = "torch", variant: str | None = None) -> list[str]:
    """The training case's overrides; ``micro``/``mini``: its micro- and mini-batch instead of the
    scale's (the ``/auto`` case: ``micro_batch_size: auto`` over a mini-batch of the whole batch);
    ``engine``: the rollout engine (the ``/vllm`` cases: ``rollout=vllm``); ``variant``: the
    overrides of :data:`scripts.gpu_check.runs.VARIANTS` (lora's preset is its own)."""
    batch = scale.prompts * 8
    return [
        f"credit={credit}", *(["deepspeed=none", "backend=fsdp2"] if stage == "fsdp2" else [f"deepspeed={stage}"]),
        "logger=none", f"rollout={engine}",
        f"policy.path={fam_dir / 'policy'}", f"reward.path={fam_dir / 'reward'}",
        f"data.path={fam_dir / 'data'}", "data.train_split=train", "data.eval_split=test",
        f"data.max_prompt_tokens={prompt_tokens}", *arch_overrides(scale),
        f"trainer.steps={scale.steps}", f"trainer.batch_size={batch}", "trainer.num_generations=8",
        f"trainer.mini_batch_size={mini or scale.mini_batch}", f"trainer.micro_batch_size={micro or scale.micro_batch}",
        f"trainer.generation_batch_size={batch}", f"trainer.max_new_tokens={scale.max_new_tokens}",
        f"trainer.eval_size={scale.eval_prompts}", f"trainer.eval_batch_size={scale.eval_prompts}",
        f"trainer.eval_every={scale.steps}", f"trainer.checkpoint_every={scale.steps}", "trainer.warmup_steps=0",
        "trainer.mask_truncated=false",  # random weights fill the budget: masking truncated responses would leave no loss
        f"trainer.threads={scale.threads}", "trainer.progress=false",
        *([f"deepspeed.optimizer_impl={ds_optimizer}"] if stage in ("zero2", "zero3") else []),
        f"run_dir={run_dir}", f"cache_dir={work / 'cache'}", *VARIANTS.get(variant or "", []),
    ]


def summarize_train(run_dir: Path, n_policy: int, prompt_tokens: int, batch: int, on_gpu: bool) -> dict[str, Any]:
    """Step time and phases (medians over the steps after the first), throughput and MFU:
    generation 2·N·(generated tokens) / rollout_s; update 6·N·B·(P + mean response length) /
    update_s (forward + backward over every position; attention's own FLOPs not counted), both
    against the dense bf16 peak."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]]
    steps = [r for r in rows if "perf/step_s" in r]
    measured = steps[1:] or steps

    def med(k: str) -> float:
        return statistics.median(r[k] for r in measured)

    keys = ("step_s", "rollout_s", "reward_s", "credit_s", "update_s")
    out: dict[str, Any] = {k: med(f"perf/{k}") for k in keys}
    for k in ("rollout_wait_s", "engine_wait_s", "push_s"):  # the asynchronous rollout's waits (datc.step.stream)
        if all(f"perf/{k}" in r for r in measured):
            out[k] = med(f"perf/{k}")
    resp_len = med("rollout/response_len")
    gen_tokens = resp_len * batch
    upd_tokens = batch * (prompt_tokens + resp_len)
    out.update({
        "steps_logged": len(steps), "steps_measured": len(measured), "response_len": resp_len,
        "total_s": sum(r["perf/step_s"] for r in steps), "rollout_total_s": sum(r["perf/rollout_s"] for r in steps),
        "gen_tokens_per_s": gen_tokens / out["rollout_s"], "update_tokens_per_s": upd_tokens / out["update_s"],
        "peak_mem_gib": max(r.get("perf/peak_mem_gb", math.nan) for r in steps),
    })
    record = run_dir / "micro_batch.json"  # trainer.micro_batch_size: auto, as the session resolved it
    if record.exists():
        out["micro_batch_auto"] = json.loads(record.read_text())
    if on_gpu:
        out["mfu_generation"] = 2 * n_policy * gen_tokens / out["rollout_s"] / PEAK_BF16
        out["mfu_update"] = 6 * n_policy * upd_tokens / out["update_s"] / PEAK_BF16
    return out


def _fmt(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def render(report: dict[str, Any]) -> str:
    env, sc = report["env"], report["scale"]
    lines = [
        "# GPU check", "",
        f"Command: `{report['command']}` at commit {report.get('commit')}, {report.get('date')}  ",
        f"Device: {env.get('nvidia_smi') or 'no GPU (a rehearsal of the script, not a measurement)'}; "
        f"torch {env['packages'].get('torch')} (CUDA {env.get('torch_cuda')}), transformers {env['packages'].get('transformers')}, "
        f"deepspeed {env['packages'].get('deepspeed')}, Python {env['python']}.  ",
        f"Shapes: {'tiny (--tiny)' if report['tiny'] else 'the presets real architectures, random bf16 weights, full vocabularies'}; "
        f"batch {sc['prompts']} prompts x 8 = {sc['prompts'] * 8} responses, mini-batch {sc['mini_batch']}, "
        f"micro-batch {sc['micro_batch']}, {sc['max_new_tokens']}-token responses, prompts of "
        + ", ".join(f"{n} tokens ({f})" for f, n in report["prompt_tokens"].items())
        + f" (chat template included), {sc['steps']} steps (the first is warm-up). "
        f"Wall time {report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget; start method {report['start_method']}, "
        f"ZeRO optimizer {report['ds_optimizer']}.", "",
        "## Training steps", "",
        "Medians over the steps after the first. MFU: generation 2·N·(generated tokens)/rollout s, update "
        "6·N·B·(P+T)/update s (N policy parameters, attention FLOPs not counted), against 989 TFLOP/s "
        "(H200 dense bf16, datasheet). Peak: `torch.cuda.max_memory_allocated` over the run (its step-0 "
        "evaluation included; without a GPU the process's peak resident memory); plan: datc-memory-plan for the same shape on one GPU.", "",
        "| case | status | step s | rollout | reward | credit | update | gen tok/s | upd tok/s | MFU gen | MFU upd | peak GiB | plan GiB | autocast |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["cases"].items():
        if not name.startswith("train/"):
            continue
        s = r.get("summary", {})
        auto = f" (micro {s['micro_batch_auto']['micro_batch_size']})" if "micro_batch_auto" in s else ""
        lines.append(
            f"| {name[6:]}{auto} | {r['status']} | {_fmt(s.get('step_s'))} | {_fmt(s.get('rollout_s'))} | {_fmt(s.get('reward_s'))} "
            f"| {_fmt(s.get('credit_s'), '.3f')} | {_fmt(s.get('update_s'))} | {_fmt(s.get('gen_tokens_per_s'), '.0f')} "
            f"| {_fmt(s.get('update_tokens_per_s'), '.0f')} | {_fmt(s.get('mfu_generation'), '.1%')} "
            f"| {_fmt(s.get('mfu_update'), '.1%')} | {_fmt(s.get('peak_mem_gib'))} | {_fmt(r.get('plan', {}).get('gib'))} "
            f"| {r.get('autocast_dtype', '-')} |")
    lines += ["", "## DATC credit against one LM-head matmul", "",
              "Same call and inputs as scripts/bench/credit.py (chunk 128, logits 4·N(0,1)); medians; ratios to "
              "the fp32 matmul (as on CPU) and to the bf16 one (as the policy's LM head runs under autocast).", "",
              "| case | status | tokens x V x d | datc exact s | top-64 s | LM head fp32 s | bf16 s | exact / fp32 | top-64 / fp32 | exact / bf16 | exact peak MiB | exact bf16 / bf16 | exact tf32 / bf16 | bf16, tf32 err (std) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["cases"].items():
        if name.startswith("credit/"):
            sh, m = r.get("shape", {}), r.get("seconds_median", {})
            o32, o16, pk = r.get("over_lm_head_fp32", {}), r.get("over_lm_head_bf16", {}), r.get("peak_mib", {})
            shape = f"{sh['tokens']} x {sh['vocab']} x {sh['hidden']}" if sh else "-"
            lines.append(f"| {name[7:]} | {r['status']} | {shape} | {_fmt(m.get('datc_exact'), '.4f')} | "
                         f"{_fmt(m.get('datc_top64'), '.4f')} | {_fmt(m.get('lm_head_fp32'), '.4f')} | {_fmt(m.get('lm_head_bf16'), '.4f')} | "
                         f"{_fmt(o32.get('datc_exact'))} | {_fmt(o32.get('datc_top64'))} | {_fmt(o16.get('datc_exact'))} | "
                         f"{_fmt(pk.get('datc_exact'), '.0f')} | {_fmt(o16.get('datc_exact_bfloat16'))} | "
                         f"{_fmt(o16.get('datc_exact_tf32'))} | {_fmt(r.get('low_precision_err_vs_fp32_in_std', {}).get('bfloat16'), '.1e')}, "
                         f"{_fmt(r.get('low_precision_err_vs_fp32_in_std', {}).get('tf32'), '.1e')} |")
    lines += render_since(report)
    lines += render_decode(report)
    lines += render_projection(report)
    lines += ["", "## Other cases", "", "| case | status | result |", "|---|---|---|"]
    for name, r in report["cases"].items():
        if name.startswith(("train/", "credit/", "decode/", "determinism/")):
            continue
        keep = {k: v for k, v in r.items() if k not in ("status", "traceback", "error")}
        lines.append(f"| {name} | {r['status']} | {json.dumps(keep, default=str)[:300]} |")
    bad = [(n, r) for n, r in report["cases"].items() if r["status"] != "ok"]
    if bad:
        lines += ["", "## Not ok", ""]
        lines += [f"- `{n}`: {r['status']}: {r.get('error', '')}" for n, r in bad]
    return "\n".join(lines) + "\n"


def render_projection(report: dict[str, Any]) -> list[str]:
    """The headline: one paper-preset run (500 steps of 64 prompts x 8 responses of up to 512
    tokens, 4 updates per batch) on this GPU, projected from the measured rates
    (:func:`scripts.gpu_check.projection.project`), per family, with its arithmetic."""
    from scripts.gpu_check.projection import PRESET, project

    lines = ["", "## Projected paper-preset run", "",
             f"{PRESET['steps']} steps of {PRESET['responses']} responses of {PRESET['max_new_tokens']} tokens, sampled in calls of "
             f"{PRESET['rows_per_call']}, from the decode case's fastest loop and the `train/<family>/datc/none` case's "
             "phases scaled by tokens (scripts.gpu_check.projection: both terms underestimate the attention's growth at long responses).", ""]
    sc = report["scale"]
    for fam, ptok in report.get("prompt_tokens", {}).items():
        dec, tr = report["cases"].get(f"decode/{fam}", {}), report["cases"].get(f"train/{fam}/datc/none", {})
        if dec.get("status") != "ok" or tr.get("status") != "ok" or ptok is None:
            lines.append(f"- {fam}: not projected (decode/{fam} {dec.get('status', 'missing')}, "
                         f"train/{fam}/datc/none {tr.get('status', 'missing')})")
            continue
        p = project(dec, tr["summary"], sc["prompts"] * 8, ptok)
        report.setdefault("projection", {})[fam] = {"hours": p.hours, "seconds_per_step": p.seconds_per_step}
        lines.append(f"- **{fam}: {p.hours:.2f} h** ({p.seconds_per_step:.1f} s a step)")
        lines += [f"  - {ln}" for ln in p.lines]
    return lines


def render_decode(report: dict[str, Any]) -> list[str]:
    """The decode cases' table: each loop's throughput and fraction of the HBM bound, and the
    graph's replay against the eager step."""
    lines = ["", "## Decode", "",
             "scripts.gpu_check.decode_bench through the rollout's sampler, forced to the full budget, under the trainer's autocast. "
             "Step: (call - prefill) / (T - 1). HBM bound: (weights + KV cache at its mean live length P + T/2) / "
             "the bandwidth of a device-to-device copy in the same case; fraction = bound / step. Graph: the static "
             "step replayed as a CUDA graph (off CUDA it runs eagerly), checking for finished rows every "
             "trainer.decode_sync_every steps or (to_budget) never; captured and replay = eager: the graph check's "
             "capture and its kept logits against the eager step's on the same tokens.", "",
             "| case | status | rows x P x T | loop | tokens/s | decode tokens/s | step ms | bound ms | of the bound | captured | replay = eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["cases"].items():
        if not name.startswith("decode/"):
            continue
        if r["status"] != "ok":
            lines.append(f"| {name[7:]} | {r['status']} | - | - | - | - | - | - | - | - | - |")
            continue
        sh, b, g = r["shape"], r["bound"], r["graph_vs_eager"]
        for mode in ("dynamic", "static", "static_graph", "static_graph_to_budget"):
            m = r["modes"][mode]
            graph = mode.startswith("static_graph")
            lines.append(f"| {name[7:]} | ok | {sh['rows']} x {sh['prompt_width']} x {sh['max_new_tokens']} | {mode} | "
                         f"{m['tokens_per_s']:.0f} | {m['decode_tokens_per_s']:.0f} | {1e3 * m['step_s']:.2f} | "
                         f"{1e3 * b['bound_step_s']:.3f} | {m['hbm_fraction']:.1%} | {g['captured'] if graph else '-'} | "
                         f"{('bit for bit' if g['bit_equal'] else 'within bf16' if g['within_bf16'] else 'NO') if graph else '-'} |")
    return lines


def write(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu_check.json", json.dumps(report, indent=1, default=str)), ("gpu_check.md", render(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder of gpu_check.json and gpu_check.md")
    ap.add_argument("--tiny", action="store_true", help="tiny architectures and batch: the CPU rehearsal")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"global deadline (default {DEFAULT_BUDGET_S:.0f} s; --tiny 600 s; --full 900 s)")
    ap.add_argument("--full", action="store_true", help="every case (each family x credit x stage and the new cases), "
                    "not the default matrix that fits 10 minutes of one GPU")
    ap.add_argument("--work", default=None, help="models, prompts and runs (default: a folder under /tmp, removed at the end)")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--credits", nargs="+", default=list(CREDITS), choices=list(CREDITS))
    ap.add_argument("--engines", nargs="+", default=["torch", *(["vllm"] if importlib.util.find_spec("vllm") else [])],
                    choices=("torch", "vllm"), help="rollout engines (default: torch, and vllm where it is installed)")
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    ap.add_argument("--steps", type=int, default=None, help="training steps per case (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="response budget (default 128; --tiny 8)")
    ap.add_argument("--ds-optimizer", default="torch", choices=("torch", "deepspeed"),
                    help="deepspeed.optimizer_impl of the ZeRO cases (deepspeed: FusedAdam, JIT-compiled at first use)")
    ap.add_argument("--start-method", default="forkserver", choices=("forkserver", "spawn"))
    ap.add_argument("--inject-failures", action="store_true", help="add a failing and a hanging case (rehearsal)")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    budget = a.budget_s if a.budget_s is not None else (600.0 if a.tiny else 900.0 if a.full else DEFAULT_BUDGET_S)
    deadline = t_start + budget
    scale = TINY if a.tiny else REAL
    if a.steps is not None:
        scale = Scale(**{**asdict(scale), "steps": a.steps})
    if a.max_new_tokens is not None:
        scale = Scale(**{**asdict(scale), "max_new_tokens": a.max_new_tokens})
    out = Path(a.out).resolve()
    work = Path(a.work).resolve() if a.work else Path("/tmp") / f"datc_gpu_check_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HOME", str(work / "hf"))
    if a.tiny:
        os.environ.setdefault("OMP_NUM_THREADS", "1")

    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "gpu_check.log", "w", buffering=1)  # noqa: SIM115 (the run's progress, also printed)

    def log(msg: str) -> None:
        line = f"[gpu_check {time.monotonic() - t_start:6.1f}s] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")

    env = env_report()
    log(f"device: {env['nvidia_smi'] or 'none (CPU rehearsal)'}; packages: "
        + ", ".join(f"{k} {v}" for k, v in env["packages"].items()))
    on_gpu = env["cuda_devices"] > 0
    # The fork server imports the heavy libraries once; DeepSpeed only without a GPU (its import
    # queries the accelerator, which the server must not initialise).
    preload = ["torch", "transformers", "datasets", "hydra", "omegaconf", "datc.training.trainer", "datc.prepare.assets",
               "datc.credit.datc_math", "datc.memory.plan", "scripts.gpu_check.cases", *([] if on_gpu else ["deepspeed"])]
    runner = Runner(work, deadline, a.start_method, preload)
    gpus = env["cuda_devices"]
    cases = build_cases(a, scale, work, gpus)
    est = sum(c.est_s for c in cases)
    log(f"{len(cases)} cases, estimated {est:.0f} s on one H200 (scripts.gpu_check.matrix.ESTIMATE_S), budget {budget:.0f} s"
        + ("" if est <= budget or a.tiny else ": the deadline will cut the last ones, and say so"))
    report: dict[str, Any] = {
        **provenance("python -m scripts.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])),
        "tiny": a.tiny, "budget_s": budget, "wall_s": 0.0, "env": env, "scale": asdict(scale),
        "peak_flops_bf16": PEAK_BF16, "start_method": a.start_method, "ds_optimizer": a.ds_optimizer,
        "prompt_tokens": {}, "cases": {c.name: {"status": "pending"} for c in cases},
    }
    built: dict[str, dict[str, Any]] = {}

    def run_case(case: Case) -> None:
        fam = case.spec.get("family")
        if case.kind in ("train", "synced", "decode", "determinism", "ranks"):
            stage = case.spec.get("stage", "zero3")
            run_dir = work / "runs" / case.name.replace("/", "_")
            variant = "deterministic" if case.kind == "determinism" else case.spec.get("variant")
            ov = train_overrides(fam, case.spec.get("credit", "grpo"), stage, scale, work / fam,
                                 built[fam]["prompt_tokens"], run_dir, work, a.ds_optimizer,
                                 case.spec.get("micro"), case.spec.get("mini"), case.spec.get("engine", "torch"), variant)
            case.spec.update(overrides=ov, run_dir=str(run_dir), params=built[fam]["params"])
        log(f"{case.name}: running (limit {case.timeout_s:.0f} s, {deadline - time.monotonic():.0f} s left)")
        case.result = runner.run(case, {"train": scale.min_start_s, "fused_adam": 60.0}.get(case.kind, 5.0))
        if case.kind == "build":
            built[fam] = case.result
            report["prompt_tokens"][fam] = case.result.get("prompt_tokens")
        if case.kind in ("train", "ranks") and case.result["status"] == "ok":
            try:
                case.result["summary"] = summarize_train(Path(case.spec["run_dir"]), built[fam]["params"]["policy"],
                                                         built[fam]["prompt_tokens"], scale.prompts * 8, on_gpu)
            except Exception as e:  # noqa: BLE001 - a report error is this case's, not the script's
                case.result.update(status="error", error=f"report: {type(e).__name__}: {e}",
                                   traceback=traceback.format_exc()[-4000:])
            shutil.rmtree(case.spec["run_dir"], ignore_errors=True)  # checkpoints of a finished tiny run

    for case in cases:
        fam = case.spec.get("family")
        if case.kind in ("credit", "decode", "train", "synced", "determinism", "ranks") and built.get(fam, {}).get("status") != "ok":
            case.result = {"status": "skipped", "error": f"build/{fam} did not succeed"}
        elif case.kind == "ranks" and on_gpu and gpus < case.spec["nproc"]:
            case.result = {"status": "skipped", "error": f"{gpus} GPU on this machine: {case.spec['nproc']} ranks need as many"}
        else:
            try:
                run_case(case)
            except Exception as e:  # noqa: BLE001 - a failure of the script's own part is the case's too
                case.result = {"status": "error", "error": f"gpu_check: {type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()[-4000:]}
        r = case.result
        report["cases"][case.name] = r
        try:
            said = verdict(case.name, r, report["cases"])
        except Exception as e:  # noqa: BLE001 - a verdict's error is said, the run goes on
            said = f"(no verdict: {type(e).__name__}: {e})"
        r["verdict"] = said
        log(f"{case.name}: {r['status']}" + (f" ({r.get('wall_s', 0):.0f} s)" if "wall_s" in r else "")
            + ("" if r["status"] == "ok" else f": {r.get('error', '')}") + (f"; {said}" if r["status"] == "ok" else ""))
        report["wall_s"], report["start_method"] = time.monotonic() - t_start, runner.start_method
        write(out, report)
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    report["wall_s"] = time.monotonic() - t_start
    write(out, report)
    n_ok = sum(r["status"] == "ok" for r in report["cases"].values())
    log(f"done: {n_ok} of {len(cases)} cases ok -> {out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
