"""The FSDP2 backend: PyTorch's own fully sharded data parallel (``torch.distributed.fsdp.fully_shard``,
as torchtune, verl and torchtitan use it), on NCCL or, on a CPU, gloo.

The policy is sharded one decoder block at a time and then as a whole (its embeddings, final
norm and tied LM head in the root's group): every parameter is a ``DTensor`` holding this rank's
shard, gathered by each block's forward and resharded after it (``backend.reshard_after_forward``;
the root's stay whole between its forward and backward, FSDP2's own heuristic). The frozen
reference and reward models are plain replicas on every rank, as under ZeRO-2.

- **Update**: every forward and backward of the policy is collective, so every rank
  backpropagates every micro-batch (``collective``; a non-finite loss is zeroed token-wise by
  the caller) and the step plan keeps the ranks' forwards matched (``Declares.synced_ranks``).
  FSDP2's reduce-scatter averages gradients over ranks, so each rank's loss is scaled by the world
  size W, as under DeepSpeed: the reduced gradient is the global mini-batch's. The optimizer is
  torch's AdamW on the shards; the global gradient norm is reduced over ranks before clipping
  (``torch.nn.utils.get_total_norm`` on the sharded gradients, then ``full_tensor``).
- **Sampling**: the policy's parameters are unsharded once per sampling call (every rank), kept
  whole through its forwards and resharded after it (:meth:`FSDP2Optimizer.generation`): no
  gather per token and no rank waiting on the others' responses, as ZeRO-3's gathered generation.
- **Checkpoints**: ``torch.distributed.checkpoint`` (every rank writes its shards of the trainable
  parameters and of the optimizer state into ``dcp/``), one ``rank_XXXXX.pt`` per rank (its RNG
  state) and ``state.pt`` last (step, schedule, elapsed), as DeepSpeed's layout
  (:func:`datc.run.checkpoint.save_sharded_checkpoint`). ``datc-export`` reads ``dcp/`` in one
  process (:meth:`FSDP2Backend.checkpoint_weights`).
"""

from __future__ import annotations

import contextlib
import datetime
import tempfile
from pathlib import Path
from typing import Any

import torch

from datc.backends.base import Backend, Declares, PolicyOptimizer, update_lr
from datc.backends.distributed import Dist, export_env, join_group
from datc.backends.plain import TorchOptimizer
from datc.config import ConfigError, TrainConfig
from datc.run.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from datc.run.shards import DCP_DIR


def _is_dtensor(x) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


