"""What runs inside one case's process of the GPU check (``python -m scripts.gpu_check``): building
the random models at the presets' shapes, the credit timing, the decode loops, a few training steps through
``datc.training.trainer.train``, synced_gpus sampling under ZeRO-3, the FusedAdam build. Each case
function takes its (picklable) spec and its folder and returns its numbers; :func:`_child` turns
whatever happens into ``result.json`` there. Importable without CUDA (every heavy import is
inside a case); :func:`set_environment` is called by the script before torch is imported.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Set before torch is imported anywhere (the parent, the fork server, the cases): CUDA
# availability through NVML (does not initialise CUDA, so forking stays safe), nothing online.
ENVIRONMENT = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}

FAMILIES = {"qwen3": ("qwen3_ultrafeedback", "chatml"), "llama32": ("llama32_ultrafeedback", "llama3")}


def set_environment() -> None:
    """:data:`ENVIRONMENT` into ``os.environ`` (values already set are kept). The processes of
    the cases (fork server or spawn) inherit it."""
    for k, v in ENVIRONMENT.items():
        os.environ.setdefault(k, v)


# =============================================================================================
# What runs inside a case's process
# =============================================================================================


def preset(family: str, variant: str = "") -> str:
    """The family's paper preset (UltraFeedback setting), ``variant`` "_lora" its LoRA variant."""
    return FAMILIES[family][0] + variant


def compose(family: str, overrides: list[str], variant: str = ""):
    """The family's preset (:func:`preset`) with ``overrides``, as a DictConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from datc.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=[f"experiment=paper/{preset(family, variant)}", *overrides])


def chat_tokenizer(fmt: str, vocab_size: int, out: Path):
    """A word-level tokenizer with exactly ``vocab_size`` tokens (the family's special tokens,
    the role names, then words ``w<i>``) and the family's chat format, saved to ``out``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.helpers.chat_formats import FORMATS  # the chat formats the tests use too

    f = FORMATS[fmt]
    template, specials, eos, pad = f.template, (f.pad, *f.specials), f.eos, f.pad
    vocab = {t: i for i, t in enumerate([*specials, "<unk>", "user", "assistant", "system"])}
    while len(vocab) < vocab_size:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])  # their ids in vocab
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, pad_token=pad, unk_token="<unk>")
    tok.chat_template = template
    tok.save_pretrained(out)
    return tok


