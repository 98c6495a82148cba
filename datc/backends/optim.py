"""One optimizer-step interface for the policy, chosen once when the session is built.

The update phase (:mod:`datc.step.update`) and the run's checkpoints (:mod:`datc.training.lifecycle`)
talk to a :class:`PolicyOptimizer` and never ask which one it is:

- :class:`TorchOptimizer`: plain PyTorch AdamW and a transformers schedule. A micro-batch whose
  loss is not finite is skipped; the step clips the global gradient norm and is skipped when no
  micro-batch was backpropagated or the norm is not finite.
- :class:`DeepSpeedOptimizer`: the policy's DeepSpeed engine (same AdamW and schedule, inside
  the engine). Gradient reductions are collective, so every rank backpropagates every
  micro-batch (a non-finite loss is zeroed token-wise by the caller, ``collective``), each rank's
  loss is scaled by the world size W (DeepSpeed averages gradients over ranks), and clipping and
  the step are the engine's (it applies the update at the mini-batch's last micro-batch).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from datc.backends.distributed import Dist
from datc.config import ConfigError
from datc.models.lora import load_trained_state, trained_state
from datc.run.checkpoint import load_engine_checkpoint, save_checkpoint, save_engine_checkpoint


class PolicyOptimizer(Protocol):
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

    def save(self, run_path: Path, step: int, rng: Any, elapsed: float, keep: int) -> None: ...

    def load(self, ckpt: Path, state: dict[str, Any]) -> dict[str, Any]: ...

    def generation(self, gather: bool):
        """A context for sampling from the policy; ``gather``: with its parameters whole."""


class TorchOptimizer:
    world_size = 1
    collective = False
    autocast_cache = True

    def __init__(self, policy, opt: torch.optim.Optimizer, sched, max_grad_norm: float) -> None:
        self.module, self.opt, self.sched, self.max_grad_norm = policy, opt, sched, max_grad_norm

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, backpropagated: int) -> tuple[float, bool]:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        stepped = bool(backpropagated and torch.isfinite(grad_norm))  # never step on a non-finite gradient
        if stepped:
            self.opt.step()
            self._stepped = True
            # The step runs inside one autocast region, whose cache holds the low-precision casts of
            # the weights made in grad mode, unversioned: after the update they are stale, and the
            # next mini-batch's forwards would use the old weights' casts.
            torch.clear_autocast_cache()
        self._schedule()
        return float(grad_norm), not stepped

    def skip(self) -> None:
        self._schedule()

    def _schedule(self) -> None:
        """Advance the learning-rate schedule. A skipped first step advances it before any
        optimizer step, on purpose (the schedule counts updates, taken or not): torch's warning
        about that order is silenced, and only then."""
        if getattr(self, "_stepped", False):
            self.sched.step()
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
            self.sched.step()

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def save(self, run_path: Path, step: int, rng: Any, elapsed: float, keep: int) -> None:
        # a LoRA policy's checkpoint holds its adapters and their optimizer state, not the frozen base
        save_checkpoint(run_path, step, {"policy": trained_state(self.module, self.module.state_dict()),
                                         "optimizer": self.opt.state_dict(),
                                         "scheduler": self.sched.state_dict(), "rng": rng, "elapsed": elapsed}, keep)

    def generation(self, gather: bool):
        return contextlib.nullcontext()

    def load(self, ckpt: Path, state: dict[str, Any]) -> dict[str, Any]:
        if state.get("deepspeed"):
            raise ConfigError(f"deepspeed: {ckpt} was written under DeepSpeed ({state['world_size']} processes); "
                              "resume it with the same deepspeed stage and process count")
        load_trained_state(self.module, state["policy"], str(ckpt))
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        return state


class DeepSpeedOptimizer:
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

    def save(self, run_path: Path, step: int, rng: Any, elapsed: float, keep: int) -> None:
        d = self.dist
        save_engine_checkpoint(run_path, step, self.module, {"elapsed": elapsed}, {"rng": rng}, d.rank, d.world_size,
                               d.barrier, keep)

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