class FSDP2Backend(Backend):
    name = "fsdp2"

    @classmethod
    def join(cls, c: TrainConfig) -> Dist:
        """Join the process group: gloo on a CPU, NCCL on GPUs, with ``backend.timeout_s`` as the
        collectives' timeout (a rank that stops answering ends the others' waits after it)."""
        export_env()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        return join_group(lambda: torch.distributed.init_process_group(
            backend, timeout=datetime.timedelta(seconds=c.backend.timeout_s)))

    def build_optimizer(self, policy, trainable: list, make_scheduler) -> tuple[Any, PolicyOptimizer]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from datc.models.build import decoder_layers

        layers = decoder_layers(policy)
        if layers is None:
            raise ConfigError(f"backend=fsdp2: the policy ({type(policy).__name__}) has no base_model.layers or "
                              "base_model.h to shard block by block")
        device = next(policy.parameters()).device
        mesh = init_device_mesh(device.type, (self.dist.world_size,))
        raf = self.c.backend.reshard_after_forward
        for blk in layers:
            fully_shard(blk, mesh=mesh, reshard_after_forward=raf)
        fully_shard(policy, mesh=mesh, reshard_after_forward=False)  # the root: whole until its backward
        trainable = [p for p in policy.parameters() if p.requires_grad]  # the sharded ones now
        t = self.c.trainer
        opt = torch.optim.AdamW(trainable, lr=update_lr(self.c), betas=tuple(t.adam_betas), weight_decay=t.weight_decay)
        return policy, FSDP2Optimizer(policy, opt, make_scheduler(opt), t.max_grad_norm, self.dist,
                                      {blk: raf for blk in layers} | {policy: False})

    def declares(self, policy) -> Declares:
        synced = self.dist.world_size > 1
        # share_update_prompts: the update's gradient reaches a block's shared-prompt forward through
        # the KV cache, which FSDP2's pre-backward hooks (on the block's outputs) do not see, so the
        # block's parameters are resharded by then ("setStorage ... storage of size 0", measured on
        # one rank with tiny Llama and Qwen3): the update forwards each row's prompt itself.
        return Declares(synced_ranks=synced, share_prompts=not synced, share_update_prompts=False,
                        gather_generation=synced,
                        why="FSDP2 sampling: parameters unsharded once per call" if synced else "")

    @classmethod
    def owns(cls, param: torch.Tensor) -> bool:
        return _is_dtensor(param)

    @classmethod
    def whole(cls, module):
        return unsharded(module)

    @classmethod
    def gathered(cls, param: torch.Tensor) -> torch.Tensor:
        return param.full_tensor().detach()

    @classmethod
    def whole_state(cls, module) -> dict[str, torch.Tensor]:
        """Every rank gets every tensor whole: FSDP2's ``state_dict`` hands out its DTensor shards
        even while the parameters are unsharded, which an engine cannot load."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))

    @classmethod
    def full_state_dict(cls, module) -> dict[str, torch.Tensor]:
        """Every rank calls this (the gathers are collective); rank 0 gets the whole state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().clone() for k, v in sd.items()}

    @classmethod
    def checkpoint_weights(cls, ckpt: Path, state: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The trainable weights in an FSDP2 checkpoint's ``dcp/``, whole, read in one process."""
        if not state.get("fsdp2"):
            return None
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory(prefix="datc-dcp-") as tmp:
            out = Path(tmp) / "whole.pt"
            dcp_to_torch_save(str(ckpt / DCP_DIR), str(out))
            whole = torch.load(out, map_location="cpu", weights_only=False)
        return {k: v.float() if v.is_floating_point() else v for k, v in whole["model"].items()}


@contextlib.contextmanager
def unsharded(module, reshard_after: dict | None = None):
    """``module``'s FSDP2 parameters whole on every rank while the context is open (every rank must
    enter it: the all-gathers are collective), kept whole through its forwards, and resharded
    after; ``reshard_after``: each module's ``reshard_after_forward`` to restore (default True)."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward((reshard_after or {}).get(m, True), recurse=False)


class FSDP2Optimizer(TorchOptimizer):
    """Torch's AdamW on the policy's FSDP2 shards (see the module's docstring)."""

    collective = True
    autocast_cache = False  # a low-precision cast of a whole weight would outlive its reshard

    def __init__(self, policy, opt, sched, max_grad_norm: float, dist: Dist, reshard_after: dict) -> None:
        super().__init__(policy, opt, sched, max_grad_norm)
        self.dist, self.world_size, self.reshard_after = dist, dist.world_size, reshard_after

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.world_size).backward()  # FSDP2 averages over ranks: the global mini-batch's gradient

    def clip(self) -> torch.Tensor:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if _is_dtensor(norm):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_([p for p in self.module.parameters() if p.grad is not None],
                                             self.max_grad_norm, norm)
        return norm

    def generation(self, gather: bool):
        return unsharded(self.module, self.reshard_after) if gather else contextlib.nullcontext()

    def _state_dicts(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # a LoRA policy's frozen base is not the run's to save: it is reloaded. torch drops a frozen
        # parameter under one of its names only (named_parameters lists a tied tensor once), so
        # tied GPT-2's frozen lm_head.weight, the embedding again, stayed in every checkpoint
        model_sd, optim_sd = get_state_dict(self.module, self.opt, options=StateDictOptions(ignore_frozen_params=True))
        frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd

    def save(self, run_path: Path, step: int, rng: Any, elapsed: float, keep: int,
             extra: dict[str, Any] | None = None) -> None:
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = self._state_dicts()

        def write(path: Path) -> None:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / DCP_DIR))

        d = self.dist
        save_sharded_checkpoint(run_path, step, write, {"elapsed": elapsed, "scheduler": self.sched.state_dict()},
                                {"rng": rng, **(extra or {})}, d.rank, d.world_size, d.gather, keep, kind="fsdp2")

    def load(self, ckpt: Path, state: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = load_sharded_checkpoint(ckpt, self.dist.rank, self.dist.world_size, kind="fsdp2")
        model_sd, optim_sd = self._state_dicts()  # the shapes to load into (optimizer state initialized)
        box = {"model": model_sd, "optim": optim_sd}
        dcp.load(box, checkpoint_id=str(ckpt / DCP_DIR))
        # not strict: a LoRA policy's checkpoint has no frozen base (it is the warm start, already
        # loaded); every trainable parameter must be in it, checked here instead
        missing, unexpected = set_state_dict(self.module, self.opt, model_state_dict=box["model"], optim_state_dict=box["optim"],
                                             options=StateDictOptions(ignore_frozen_params=True, strict=False))
        check_loaded(ckpt, {n for n, p in self.module.named_parameters() if p.requires_grad}, missing, unexpected)
        self.sched.load_state_dict(state["scheduler"])
        return state


def check_loaded(ckpt: Path, trainable: set[str], missing: list[str], unexpected: list[str]) -> None:
    """After a load that was not strict: every trainable parameter came from the checkpoint and
    nothing in it was left over (a frozen base may be missing: it is the warm start, loaded)."""
    if unexpected or trainable & set(missing):
        raise RuntimeError(f"{ckpt}: the checkpoint does not fit the policy (trainable parameters missing: "
                           f"{sorted(trainable & set(missing))[:4]}, unexpected: {sorted(unexpected)[:4]})")