def case_build(spec: dict[str, Any], case_dir: Path) -> dict[str, Any]:
    """Random bf16 policy and reward model of the preset's arch blocks, the tokenizer and the
    prompts, under ``spec["dir"]``. Returns the prompt length in tokens (chat template included)."""
    import random

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from datc.checks import validate

    c = validate(compose(spec["family"], spec["arch_overrides"]))
    out = Path(spec["dir"])
    shutil.rmtree(out, ignore_errors=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fmt = FAMILIES[spec["family"]][1]
    tok = chat_tokenizer(fmt, int(c.policy.arch["vocab_size"]), out / "tokenizer")
    params, seconds = {}, {}
    for role, kind, arch in (("policy", "causal_lm", c.policy.arch), ("reward", "reward", c.reward.arch)):
        t0 = time.perf_counter()
        a = dict(arch)
        extra = {"num_labels": 1} if kind == "reward" else {}
        conf = AutoConfig.for_model(a.pop("model_type"), **a, **extra, bos_token_id=tok.bos_token_id,
                                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        cls = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForSequenceClassification
        torch.manual_seed(0)
        with torch.device(device):
            model = cls.from_config(conf, dtype=torch.bfloat16)
        params[role] = sum(p.numel() for p in model.parameters())
        model.save_pretrained(out / role)
        tok.save_pretrained(out / role)
        del model
        seconds[role] = round(time.perf_counter() - t0, 2)
    rng = random.Random(0)
    words = [w for w in tok.get_vocab() if w.startswith("w")]
    (out / "data").mkdir()
    for split, n in (("train", 64), ("test", 16)):
        rows = [{"prompt": " ".join(rng.choice(words) for _ in range(spec["prompt_words"]))} for _ in range(n)]
        (out / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = {len(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)) for r in rows}
    return {"params": params, "seconds": seconds, "prompt_tokens": max(lengths), "vocab": len(tok), "device": device,
            "disk_gb": round(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e9, 2)}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def case_credit(spec: dict[str, Any], case_dir: Path) -> dict[str, Any]:
    """DATC's exact and top-64 scores against one LM-head matmul, at the family's shape: ``tokens``
    response tokens, |V| and d of the reward model, fp32 (as in the trainer) and, for the matmul,
    bf16 as well; the exact scores also with ``credit.matmul_dtype`` bfloat16 and tf32, with their
    largest difference from the fp32 scores in units of the scores' spread (their error against
    float64 is measured on CPU: results/bench/credit_precision.md). Same inputs and call as
    ``python -m scripts.bench.credit`` (logits 4·N(0,1): peaked)."""
    import torch

    from datc.checks import validate
    from datc.credit.datc_math import datc_scores

    c = validate(compose(spec["family"], spec["arch_overrides"]))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, V, d = spec["tokens"], int(c.reward.arch["vocab_size"]), int(c.reward.arch["hidden_size"])
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(n, V, generator=g, device=device).mul_(4.0)
    E = torch.randn(V, d, generator=g, device=device).mul_(0.02)
    grad = torch.randn(n, d, generator=g, device=device)
    y = torch.randint(V, (n,), generator=g, device=device)
    h = torch.randn(n, d, generator=g, device=device)
    E16, h16 = E.bfloat16(), h.bfloat16()
    ones = torch.ones(n, device=device)
    runs = {
        "lm_head_fp32": lambda: h @ E.T,
        "lm_head_bf16": lambda: h16 @ E16.T,
        "datc_exact": lambda: datc_scores(grad, E, logits, y, ones, logit_map="jacobian", alignment="projection",
                                          chunk_size=128),
        "datc_top64": lambda: datc_scores(grad, E, logits, y, ones, logit_map="jacobian", alignment="projection",
                                          chunk_size=128, top_k=64),
        # credit.matmul_dtype: the exact credit's |V|-wide work in bf16 / on TF32 tensor cores
        **{f"datc_exact_{dt}": (lambda dt=dt: datc_scores(grad, E, logits, y, ones, logit_map="jacobian",
                                                            alignment="projection", chunk_size=128, matmul_dtype=dt))
           for dt in ("bfloat16", "tf32")},
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    peak: dict[str, float] = {}
    for k, f in runs.items():  # warm-up, and the peak memory of one call above what is already held
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        f()
        _sync(device)
        peak[k] = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else math.nan
    for r in range(spec["repeats"]):
        for k in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            _sync(device)
            t0 = time.perf_counter()
            runs[k]()
            _sync(device)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    exact = runs["datc_exact"]().double()
    spread = exact.std()
    low_err = {dt: float((runs[f"datc_exact_{dt}"]().double() - exact).abs().max() / spread) for dt in ("bfloat16", "tf32")}
    return {"shape": {"tokens": n, "vocab": V, "hidden": d, "chunk_size": 128}, "seconds_median": med,
            "low_precision_err_vs_fp32_in_std": low_err,
            "over_lm_head_fp32": {k: med[k] / med["lm_head_fp32"] for k in med},
            "over_lm_head_bf16": {k: med[k] / med["lm_head_bf16"] for k in med},
            "peak_mib": peak, "repeats": spec["repeats"], "device": str(device)}


def case_decode(spec: dict[str, Any], case_dir: Path) -> dict[str, Any]:
    """Decode at the family's shape (scripts.gpu_check.decode_bench): ``rows`` responses (groups of 8 sharing
    their prompt, as a preset's generation batch) of ``max_new_tokens`` forced tokens, the policy
    loaded in fp32 as the trainer loads it and sampled under its bf16 autocast with cached weight
    casts (the plain trainer's); the dynamic loop, the static step eager and replayed as a CUDA
    graph (eager off CUDA); each one's fraction of the HBM bound, with the bandwidth of a
    device-to-device copy measured here; and the graph's replay against the eager step."""
    import torch

    from datc.checks import validate
    from datc.models.build import load_pretrained, resolve_device, resolve_dtype
    from datc.models.chat import prompt_encoder
    from datc.models.tokenizer import load_tokenizer
    from scripts.gpu_check.decode_bench import copy_bandwidth, graph_vs_eager, hbm_bound, time_modes

    c = validate(compose(spec["family"], spec["overrides"]))
    device = resolve_device(c.trainer.device)
    dtype = resolve_dtype(c.policy.dtype, device)
    tok = load_tokenizer(c.policy.path)
    policy = load_pretrained("causal_lm", c.policy.path, "policy.path", torch.float32).to(device).eval()
    G, T = 8, spec["max_new_tokens"]
    rows = [json.loads(x) for x in (Path(c.data.path) / "train.jsonl").read_text().splitlines()][: spec["rows"] // G]
    ids, mask = prompt_encoder(c, tok).encode(rows, device)
    ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    low = dtype != torch.float32
    bandwidth = copy_bandwidth(device, spec["copy_bytes"])
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=low, cache_enabled=True):
        bound = hbm_bound(policy, ids, mask, T, low, bandwidth)
        modes = time_modes(policy, ids, mask, T, tok.eos_token_id, tok.pad_token_id, ["dynamic", "static", "static_graph",
                                                                         "static_graph_to_budget"],
                           spec["repeats"], prompt_repeats=G, sync_every=c.trainer.decode_sync_every)
        check = graph_vs_eager(policy, ids, mask, spec["check_tokens"], tok.eos_token_id, tok.pad_token_id, G)
    for r in modes.values():
        if "step_s" in r:
            r["hbm_fraction"] = bound["bound_step_s"] / r["step_s"]
    return {"shape": {"rows": int(ids.shape[0]), "prompt_width": int(ids.shape[1]), "max_new_tokens": T},
            "copy_bandwidth_gb_s": bandwidth / 1e9, "bound": bound, "modes": modes, "graph_vs_eager": check,
            "sync_every": c.trainer.decode_sync_every, "autocast_dtype": str(dtype).replace("torch.", ""),
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", **_cuda_memory()}


def _watch(run_dir: Path, steps: int, case_dir: Path, extra: dict[str, Any]) -> None:
    """Ends the process once ``steps`` training steps are in metrics.jsonl (the run's closing
    evaluation and checkpoint are not part of the check)."""
    f = run_dir / "metrics.jsonl"
    while True:
        time.sleep(0.2)
        try:
            complete = f.read_text().split("\n")[:-1]  # lines the logger has finished writing
        except OSError:
            continue
        n = sum('"perf/step_s"' in line for line in complete)
        if n >= steps:
            if not _write_result(case_dir, {"status": "ok", "ended": "after the last step", **extra, **_cuda_memory()}):
                return  # the run ended first and its own result is written: the case's thread exits the process
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _cuda_memory() -> dict[str, float]:
    import torch

    if not torch.cuda.is_initialized():
        return {}
    return {"max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def plan_memory(family: str, overrides: list[str], stage: str, counts: dict[str, int], policy_bytes: int = 4,
                variant: str = "", n_gpus: int = 1) -> dict[str, Any]:
    """The memory plan's estimate (datc-memory-plan) for this case's shape on one GPU (``counts``: the
    parameters of the models built, equal to ``memory_plan.param_count`` of their arch blocks);
    ``none``: plain PyTorch; ``fsdp2``: backend=fsdp2. ``policy_bytes``: the trained policy's bytes per parameter (4, fp32)."""
    from datc.memory import plan as mp_
    c = mp_.compose(preset(family, variant), overrides)
    st = {"none": None, "zero3": 3, "fsdp2": mp_.FSDP2}.get(stage, 2)
    if c.policy.lora.r > 0 and "adapter" not in counts:  # the adapters' parameters, counted from the policy's arch block
        counts = {**counts, "adapter": mp_.lora_param_count(c.policy.arch, c.policy.lora)}
    if c.trainer.micro_batch_size == "auto":  # as the session resolves it (datc.memory.micro_batch)
        import torch

        from datc.memory.micro_batch import RESERVE_BYTES

        budget = torch.cuda.get_device_properties(0).total_memory - RESERVE_BYTES if torch.cuda.is_available() else None
        c = mp_.auto_micro(c, counts, st, n_gpus, budget)
    p = mp_.plan(c, counts, st, n_gpus, policy_bytes)
    return {"gib": p["total"] / 2**30, "peak_phase": p["peak_phase"], "params": counts}


def case_train(spec: dict[str, Any], case_dir: Path) -> dict[str, Any]:
    """A few steps of the preset through ``datc.training.trainer.train`` (the real loading path)."""
    import torch

    from datc.models.build import resolve_device, resolve_dtype
    from datc.training.trainer import train

    cfg = compose(spec["family"], spec["overrides"], spec.get("preset", ""))
    run_dir = Path(spec["run_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    device = resolve_device(cfg.trainer.device)
    extra = {"autocast_dtype": str(resolve_dtype(cfg.policy.dtype, device)).replace("torch.", ""),
             "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    try:  # the estimate is a comparison only: without it the case goes on
        extra["plan"] = plan_memory(spec["family"], spec["overrides"], spec["stage"], spec["params"], variant=spec.get("preset", ""))
    except Exception as e:  # noqa: BLE001
        extra["plan"] = {"error": f"{type(e).__name__}: {e}"}
    if spec.get("variant"):  # lora, async, ...: what the variant's run is (scripts.gpu_check.runs)
        from scripts.gpu_check.runs import variant_facts

        extra.update(variant_facts(spec["variant"], cfg, device))
    threading.Thread(target=_watch, args=(run_dir, spec["steps"], case_dir, extra), daemon=True).start()
    train(cfg, run_dir)
    return {"ended": "run finished", **extra, **_cuda_memory()}


def case_synced(spec: dict[str, Any], case_dir: Path) -> dict[str, Any]:
    """Sampling from a ZeRO-3 engine of the policy, bf16 autocast, one process: with
    ``synced_gpus=True`` and ZeRO's per-module gathers (the path ranks of a multi-GPU ZeRO-3 run
    take with ``deepspeed.gather_for_generation=synced``: each forward joins the gathers), or,
    with ``spec["gather"]``, from the training engine with its parameters gathered once for the
    call (:meth:`datc.backends.deepspeed.DeepSpeedOptimizer.generation`, the ``gather`` path)."""
    import deepspeed
    import torch

    from datc.backends.deepspeed import DeepSpeedBackend
    from datc.backends.deepspeed_config import inference_config
    from datc.backends.plugins import init as init_distributed
    from datc.checks import validate
    from datc.engines.generate import sample_groups
    from datc.models.build import load_pretrained, resolve_device, resolve_dtype
    from datc.models.chat import prompt_encoder
    from datc.models.tokenizer import load_tokenizer

    c = validate(compose(spec["family"], spec["overrides"]))
    dist = init_distributed(c)
    try:
        device = resolve_device(c.trainer.device)
        dtype = resolve_dtype(c.policy.dtype, device)
        tok = load_tokenizer(c.policy.path)
        policy = load_pretrained("causal_lm", c.policy.path, "policy.path", torch.float32).to(device)  # fp32, as the trainer
        gather = bool(spec.get("gather"))
        if gather:  # the trainer's engine (an optimizer: its hooks are what the gather removes)
            from datc.backends.deepspeed import DeepSpeedOptimizer
            from datc.backends.deepspeed_config import deepspeed_config

            engine, *_ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(),
                                              config=deepspeed_config(c, dist.world_size, device))
            context = DeepSpeedOptimizer(engine, None, dist).generation(True)
        else:
            engine, *_ = deepspeed.initialize(model=policy, config=inference_config(c, dist.world_size))
            context = contextlib.nullcontext()
        rows = [json.loads(x) for x in (Path(c.data.path) / "train.jsonl").read_text().splitlines()][: spec["prompts"]]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _sync(device)
            t0 = time.perf_counter()
            with context:
                ro = sample_groups(engine.module, tok, rows, c.trainer.num_generations, c.trainer.max_new_tokens,
                                   synced_gpus=not gather, encoder=prompt_encoder(c, tok))
            _sync(device)
            seconds = time.perf_counter() - t0
        n = int(ro.response_mask.sum())
        partitioned = all(DeepSpeedBackend.owns(p) for p in engine.module.parameters())
        return {"responses": int(ro.response_ids.shape[0]), "tokens": n, "seconds": seconds, "tokens_per_s": n / seconds,
                "generation": "gathered once" if gather else "synced per-module gathers",
                "autocast_dtype": str(dtype).replace("torch.", ""), "zero3_partitioned": partitioned, **_cuda_memory()}
    finally:
        dist.close()


def case_fused_adam(spec: dict[str, Any], case_dir: Path) -> dict[str, Any]:
    """JIT-compile and load DeepSpeed's FusedAdam (CUDA only), as ``optimizer_impl=auto`` does
    (:func:`datc.backends.deepspeed_config.use_torch_adam`: the arch list sanitized first, torch's AdamW if the
    build still fails); reports the arch list before and after and which AdamW a run would get."""
    import os

    import torch

    from datc.backends.deepspeed_config import use_torch_adam

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: FusedAdam is a CUDA kernel")
    from deepspeed.ops.op_builder import FusedAdamBuilder

    before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    t0 = time.perf_counter()
    errors: list[str] = []

    def build():
        try:
            FusedAdamBuilder().load()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            raise

    torch_adam = use_torch_adam("auto", torch.device("cuda"), build)
    return {"seconds": time.perf_counter() - t0, "arch_list_before": before,
            "arch_list_after": os.environ.get("TORCH_CUDA_ARCH_LIST"), "fused_adam_built": not torch_adam,
            "adamw": "torch (fallback)" if torch_adam else "DeepSpeed FusedAdam", "error": errors[0] if errors else None}


def case_fail(spec: dict[str, Any], case_dir: Path) -> dict[str, Any]:
    """Deliberate failures for the rehearsal: an exception, or a hang past the case's limit."""
    if spec["how"] == "hang":
        time.sleep(3600)
    raise RuntimeError("a deliberately failing case (--inject-failures)")


def _kinds() -> dict[str, Any]:
    from scripts.gpu_check.runs import case_determinism, case_ranks

    return {"build": case_build, "credit": case_credit, "decode": case_decode, "train": case_train, "synced": case_synced,
            "fused_adam": case_fused_adam, "fail": case_fail, "determinism": case_determinism, "ranks": case_ranks}


_RESULT_LOCK = threading.Lock()
_result_written = False  # this process's result is written (a case's process writes one, once)


def _write_result(case_dir: Path, result: dict[str, Any]) -> bool:
    """``result.json``, written whole (a temporary file of this process and thread, renamed) and
    once: a training case has two writers, the thread that ends the process after the last step
    and the case's own return, and the first one wins. Both once wrote the same temporary file,
    so the second could truncate the file the first had just renamed into place, and the parent
    read an empty ``result.json`` (a JSONDecodeError, now and then, in the rehearsal's ZeRO-2
    cases, whose runs end soon after their last step). Returns whether this call wrote it."""
    global _result_written
    with _RESULT_LOCK:
        if _result_written:
            return False
        tmp = case_dir / f".result.json.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps(result, default=str))
        os.replace(tmp, case_dir / "result.json")
        _result_written = True
        return True


def _child(kind: str, spec: dict[str, Any], case_dir: str) -> None:
    """A case's process: output to its log, the outcome to result.json."""
    d = Path(case_dir)
    log = open(d / "log.txt", "w", buffering=1)  # noqa: SIM115 (open for the process's life)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    try:
        import torch

        torch.set_num_threads(spec.get("threads", 1))
        _write_result(d, {"status": "ok", **_kinds()[kind](spec, d)})
    except BaseException as e:  # noqa: BLE001 - every failure is the case's result
        tb = traceback.format_exc()
        print(tb, flush=True)
        _write_result(d, {"status": "error", "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                          "traceback": tb[-4000:]})
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
