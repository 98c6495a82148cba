"""The DeepSpeed backend: the policy in a ZeRO engine (stage 0-3), the frozen models as replicas
or, under ZeRO-3, sharded inference engines (as TRL prepares its reference and reward models);
the engine's optimizer and checkpoints. The only module that imports DeepSpeed or reads its
parameters' ``ds_id`` (its config builders: :mod:`datc.backends.deepspeed_config`).

Gradient reductions are collective, so every rank backpropagates every micro-batch (a non-finite
loss is zeroed token-wise by the caller, ``collective``), each rank's loss is scaled by the world
size W (DeepSpeed averages gradients over ranks), and clipping and the step are the engine's (it
applies the update at the mini-batch's last micro-batch).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from datc.backends.base import Backend, Declares, PolicyOptimizer
from datc.backends.deepspeed_config import deepspeed_config, inference_config
from datc.backends.distributed import Dist, export_env, join_group
from datc.config import TrainConfig
from datc.run.checkpoint import load_engine_checkpoint, save_engine_checkpoint

log = logging.getLogger(__name__)


class DeepSpeedBackend(Backend):
    name = "deepspeed"

    @classmethod
    def join(cls, c: TrainConfig) -> Dist:
        """Join the process group through DeepSpeed (gloo on CPU, NCCL on GPUs)."""
        export_env()
        import sys
        import warnings

        cpu = not torch.cuda.is_available()
        if cpu:  # said, not detected: DeepSpeed's "Setting accelerator to CPU" warning is not repeated per rank
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # DeepSpeed's ZeRO gathers call torch's all_gather_into_tensor, which torch now marks as
        # deprecated: the warning is DeepSpeed's to act on, not the user's.
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)

        import deepspeed
        import deepspeed.comm.torch  # noqa: F401  (the module; `deepspeed.comm.torch` as an attribute is torch)

        if cpu:
            # DeepSpeed JIT-compiles a shared-memory all-reduce kernel when it starts on CPU (about a
            # minute with a C++ toolchain, a failure without one). gloo does the collectives instead.
            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        return join_group(lambda: deepspeed.init_distributed(
            dist_backend="gloo" if cpu else "nccl", verbose=False, timeout=datetime.timedelta(seconds=c.backend.timeout_s)))

    @property
    def synced(self) -> bool:
        """ZeRO-3 with several ranks: parameters partitioned across ranks, gathered per forward."""
        return self.c.deepspeed.stage == 3 and self.dist.world_size > 1

    def place_frozen(self, model):
        ds_cfg = inference_config(self.c, self.dist.world_size)
        if ds_cfg is None:
            return model
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=ds_cfg)
        engine.module.eval()
        return engine.module

    def build_optimizer(self, policy, trainable: list, make_scheduler) -> tuple[Any, PolicyOptimizer]:
        import deepspeed

        device = next(policy.parameters()).device
        engine, _, _, sched = deepspeed.initialize(model=policy, model_parameters=trainable,
                                                   config=deepspeed_config(self.c, self.dist.world_size, device),
                                                   lr_scheduler=make_scheduler)
        engine.module.eval()
        return engine.module, DeepSpeedOptimizer(engine, sched, self.dist)

    def declares(self, policy) -> Declares:
        synced = self.synced
        gather, why = (gather_generation_for(self.c.deepspeed.gather_for_generation, policy, True,
                                             next(policy.parameters()).device)
                       if synced else (False, "no ZeRO-3 partitioning across ranks"))
        return Declares(synced_ranks=synced, share_prompts=not synced, gather_generation=gather,
                        frozen_partitioned=inference_config(self.c, self.dist.world_size) is not None,
                        why=f"ZeRO-3 sampling: {'parameters gathered once per call' if gather else 'synced gathers'} "
                            f"({why})" if synced else "")

    @classmethod
    def owns(cls, param: torch.Tensor) -> bool:
        return hasattr(param, "ds_id")

    @classmethod
    def whole(cls, module):
        params = [p for p in module.parameters() if hasattr(p, "ds_id")]
        if not params:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    @classmethod
    def gathered(cls, param: torch.Tensor) -> torch.Tensor:
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().clone()

    @classmethod
    def full_state_dict(cls, module) -> dict[str, torch.Tensor]:
        with cls.whole(module):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    @classmethod
    def checkpoint_weights(cls, ckpt: Path, state: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        if not state.get("deepspeed"):
            return None
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name, exclude_frozen_parameters=True)


def gather_generation_for(mode: str, policy, synced_gpus: bool, device, free_bytes: int | None = None) -> tuple[bool, str]:
    """Whether ZeRO-3 sampling gathers the policy's parameters once per call
    (``deepspeed.gather_for_generation``): ``gather`` / ``synced`` as asked; ``auto`` gathers when
    the whole parameters take at most half the device's free memory (always on the CPU).
    Returns (gather, why) for the run's log. Without several ZeRO-3 ranks there is nothing to gather."""
    if not synced_gpus:
        return False, "no ZeRO-3 partitioning across ranks"
    if mode != "auto":
        return mode == "gather", f"deepspeed.gather_for_generation={mode}"
    full = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in policy.parameters())
    if device.type != "cuda":
        return True, f"auto: {full / 2**30:.2f} GiB of parameters in host memory"
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    fits = full <= free_bytes // 2
    return fits, f"auto: {full / 2**30:.2f} GiB of parameters, {free_bytes / 2**30:.2f} GiB free on the device"


class DeepSpeedOptimizer:
    """The policy's DeepSpeed engine (the same AdamW and schedule, inside the engine)."""

    collective = True
    # No cast cache: ZeRO-3 re-partitions a weight between forward and backward, so a cached
    # low-precision copy would be stale (an empty tensor) by then.
    autocast_cache = False

    def __init__(self, engine, sched, dist: Dist) -> None:
        self.module, self.sched, self.dist = engine, sched, dist
        self.world_size = dist.world_size

    def zero_grad(self) -> None:  # the engine zeroes its gradients after each step
        return None

    def backward(self, loss: torch.Tensor) -> None:
        self.module.backward(loss * self.world_size, scale_wrt_gas=False)
        self.module.step()  # applies the update only at the mini-batch's last micro-batch

    def step(self, backpropagated: int) -> tuple[float, bool]:
        gn = self.module.get_global_grad_norm()
        return float(torch.tensor(float(gn) if gn is not None else math.nan)), False  # reported at float32, as a norm tensor

    def skip(self) -> None:
        self.sched.step()

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def save(self, run_path: Path, step: int, rng: Any, elapsed: float, keep: int,
             extra: dict[str, Any] | None = None) -> None:
        d = self.dist
        save_engine_checkpoint(run_path, step, self.module, {"elapsed": elapsed}, {"rng": rng, **(extra or {})}, d.rank,
                               d.world_size, d.gather, keep)

    def load(self, ckpt: Path, state: dict[str, Any]) -> dict[str, Any]:
        return load_engine_checkpoint(ckpt, self.module, self.dist.rank, self.dist.world_size)

    def generation(self, gather: bool):
        """With ``gather`` (ZeRO-3), the policy's parameters gathered once for the whole sampling
        call and ZeRO's per-module hooks removed meanwhile (DeepSpeed's
        ``unwrap_model_for_generation``, which TRL's ``ds3_gather_for_generation`` uses): no
        all-gather per token, and no rank waits for the others' responses to end."""
        if not gather:
            return contextlib.nullcontext()
        from deepspeed.runtime.zero import unwrap_model_for_generation

        return unwrap_model_for_generation(self.module)
