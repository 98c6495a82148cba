"""One training run's session: its config, models, optimizer (or DeepSpeed engine), credit
scheme and prompt stream, built once by :func:`build_session` and read by every step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from transformers import get_scheduler

from datc.config import TrainConfig
from datc.credit import resolve_scheme
from datc.credit.base import RM_EMBEDDING
from datc.distributed import Dist, deepspeed_config, gathered
from datc.model_set import Models, load_models
from datc.models import resolve_device, resolve_dtype
from datc.numerics import NonFiniteReport
from datc.prepare import Assets, ensure_assets


class PromptSampler:
    """Prompts for step ``s`` are a pure function of (seed, s): consecutive slices of a stream
    of per-epoch permutations, so a resumed run draws exactly the prompts it would have."""

    def __init__(self, n: int, per_step: int, seed: int) -> None:
        self.n, self.per_step, self.seed = n, per_step, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        start = step * self.per_step
        return [self._perm(i // self.n)[i % self.n] for i in range(start, start + self.per_step)]



@dataclass
class Session:
    """Everything one training run holds: config, models, optimizer, credit scheme, prompts."""

    c: TrainConfig
    m: Models
    assets: Assets
    device: torch.device
    scheme: Any  # datc.credit.CreditScheme
    credit_params: Any
    opt: torch.optim.Optimizer
    sched: Any
    sampler: PromptSampler
    rm_embedding: torch.Tensor | None  # (V, d) when the scheme declares it
    amp_dtype: torch.dtype | None  # autocast dtype for the policy (bf16 on capable GPUs), None = fp32
    nonfinite: NonFiniteReport | None = None  # the last step's non-finite hits (datc.numerics)
    dist: Dist = dataclasses.field(default_factory=Dist)  # this process's rank (datc.distributed)
    engine: Any = None  # the policy's DeepSpeed engine (None = plain PyTorch)
    completions: Any = None  # datc.logger.Completions of the last step before an eval (rank 0), for W&B

    def autocast(self):
        # No cast cache under DeepSpeed: ZeRO-3 re-partitions a weight between forward and
        # backward, so a cached low-precision copy would be stale (an empty tensor) by then.
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None,
                              cache_enabled=self.engine is None)


def build_session(c: TrainConfig, dist: Dist | None = None) -> Session:
    """Prepare (or load from cache) the assets, load the models, build the optimizer (under
    DeepSpeed: the policy's engine, whose optimizer and schedule are the same AdamW and
    transformers scheduler)."""
    t = c.trainer
    dist = dist or Dist()
    device = resolve_device(t.device)
    if device.type == "cuda" and dist.enabled:
        device = torch.device("cuda", dist.local_rank)
    scheme, credit_params = resolve_scheme(c.credit)
    if not dist.is_main:  # rank 0 prepares the cache; the others read it
        dist.barrier()
    assets = ensure_assets(c)
    if dist.is_main:
        dist.barrier()
    m = load_models(c, assets, device, dist)
    m.policy.eval()  # dropout off: the loss must see the distribution that sampled (ratio = 1 on-policy)
    updates_per_step = t.epochs * (t.batch_size // t.mini_batch_size)

    def make_scheduler(opt):
        return get_scheduler(t.lr_scheduler, opt, num_warmup_steps=t.warmup_steps * updates_per_step,
                             num_training_steps=t.steps * updates_per_step)

    engine = None
    if dist.enabled:
        import deepspeed

        engine, opt, _, sched = deepspeed.initialize(model=m.policy, model_parameters=m.policy.parameters(),
                                                     config=deepspeed_config(c, dist.world_size, device),
                                                     lr_scheduler=make_scheduler)
        m.policy = engine.module
        m.policy.eval()
    else:
        opt = torch.optim.AdamW(m.policy.parameters(), lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay,
                                fused=True)  # one fused kernel (CPU and CUDA) instead of per-tensor loops
        sched = make_scheduler(opt)
    sampler = PromptSampler(len(assets.train), t.batch_size // t.num_generations, c.seed)
    rm_embedding = rm_embedding_of(m) if RM_EMBEDDING in scheme.needs else None
    dtype = resolve_dtype(c.policy.dtype, device)
    amp = dtype if dtype != torch.float32 else None  # fp32 master weights, low-precision compute
    return Session(c, m, assets, device, scheme, credit_params, opt, sched, sampler, rm_embedding, amp,
                   dist=dist, engine=engine)



def rm_embedding_of(m: Models) -> torch.Tensor:
    """(V, d) the reward model's input-embedding matrix, float32, gathered whole under ZeRO-3."""
    return gathered(m.rm.get_input_embeddings().weight).float()
