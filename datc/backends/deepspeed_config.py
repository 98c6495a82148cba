"""DeepSpeed's config, derived from the trainer's (:class:`datc.config.TrainConfig`) so the two can
never disagree: the policy engine's, the frozen models' inference engines' (ZeRO-3), and the
choice of AdamW implementation. Imports no DeepSpeed module at import time."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch

from datc.backends.base import update_lr
from datc.backends.distributed import micro_batch_per_rank
from datc.config import TrainConfig

log = logging.getLogger(__name__)


def deepspeed_config(c: TrainConfig, world_size: int, device: torch.device) -> dict[str, Any]:
    """The DeepSpeed config of the policy engine, derived from the trainer's so the two can
    never disagree: ``train_batch_size`` is the mini-batch (responses per optimizer step),
    ``gradient_accumulation_steps`` the micro-batches per rank in it. Clipping, AdamW and its
    hyper-parameters are the trainer's; bf16 comes from ``policy.dtype`` through torch autocast
    with fp32 master weights, exactly as without DeepSpeed. ``deepspeed.config`` is merged last."""
    t, d = c.trainer, c.deepspeed
    micro = micro_batch_per_rank(c, world_size)
    torch_adam = use_torch_adam(d.optimizer_impl, device)
    zero: dict[str, Any] = {"stage": d.stage, "overlap_comm": d.overlap_comm}
    if d.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": d.offload_optimizer, "pin_memory": device.type == "cuda"}
    if d.offload_param != "none":
        zero["offload_param"] = {"device": d.offload_param, "pin_memory": device.type == "cuda"}
    cfg: dict[str, Any] = {
        "train_batch_size": t.mini_batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": t.mini_batch_size // (micro * world_size),
        "gradient_clipping": t.max_grad_norm,
        "optimizer": {"type": "AdamW", "params": {"lr": update_lr(c), "betas": list(t.adam_betas), "eps": 1e-8,
                                                   "weight_decay": t.weight_decay, "torch_adam": torch_adam}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # torch AdamW is allowed with offload (CPU runs, tests)
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return _merge(cfg, dict(d.config))


def sanitized_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` with architecture-specific suffixes dropped (``9.0a`` -> ``9.0``,
    ``10.0f`` -> ``10.0``; ``+PTX`` kept; duplicates removed): DeepSpeed's op builder parses each
    entry as ``major.minor`` and fails on suffixed ones, which CUDA 12+ images set."""
    out: list[str] = []
    for entry in value.replace(",", ";").replace(" ", ";").split(";"):
        if not entry:
            continue
        ptx = entry.endswith("+PTX")
        core = entry[: -len("+PTX")] if ptx else entry
        m = re.match(r"^(\d+)\.(\d+)", core) or re.match(r"^(\d)(\d)$", core)
        arch = f"{m.group(1)}.{m.group(2)}" if m else core
        arch += "+PTX" if ptx else ""
        if arch not in out:
            out.append(arch)
    return ";".join(out)


def use_torch_adam(impl: str, device: torch.device, build=None) -> bool:
    """Whether the policy engine runs torch's AdamW (else DeepSpeed's FusedAdam / CPU Adam):
    ``torch`` and ``deepspeed`` as asked; ``auto`` is torch's on CPU, and on a GPU DeepSpeed's
    FusedAdam when its kernel builds (``TORCH_CUDA_ARCH_LIST`` sanitized first,
    :func:`sanitized_arch_list`), else torch's AdamW with one log line saying why. ``build``: the
    kernel's build (default DeepSpeed's ``FusedAdamBuilder().load``), injectable for tests."""
    if impl != "auto":
        return impl == "torch"
    if device.type == "cpu":
        return True
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch and (clean := sanitized_arch_list(arch)) != arch:
        log.info("TORCH_CUDA_ARCH_LIST %r -> %r for DeepSpeed's op builder", arch, clean)
        os.environ["TORCH_CUDA_ARCH_LIST"] = clean
    try:
        if build is None:
            from deepspeed.ops.op_builder import FusedAdamBuilder

            build = FusedAdamBuilder().load
        build()
        return False
    except Exception as e:  # a JIT build failure: no toolchain, an arch the builder refuses, ...
        log.warning("deepspeed.optimizer_impl=auto: DeepSpeed's FusedAdam did not build (%s: %s); using torch's AdamW",
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return True


def inference_config(c: TrainConfig, world_size: int) -> dict[str, Any] | None:
    """DeepSpeed config for a frozen model (reference policy, reward model), as TRL prepares
    them: sharded under ZeRO-3, otherwise ``None`` (a plain replica on every rank)."""
    if c.deepspeed.stage != 3:
        return None
    micro = micro_batch_per_rank(c, world_size)
    zero: dict[str, Any] = {"stage": 3}
    if c.deepspeed.offload_param != "none":
        zero["offload_param"] = {"device": c.deepspeed.offload_param}
    return {"train_batch_size": micro * world_size, "train_micro_batch_size_per_gpu": micro,
            "zero_optimization": zero, "steps_per_print": 10**9}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
