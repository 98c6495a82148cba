"""The plain backend: one PyTorch process, the policy a module, torch's AdamW and a transformers
schedule, checkpoints in one ``state.pt`` (:mod:`datc.run.checkpoint`)."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch

from datc.backends.base import Backend, PolicyOptimizer, update_lr
from datc.config import ConfigError
from datc.models.lora import load_trained_state, trained_state
from datc.run.checkpoint import save_checkpoint


class PlainBackend(Backend):
    name = "plain"

    def build_optimizer(self, policy, trainable: list, make_scheduler) -> tuple[Any, PolicyOptimizer]:
        t = self.c.trainer
        opt = torch.optim.AdamW(trainable, lr=update_lr(self.c), betas=tuple(t.adam_betas), weight_decay=t.weight_decay,
                                fused=True)  # one fused kernel (CPU and CUDA) instead of per-tensor loops
        return policy, TorchOptimizer(policy, opt, make_scheduler(opt), t.max_grad_norm)


class TorchOptimizer:
    """Plain PyTorch AdamW and a transformers schedule. A micro-batch whose loss is not finite is
    skipped (by the caller); the step clips the global gradient norm and is skipped when no
    micro-batch was backpropagated or the norm is not finite."""

    world_size = 1
    collective = False
    autocast_cache = True

    def __init__(self, policy, opt: torch.optim.Optimizer, sched, max_grad_norm: float) -> None:
        self.module, self.opt, self.sched, self.max_grad_norm = policy, opt, sched, max_grad_norm

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip(self) -> torch.Tensor:
        """The global gradient norm, the gradients clipped to ``max_grad_norm``."""
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)

    def step(self, backpropagated: int) -> tuple[float, bool]:
        grad_norm = self.clip()
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

    def save(self, run_path: Path, step: int, rng: Any, elapsed: float, keep: int,
             extra: dict[str, Any] | None = None) -> None:
        # a LoRA policy's checkpoint holds its adapters and their optimizer state, not the frozen base
        save_checkpoint(run_path, step, {"policy": trained_state(self.module, self.module.state_dict()),
                                         "optimizer": self.opt.state_dict(),
                                         "scheduler": self.sched.state_dict(), "rng": rng, "elapsed": elapsed,
                                         **(extra or {})}, keep)

    def generation(self, gather: bool):
        return contextlib.nullcontext()

    def load(self, ckpt: Path, state: dict[str, Any]) -> dict[str, Any]:
        if state.get("deepspeed") or state.get("fsdp2"):
            which = "DeepSpeed" if state.get("deepspeed") else "FSDP2"
            raise ConfigError(f"backend: {ckpt} was written under {which} ({state['world_size']} processes); "
                              "resume it with the same backend and process count")
        load_trained_state(self.module, state["policy"], str(ckpt))
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        return state
