"""A run's identity: the fields of its config that determine what it computes (``run.json``'s
``identity``, hashed into its name by :mod:`datc.run.naming`), and the later switches that join it
only when set away from the behaviour they were added beside, so adding them renamed no run."""

from __future__ import annotations

import dataclasses
from typing import Any

from datc.config import VLLMConfig

# Settings that change how a run is executed or reported, not what it computes.
NON_IDENTITY = {"run_dir", "run_name", "results_dir", "cache_dir", "logger"}
# (skip_zero_advantage leaves out only work whose result the loss multiplies by A = 0; the decode
# loop samples the same distribution with the same logits to float rounding, as threads and device)
NON_IDENTITY_TRAINER = {"resume", "progress", "threads", "device", "skip_zero_advantage", "gradient_checkpointing", "decode",
                        "decode_sync_every", "accept_changed_inputs", "eval_cache"}
# Later switches whose default is the behaviour from before they existed: part of the identity
# only when set to something else, so adding them renamed no existing run. {field: its default}
IDENTITY_WHEN_SET_TRAINER = {"lm_head_chunk": None, "deterministic": False}
# How ZeRO-3 gathers the policy's parameters for sampling: the same samples either way.
NON_IDENTITY_DEEPSPEED = {"gather_for_generation"}
# vLLM's memory settings that leave every computed number as it is (oneDNN's cache keeps made primitives)
NON_IDENTITY_VLLM = {"onednn_cache_capacity", "trim_heap"}

def identity(cfg: dict[str, Any]) -> dict[str, Any]:
    ident = {k: v for k, v in cfg.items() if k not in NON_IDENTITY}
    ident["trainer"] = {k: v for k, v in ident["trainer"].items()
                        if k not in NON_IDENTITY_TRAINER and not (k in IDENTITY_WHEN_SET_TRAINER and v == IDENTITY_WHEN_SET_TRAINER[k])}
    if isinstance(ident.get("deepspeed"), dict):
        ident["deepspeed"] = {k: v for k, v in ident["deepspeed"].items() if k not in NON_IDENTITY_DEEPSPEED}
    # auto, plain and deepspeed are told apart by deepspeed.stage (a run keeps the identity it had
    # before the option); fsdp2's settings change memory and waiting, not the numbers
    if isinstance(ident.get("credit"), dict) and ident["credit"].get("end_token") == "score":
        # the weight step's end_token at its default: a run keeps the identity it had before the option
        ident["credit"] = {k: v for k, v in ident["credit"].items() if k != "end_token"}
    if isinstance(ident.get("rollout"), dict):
        # the synchronous step (rollout.max_staleness: 0) and the LoRA push at its default (auto): a run keeps
        # the identity it had before the options
        at_default = {"max_staleness": 0, "lora_sync": "auto"}
        # rollout.vllm.* sat in rollout itself before it had its node (the built-in engine's config
        # too, at the defaults): flattened, with the defaults where a config has no such node, a
        # run keeps its identity
        vllm = {**dataclasses.asdict(VLLMConfig()), **(ident["rollout"].get("vllm") or {})}
        flat = {**{k: v for k, v in ident["rollout"].items() if k != "vllm"}, **vllm}
        ident["rollout"] = {k: v for k, v in flat.items()
                            if k not in NON_IDENTITY_VLLM and not (k in at_default and v == at_default[k])}
    backend = ident.pop("backend", None)
    if isinstance(backend, dict) and backend.get("name") == "fsdp2":
        ident["backend"] = {"name": "fsdp2"}
    if isinstance(ident.get("policy"), dict) and not (ident["policy"].get("lora") or {}).get("r"):
        # LoRA off (policy.lora.r: 0): a full-policy run keeps the identity it had before the option
        ident["policy"] = {k: v for k, v in ident["policy"].items() if k != "lora"}
    elif isinstance(ident.get("policy"), dict) and (lora := ident["policy"].get("lora")).get("alpha") == 2 * lora["r"]:
        # alpha written out at its default (2 r) is the same run as alpha: null
        ident["policy"] = {**ident["policy"], "lora": {**lora, "alpha": None}}
    if isinstance(ident.get("reward"), dict) and ident["reward"].get("delta", 0) is None:
        # the reward model trained, not loaded from a delta (reward.delta: null, the default): a run keeps
        # the identity it had before the option
        ident["reward"] = {k: v for k, v in ident["reward"].items() if k != "delta"}
    train = (ident.get("reward") or {}).get("train") if isinstance(ident.get("reward"), dict) else None
    # the reward model's prepare without shared prompts, with its blocks trained whole (the defaults):
    # a run keeps the identity it had before the options
    at_default = {"share_prompts": False, "lora_r": 0}
    if isinstance(train, dict) and any(k in train and train[k] == v for k, v in at_default.items()):
        ident["reward"] = {**ident["reward"], "train": {k: v for k, v in train.items()
                                                        if not (k in at_default and v == at_default[k])}}
    return ident


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [prefix.rstrip(".")] if a != b else []
