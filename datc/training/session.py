"""One training run's session: its config, backend (:mod:`datc.backends`), models, optimizer
(behind :class:`datc.backends.base.PolicyOptimizer`), credit scheme, step plan, seams and prompt
stream, built once by :func:`build_session` and read by every step."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import get_scheduler

from datc.backends.base import Backend, PolicyOptimizer
from datc.backends.distributed import Dist
from datc.backends.plugins import backend_class, gathered, partitioned
from datc.config import ConfigError, TrainConfig
from datc.credit import resolve_scheme
from datc.credit.base import GOLD_CONTRIB, RM_EMBEDDING
from datc.engines import ENGINES
from datc.forward.trunk import shared_trunk_depth
from datc.memory.micro_batch import AUTO, RECORD_FILE, resolve_micro_batch
from datc.models.build import decoder_layers, resolve_device, resolve_dtype
from datc.prepare.assets import Assets, ensure_assets
from datc.run.logger import keeps_completions
from datc.step.ops import StepOps
from datc.step.plan import StepPlan, build_plan, head_chunk_for
from datc.step.stream import SyncRollouts, build_stream
from datc.training.model_set import Models, load_models

log = logging.getLogger(__name__)


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
    """Everything one training run holds: config, models, optimizer, credit scheme, step plan,
    seams, prompts. The step reads it and never writes into it."""

    c: TrainConfig
    m: Models
    assets: Assets
    device: torch.device
    scheme: Any  # datc.credit.CreditScheme
    credit_params: Any
    optim: PolicyOptimizer  # the policy's optimizer step (the backend's)
    plan: StepPlan  # the step's special cases, decided once (datc.step.plan)
    sampler: PromptSampler
    rm_embedding: torch.Tensor | None  # (V, d) when the scheme declares it
    amp_dtype: torch.dtype | None  # autocast dtype for the policy (bf16 on capable GPUs), None = fp32
    dist: Dist = dataclasses.field(default_factory=Dist)  # this process's rank (datc.backends.distributed)
    ops: StepOps = dataclasses.field(default_factory=StepOps)  # the step's seams (datc.step.ops)
    engine: Any = None  # datc.engines.RolloutEngine: what samples the rollouts (rollout=torch|vllm)
    backend: Any = None  # datc.backends.base.Backend: what placed the models and steps the optimizer
    stream: Any = dataclasses.field(default_factory=SyncRollouts)  # datc.step.stream: when, and with which weights, batches are sampled

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None,
                              cache_enabled=self.optim.autocast_cache)


def build_session(c: TrainConfig, dist: Dist | None = None, ops: StepOps | None = None,
                  on_assets: Callable[[Assets], None] | None = None, run_dir: str | Path | None = None) -> Session:
    """Prepare (or load from cache) the assets, load the models, have the backend place them and
    build the optimizer (the same AdamW and transformers schedule on every backend: under
    DeepSpeed inside the policy's engine, under FSDP2 on the shards), and decide the step plan.
    ``ops``: the step's seams (tests inject a sampler, scorer, credit function or loss there). ``on_assets``: called on every rank with
    the prepared assets before any model loads (the trainer checks a resumed run's inputs).
    ``trainer.micro_batch_size: auto`` is resolved here, once the models are placed
    (:mod:`datc.memory.micro_batch`), and recorded in ``run_dir`` (a resumed run reads its value back);
    the session's config holds the number."""
    t = c.trainer
    dist = dist or Dist()
    device = resolve_device(t.device)
    if device.type == "cuda" and dist.enabled:
        device = torch.device("cuda", dist.local_rank)
    scheme, credit_params = resolve_scheme(c.credit)
    if GOLD_CONTRIB in scheme.needs and c.data.task is None:  # before any model loads
        from datc.tasks import TASKS

        raise ConfigError(f"credit.name: {c.credit.get('name')!r} reads the task's per-token gold contributions, which "
                          f"a real dataset (data.task: null) does not have; choose data.task from "
                          f"{', '.join(TASKS.names())}, or another credit scheme")
    if not dist.is_main:  # rank 0 prepares the cache; the others read it
        dist.barrier()
    assets = ensure_assets(c)
    if dist.is_main:
        dist.barrier()
    if on_assets is not None:
        on_assets(assets)
    backend: Backend = backend_class(c)(c, dist)
    m = load_models(c, assets, device, backend)
    m.policy.eval()  # dropout off: the loss must see the distribution that sampled (ratio = 1 on-policy)
    c = micro_batch_for(c, m, dist, device, run_dir)
    t = c.trainer
    updates_per_step = t.epochs * (t.batch_size // t.mini_batch_size)
    if t.warmup_steps > 0 and "warmup" in t.lr_scheduler and t.steps * updates_per_step == 1 and dist.is_main:
        from datc.run.runlock import warn

        warn(f"trainer.steps={t.steps}: a warm-up's first optimizer update has learning rate 0, so this run's only "
             "update changes nothing; use trainer.warmup_steps=0 or more steps")
    trainable = [p for p in m.policy.parameters() if p.requires_grad]  # a LoRA policy: its adapters alone

    def make_scheduler(opt):
        return get_scheduler(t.lr_scheduler, opt, num_warmup_steps=t.warmup_steps * updates_per_step,
                             num_training_steps=t.steps * updates_per_step)

    m.policy, optim = backend.build_optimizer(m.policy, trainable, make_scheduler)
    m.policy.eval()
    ops = ops or StepOps()
    rollout_engine = ENGINES.get(c.rollout.name).build(c, m, device, dist)
    if dist.is_main:
        log.info("rollout engine: %s", rollout_engine.describe())
    plan = session_plan(c, scheme, m, dist, rollout_engine, backend)
    sampler = PromptSampler(len(assets.train), t.batch_size // t.num_generations, c.seed)
    rm_embedding = rm_embedding_of(m) if RM_EMBEDDING in scheme.needs else None
    dtype = resolve_dtype(c.policy.dtype, device)
    amp = dtype if dtype != torch.float32 else None  # fp32 master weights, low-precision compute
    s = Session(c, m, assets, device, scheme, credit_params, optim, plan, sampler, rm_embedding, amp, dist=dist,
                ops=ops, engine=rollout_engine, backend=backend)
    s.stream = build_stream(s)
    return s



def micro_batch_for(c: TrainConfig, m: Models, dist: Dist, device: torch.device, run_dir: str | Path | None) -> TrainConfig:
    """``c`` with ``trainer.micro_batch_size: auto`` resolved (:func:`datc.memory.micro_batch.resolve_micro_batch`):
    rank 0 decides (and records it in ``run_dir``), every rank gets its number; one log line says
    which and why."""
    if c.trainer.micro_batch_size != AUTO:
        return c
    record = Path(run_dir) / RECORD_FILE if run_dir is not None and dist.is_main else None
    resolved, why = resolve_micro_batch(c, m.policy, m.rm, dist.world_size, device, record)
    n, why = dist.broadcast((resolved.trainer.micro_batch_size, why))
    if dist.is_main:
        log.info("trainer.micro_batch_size=auto -> %d: %s", n, why)
    return dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, micro_batch_size=n))


def session_plan(c: TrainConfig, scheme, m: Models, dist: Dist, engine=None, backend: Backend | None = None) -> StepPlan:
    """The step plan of a run with config ``c``, credit scheme ``scheme``, placed models ``m``,
    rollout engine ``engine`` (None: the built-in one) and ``backend`` (None: the config's, for
    models it did not place: one process)."""
    backend = backend or backend_class(c)(c, dist)
    chunk, why = head_chunk_for(c.trainer.lm_head_chunk, m.policy)
    if why is not None and dist.is_main:
        log.warning("trainer.lm_head_chunk=%s is off for this run: %s", c.trainer.lm_head_chunk, why)
    checkpointing = c.trainer.gradient_checkpointing
    if checkpointing and partitioned(m.policy):
        checkpointing = False
        if dist.is_main:
            log.warning("trainer.gradient_checkpointing is off for this run: the policy's parameters are partitioned "
                        "over ranks (ZeRO-3, FSDP2)")
    if checkpointing and decoder_layers(m.policy) is None:
        raise ConfigError("trainer.gradient_checkpointing: the policy has no base_model.layers or base_model.h to checkpoint")
    declared = backend.declares(m.policy)
    if declared.why and dist.is_main:
        log.info("%s", declared.why)
    # the reward model reads the policy's prompt ids unless it has its own chat template
    trunk = shared_trunk_depth(m.ref, m.rm) if not c.reward.chat_template and not partitioned(m.rm) else 0
    return build_plan(c.trainer, scheme, m.vocab_size, with_ref=m.ref is not None, trunk=trunk, backend=declared,
                      keep_completions=dist.is_main and keeps_completions(c.logger), head_chunk=chunk,
                      grad_checkpoint=checkpointing, engine=engine,
                      correction=c.rollout.correction, correction_cap=c.rollout.correction_cap,
                      staleness=c.rollout.max_staleness)


def rm_embedding_of(m: Models) -> torch.Tensor:
    """(V, d) the reward model's input-embedding matrix, float32, gathered whole under ZeRO-3."""
    return gathered(m.rm.get_input_embeddings().weight).float()
