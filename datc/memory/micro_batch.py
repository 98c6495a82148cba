"""``trainer.micro_batch_size: auto``: the micro-batch sized by memory, resolved once when the
session is built (:func:`datc.training.session.build_session`), logged in one line and recorded in the run
directory (``micro_batch.json``), so that a resumed run uses the value it started with even on
another device.

The rule (:func:`choose_micro_batch`, a pure function of the planned peak and the budget):

- on a GPU, the largest divisor of the per-process mini-batch (``mini_batch_size / processes``)
  whose planned peak (:func:`datc.memory.plan.plan`, the run's own shapes, ZeRO stage and
  parameter counts) times :data:`MARGIN` fits the device's memory less :data:`RESERVE_BYTES`
  (CUDA context, allocator slack, NCCL); 1 when not even that fits (the run may then not fit;
  the line says so). Models outside the plan's Llama/Qwen3 layout get :data:`FALLBACK`;
- on the CPU, the whole per-process mini-batch (no gradient accumulation: host memory is not
  planned, and the testbed's defaults already use micro_batch_size = mini_batch_size).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from datc.memory.formulas import (  # noqa: F401 (re-exported)
    FALLBACK,
    GIB,
    MARGIN,
    RESERVE_BYTES,
    choose_micro_batch,
    divisors,
)

log = logging.getLogger(__name__)

AUTO = "auto"
RECORD_FILE = "micro_batch.json"  # in the run directory: the resolved value, read back on resume
ARCH_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def arch_of_model(model) -> dict[str, Any] | None:
    """The ``arch`` block of a loaded Llama/Qwen3-style model (its config), or None for a model
    the memory plan does not cover (GPT-2's field names, for one)."""
    conf = getattr(model, "config", None)
    if conf is None or any(getattr(conf, k, None) is None for k in ARCH_KEYS):
        return None
    out = {"model_type": conf.model_type, **{k: getattr(conf, k) for k in ARCH_KEYS}}
    for k in ("num_key_value_heads", "head_dim", "tie_word_embeddings"):
        if getattr(conf, k, None) is not None:
            out[k] = getattr(conf, k)
    return out


def _numel(model) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # whole, under ZeRO-3 too


def planned_peak_fn(c, policy, rm, world_size: int) -> Callable[[int], float] | None:
    """n -> the plan's peak bytes per GPU of config ``c`` with micro-batch n, from the loaded
    models' architectures and parameter counts; None when the plan does not cover them."""
    from datc.memory.plan import plan, plan_stage

    pa, ra = arch_of_model(policy), arch_of_model(rm)
    if pa is None or ra is None:
        return None
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in policy.parameters() if p.requires_grad)
    counts = {"policy": _numel(policy), "reward": _numel(rm)}
    if c.policy.lora.r > 0:
        counts = {"policy": counts["policy"] - trainable, "reward": counts["reward"], "adapter": trainable}
    stage = plan_stage(c)
    base = dataclasses.replace(c, policy=dataclasses.replace(c.policy, arch=pa), reward=dataclasses.replace(c.reward, arch=ra))

    def peak(n: int) -> float:
        cn = dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, micro_batch_size=n))
        return plan(cn, counts, stage, world_size)["total"]

    return peak


def resolve_micro_batch(c, policy, rm, world_size: int, device: torch.device,
                        record: Path | None = None) -> tuple[Any, str | None]:
    """``c`` with ``trainer.micro_batch_size`` resolved, and why (None when it was a number).
    ``record``: the run's ``micro_batch.json``; read when it exists (a resumed run keeps its
    value), else written. The caller broadcasts rank 0's choice."""
    t = c.trainer
    if t.micro_batch_size != AUTO:
        return c, None
    per_rank = t.mini_batch_size // world_size
    if record is not None and record.exists():
        try:
            n = int(json.loads(record.read_text())["micro_batch_size"])
            why = f"as when the run started ({record.name})"
        except (ValueError, KeyError, TypeError):
            n, why = None, None
        if n is not None and n > 0 and per_rank % n == 0:
            return dataclasses.replace(c, trainer=dataclasses.replace(t, micro_batch_size=n)), why
    if device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory - RESERVE_BYTES
        n, why = choose_micro_batch(per_rank, planned_peak_fn(c, policy, rm, world_size), budget)
    else:
        n, why = choose_micro_batch(per_rank, None, None)
    if record is not None:
        from datc.atomic import atomic_write_json

        atomic_write_json(record, {"micro_batch_size": n, "why": why, "device": str(device), "processes": world_size})
    return dataclasses.replace(c, trainer=dataclasses.replace(t, micro_batch_size=n)), why
