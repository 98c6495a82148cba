"""The parallelism backend: one plug-in, chosen once by config (``backend=plain|deepspeed|fsdp2``).

A backend joins the process group, places the policy and the frozen models, owns the policy's
optimizer step and its checkpoints (behind :class:`PolicyOptimizer`), answers whether a model's
parameters are partitioned over ranks and gives them whole (for sampling, an engine's weight push
and the exported policy), and **declares** to the step plan (:func:`datc.step.plan.build_plan`)
what its placement asks of the step (:class:`Declares`). Nothing outside ``datc/backends/`` asks
which backend a run has: it asks the backend.

| backend | processes | the policy | frozen models | optimizer | checkpoints |
|---|---|---|---|---|---|
| ``plain`` | one | a module | modules | torch AdamW | ``state.pt`` |
| ``deepspeed`` | 1..N | a ZeRO engine (stage 0-3) | replicas; ZeRO-3: sharded engines | the engine's | DeepSpeed's shards |
| ``fsdp2`` | 1..N | ``fully_shard`` per decoder block | replicas | torch AdamW on DTensor shards | ``torch.distributed.checkpoint`` |

``backend: auto`` (the default) is ``deepspeed`` when a DeepSpeed stage is chosen
(``deepspeed=zero2`` ...) and ``plain`` otherwise, so the DeepSpeed configs and presets work as
they did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from datc.config import TrainConfig


@dataclass(frozen=True)
class Declares:
    """What a backend's placement asks of the step plan (read by :func:`datc.step.plan.build_plan`)."""

    synced_ranks: bool = False  # the policy's forwards are collective: every rank makes as many as the others
    share_prompts: bool = True  # passes may forward each distinct prompt once (no per-forward collective to match)
    share_update_prompts: bool = True  # ... the update's backward too (through the shared prompt's KV cache)
    gather_generation: bool = False  # sampling with the policy's parameters whole once per call (no per-token gathers)
    frozen_partitioned: bool = False  # the reference / reward model are partitioned (no trunk to compare)
    why: str = ""  # one phrase for the run's log


class PolicyOptimizer(Protocol):
    """The policy's optimizer step, as the update phase (:mod:`datc.step.update`) and the run's
    checkpoints (:mod:`datc.training.lifecycle`) see it; each backend has its own."""

    module: Any  # what the policy's forwards go through (the engine under DeepSpeed)
    world_size: int  # W: each rank holds 1/W of every mini-batch
    collective: bool  # every rank must backpropagate every micro-batch
    autocast_cache: bool  # whether autocast may cache low-precision weight copies

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, backpropagated: int) -> tuple[float, bool]:
        """End of a mini-batch: (global gradient norm, whether the step was skipped)."""

    def skip(self) -> None:
        """A mini-batch without any token: no step, the schedule still advances."""

    @property
    def lr(self) -> float: ...

    def save(self, run_path: Path, step: int, rng: Any, elapsed: float, keep: int,
             extra: dict[str, Any] | None = None) -> None:
        """Checkpoint after ``step``; ``extra``: more of this rank's state (the rollout stream's
        batches in flight, :mod:`datc.step.stream`), handed back by :meth:`load` under its keys."""

    def load(self, ckpt: Path, state: dict[str, Any]) -> dict[str, Any]: ...

    def generation(self, gather: bool):
        """A context for sampling from the policy; ``gather``: with its parameters whole."""


class Backend:
    """One backend of a run (an instance per process, built by :func:`backend_for`)."""

    name = "base"

    def __init__(self, c: TrainConfig, dist) -> None:
        self.c, self.dist = c, dist

    # ---- the process group ----------------------------------------------------------------------
    @classmethod
    def join(cls, c: TrainConfig):
        """This process's :class:`datc.backends.distributed.Dist` (joining the process group where
        the backend runs several processes)."""
        from datc.backends.distributed import Dist

        return Dist()

    # ---- placement -------------------------------------------------------------------------------
    def place_frozen(self, model):
        """A frozen model (reference, reward model) placed for inference: a replica by default."""
        return model

    def build_optimizer(self, policy, trainable: list, make_scheduler: Callable) -> tuple[Any, PolicyOptimizer]:
        """The policy as its forwards see it, and its optimizer step (``make_scheduler(opt)``: the
        run's learning-rate schedule on an optimizer)."""
        raise NotImplementedError

    def declares(self, policy) -> Declares:
        """What the placement of ``policy`` (as :meth:`build_optimizer` returned it) asks of the plan."""
        return Declares()

    # ---- parameters, asked of a module whatever placed it ------------------------------------------
    @classmethod
    def owns(cls, param: torch.Tensor) -> bool:
        """Whether ``param`` is partitioned by this backend."""
        return False

    @classmethod
    def whole(cls, module) -> contextlib.AbstractContextManager:
        """A context in which ``module``'s parameters are whole on every rank (collective)."""
        return contextlib.nullcontext()

    @classmethod
    def gathered(cls, param: torch.Tensor) -> torch.Tensor:
        """A whole copy of one of this backend's parameters, detached (collective)."""
        return param.detach()

    @classmethod
    def whole_state(cls, module) -> dict[str, torch.Tensor]:
        """``module``'s state dict with whole tensors on every rank, where they are (no copy),
        read inside :meth:`whole` (an engine's weight push; collective where partitioned)."""
        return module.state_dict()

    @classmethod
    def full_state_dict(cls, module) -> dict[str, torch.Tensor]:
        """``module``'s parameters and buffers whole, on the CPU (collective where partitioned)."""
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    @classmethod
    def checkpoint_weights(cls, ckpt: Path, state: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The policy's fp32 weights in checkpoint ``ckpt`` (its ``state.pt`` is ``state``) when this
        backend wrote it, in one process; None when another did."""
        return None


def update_lr(c) -> float:
    """The optimizer's rate: ``trainer.lr``, times ``policy.lora.lr_scale`` where LoRA adapters
    train (they start at zero and need a larger step than whole weights: 10x, as the paper presets'
    LoRA variants always used), so one ``trainer.lr`` serves a run with and without adapters."""
    return c.trainer.lr * (c.policy.lora.lr_scale if c.policy.lora.r > 0 else 1.0)
