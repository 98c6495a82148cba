"""The backend a config chooses, and the checks of ``backend`` and ``deepspeed`` against each
other, made by :func:`datc.checks.validate` before any model loads (imports no backend)."""

from __future__ import annotations

from datc.errors import ConfigError

BACKEND_NAMES = ("auto", "plain", "deepspeed", "fsdp2")


def backend_name(c) -> str:
    """The backend a config chooses (``auto`` resolved)."""
    name = c.backend.name
    if name == "auto":
        return "deepspeed" if c.deepspeed.stage is not None else "plain"
    return name


def check_backend(c) -> None:
    """``backend`` against ``deepspeed`` (``backend.name``'s choices are checked with the others'):
    said before any model loads."""
    name, stage = c.backend.name, c.deepspeed.stage
    if name == "deepspeed" and stage is None:
        raise ConfigError("backend=deepspeed needs a DeepSpeed stage: add deepspeed=zero2, zero3 or zero3_offload")
    if name in ("plain", "fsdp2") and stage is not None:
        raise ConfigError(f"backend={name} with deepspeed.stage={stage}: a run has one backend; "
                          f"use deepspeed=none with backend={name}, or backend=deepspeed")
    d = c.deepspeed
    if d.offload_param != "none" and d.stage != 3:
        raise ConfigError(f"deepspeed.offload_param: parameter offload needs deepspeed.stage=3, got stage {d.stage}")
    if d.offload_optimizer != "none" and d.stage not in (1, 2, 3):
        raise ConfigError(f"deepspeed.offload_optimizer: optimizer offload needs deepspeed.stage 1, 2 or 3, got {d.stage}")
