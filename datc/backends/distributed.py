"""Processes and DeepSpeed: who this process is, how ranks talk, and the DeepSpeed config.

With ``deepspeed=none`` a run is one plain PyTorch process and nothing here touches
``torch.distributed``. With a DeepSpeed stage (``deepspeed=zero2``, ``zero3``,
``zero3_offload``) every process runs the same spine on its own share of the prompts: each rank
samples whole groups (so group advantages never straddle ranks), and the loss normalizers are
summed over ranks so that the gradient equals the single-process gradient of the global batch.

Processes come from the ``deepspeed`` launcher or ``torchrun`` (``RANK``/``WORLD_SIZE``/...),
from Slurm through submitit (``SLURM_*``), or, for one process, from nothing at all.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

import torch

from datc.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Dist:
    """This process's place in the run. ``enabled`` is False for plain PyTorch (one process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    enabled: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled and self.world_size > 1:
            torch.distributed.barrier()

    @property
    def device(self) -> torch.device:
        """Where collectives run: this rank's GPU under NCCL, the CPU under gloo."""
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def sum(self, x: float | torch.Tensor) -> float:
        """Sum of a number (or a one-element tensor) over ranks."""
        return float(self.tensor_sum(torch.as_tensor(x, dtype=torch.float64, device=self.device)))

    def max(self, x: float) -> float:
        """Largest of a number over ranks."""
        if not (self.enabled and self.world_size > 1):
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not (self.enabled and self.world_size > 1):
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not (self.enabled and self.world_size > 1):
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Leave the process group (all ranks, at the end of a run): without it, gloo's threads
        can abort the interpreter at exit."""
        if self.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def tensor_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over ranks (a new tensor on ``x``'s device, which NCCL needs on the GPU)."""
        y = x.detach().clone()
        if self.enabled and self.world_size > 1:
            torch.distributed.all_reduce(y)
        return y

    def tensor_cat(self, x: torch.Tensor) -> torch.Tensor:
        """1-D ``x`` of every rank, concatenated in rank order (sizes may differ)."""
        parts = self.gather(x.detach().cpu())
        return torch.cat(parts).to(x.device)

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items (``n`` divisible by the world size)."""
        per = n // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)


def env_world_size() -> int:
    """The number of processes the launcher started (1 when none did)."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _export_env() -> None:
    """Fill the ``torch.distributed`` environment for the cases no launcher filled it: a Slurm
    job started by submitit (one task per device), or a lone process."""
    if all(k in os.environ for k in _ENV):
        return
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        try:
            from submitit.helpers import TorchDistributedEnvironment
        except ImportError as e:  # pragma: no cover - only on a cluster without the plugin
            raise ConfigError("deepspeed: under Slurm, install the [slurm] extra (submitit) or start with srun + torchrun") from e
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def check_world(c: TrainConfig, world_size: int) -> None:
    """The batch sizes must split evenly over ranks; said before any model loads."""
    t = c.trainer
    if c.deepspeed.stage is None:
        if world_size > 1:
            raise ConfigError(
                f"deepspeed: {world_size} processes were started but deepspeed=none runs one plain PyTorch process; "
                "choose deepspeed=zero2, zero3 or zero3_offload"
            )
        return
    prompts = t.batch_size // t.num_generations
    if prompts % world_size:
        raise ConfigError(
            f"trainer.batch_size: {prompts} prompts per step (batch_size / num_generations) do not split over "
            f"{world_size} processes; each rank samples whole groups, so use a multiple of {world_size * t.num_generations}"
        )
    if t.mini_batch_size % world_size:
        raise ConfigError(f"trainer.mini_batch_size: {t.mini_batch_size} does not split over {world_size} processes")
    per_rank = t.mini_batch_size // world_size
    if per_rank % micro_batch_per_rank(c, world_size):
        raise ConfigError(
            f"trainer.micro_batch_size: {t.micro_batch_size} must divide the per-process mini-batch "
            f"(mini_batch_size / processes = {per_rank})"
        )


def micro_batch_per_rank(c: TrainConfig, world_size: int) -> int:
    """Responses per forward/backward on one rank: ``micro_batch_size``, capped by the rank's
    share of a mini-batch. ``auto`` before the session resolves it (:mod:`datc.backends.micro_batch`):
    the rank's share, which only the checks and the frozen models' inference engines read then
    (it sizes nothing there)."""
    per_rank = c.trainer.mini_batch_size // world_size
    if c.trainer.micro_batch_size == "auto":
        return per_rank
    return min(c.trainer.micro_batch_size, per_rank)


def init(c: TrainConfig) -> Dist:
    """Join the process group (DeepSpeed stages) or stay alone (``deepspeed=none``)."""
    world = env_world_size()
    check_world(c, world)
    if c.deepspeed.stage is None:
        return Dist()
    _export_env()
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
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl", verbose=False)
    d = Dist(torch.distributed.get_rank(), torch.distributed.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), True)
    if not cpu:
        torch.cuda.set_device(d.local_rank)
    return d


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
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": list(t.adam_betas), "eps": 1e-8,
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


def gathered(param: torch.Tensor) -> torch.Tensor:
    """A full copy of a (possibly ZeRO-3 partitioned) parameter, detached."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().clone()
    return param.detach()
