"""The backends by name (``backend=plain|deepspeed|fsdp2``), and what any module may ask of a
model whatever placed it: whether its parameters are partitioned, a context with them whole, its
whole state, a whole copy of one parameter, and the policy's weights in a checkpoint. Each
question goes to the backend whose parameters these are (:meth:`datc.backends.base.Backend.owns`),
so no module outside ``datc/backends/`` knows a backend's markers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from datc.backends.base import Backend
from datc.backends.checks import backend_name
from datc.registry import Registry

BACKENDS: Registry[type[Backend]] = Registry("backend")


def _classes() -> list[type[Backend]]:
    if not BACKENDS.names():
        from datc.backends.deepspeed import DeepSpeedBackend
        from datc.backends.fsdp2 import FSDP2Backend
        from datc.backends.plain import PlainBackend

        for cls in (PlainBackend, DeepSpeedBackend, FSDP2Backend):
            BACKENDS.register(cls.name)(cls)
    return [BACKENDS.get(n) for n in BACKENDS.names()]


def backend_class(c) -> type[Backend]:
    _classes()
    return BACKENDS.get(backend_name(c))


def _owner(module) -> type[Backend] | None:
    params = list(module.parameters())
    for cls in _classes():
        if any(cls.owns(p) for p in params):
            return cls
    return None


def partitioned(module) -> bool:
    """Whether any of ``module``'s parameters is partitioned over ranks (by any backend)."""
    return _owner(getattr(module, "module", module)) is not None


def whole_parameters(module) -> contextlib.AbstractContextManager:
    """A context in which ``module``'s parameters are whole (every rank enters it where they are
    partitioned); nothing happens for a module no backend partitions."""
    module = getattr(module, "module", module)
    owner = _owner(module)
    return owner.whole(module) if owner is not None else contextlib.nullcontext()


def full_state_dict(module) -> dict[str, torch.Tensor]:
    """``module``'s state on the CPU, whole (collective where partitioned: every rank calls it)."""
    module = getattr(module, "module", module)
    owner = _owner(module)
    return (owner or Backend).full_state_dict(module)


@contextlib.contextmanager
def whole_state(module) -> Iterator[dict[str, torch.Tensor]]:
    """:func:`whole_parameters`, giving ``module``'s state dict with every tensor whole on every
    rank (collective where partitioned: every rank enters it). The owner is asked before the
    parameters are whole (unsharded, they no longer say who partitioned them)."""
    module = getattr(module, "module", module)
    owner = _owner(module)
    with owner.whole(module) if owner is not None else contextlib.nullcontext():
        yield (owner or Backend).whole_state(module)


def gathered(param: torch.Tensor) -> torch.Tensor:
    """A whole copy of one (possibly partitioned) parameter, detached (collective where partitioned)."""
    for cls in _classes():
        if cls.owns(param):
            return cls.gathered(param)
    return param.detach()


def checkpoint_weights(ckpt: Path, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The policy's fp32 weights in a checkpoint directory, whichever backend wrote it."""
    for cls in _classes():
        found = cls.checkpoint_weights(ckpt, state)
        if found is not None:
            return found
    return state["policy"]


def init(c):
    """This process's place (:class:`datc.backends.distributed.Dist`): the world-size checks, then
    the config's backend joins the process group (or stays alone: the plain backend)."""
    from datc.backends.distributed import check_world, env_world_size

    check_world(c, env_world_size())
    return backend_class(c).join(c)
