"""Processes: who this process is and how ranks talk.

With the plain backend a run is one PyTorch process and nothing here touches
``torch.distributed``. Under DeepSpeed (``deepspeed=zero2``, ``zero3``, ``zero3_offload``) or
FSDP2 (``backend=fsdp2``) every process runs the same spine on its own share of the prompts: each
rank samples whole groups (so group advantages never straddle ranks), and the loss normalizers
are summed over ranks so that the gradient equals the single-process gradient of the global
batch. The backend (:mod:`datc.backends.base`) joins the process group.

Processes come from the ``deepspeed`` launcher or ``torchrun`` (``RANK``/``WORLD_SIZE``/...),
from Slurm through submitit (``SLURM_*``), or, for one process, from nothing at all.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from datc.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Dist:
    """This process's place in the run. ``enabled``: in a process group (DeepSpeed, FSDP2); False
    for the plain backend's one process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    enabled: bool = False
    owns_group: bool = True  # this run joined the process group, so it leaves it (not one its caller made)

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
        can abort the interpreter at exit. A group the caller had made before the run (a script
        running several ``train`` calls in one launch) stays for the caller."""
        if self.enabled and self.owns_group and torch.distributed.is_initialized():
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


def join_group(init: Callable[[], None]) -> Dist:
    """This process in the run's process group: ``init()`` joins it unless the caller already has
    (a script running several runs in one launch; the group then stays the caller's, see
    :meth:`Dist.close`); on GPUs the rank's own device is made current."""
    owns = not torch.distributed.is_initialized()
    if owns:
        init()
    d = Dist(torch.distributed.get_rank(), torch.distributed.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), True,
             owns_group=owns)
    if torch.cuda.is_available():
        torch.cuda.set_device(d.local_rank)
    return d


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


def export_env() -> None:
    """Fill the ``torch.distributed`` environment for the cases no launcher filled it: a Slurm
    job started by submitit (one task per device), or a lone process."""
    if all(k in os.environ for k in _ENV):
        return
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        try:
            from submitit.helpers import TorchDistributedEnvironment
        except ImportError as e:  # pragma: no cover - only on a cluster without the plugin
            raise ConfigError("backend: under Slurm, install the [slurm] extra (submitit) or start with srun + torchrun") from e
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def check_world(c: TrainConfig, world_size: int) -> None:
    """The batch sizes must split evenly over ranks; said before any model loads."""
    from datc.backends.checks import backend_name

    t = c.trainer
    if backend_name(c) == "plain":
        if world_size > 1:
            raise ConfigError(
                f"backend: {world_size} processes were started but the plain backend runs one PyTorch process; "
                "choose deepspeed=zero2, zero3 or zero3_offload, or backend=fsdp2"
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
    share of a mini-batch. ``auto`` before the session resolves it (:mod:`datc.memory.micro_batch`):
    the rank's share, which only the checks and the frozen models' inference engines read then
    (it sizes nothing there)."""
    per_rank = c.trainer.mini_batch_size // world_size
    if c.trainer.micro_batch_size == "auto":
        return per_rank
    return min(c.trainer.micro_batch_size, per_rank)
